"""A step's metadata on the host, and its copy to the device as the model's `BatchMetadata`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from muse.engine.transfer import to_device
from muse.kernels.attention_metadata import BatchMetadata, KindMetadata


@dataclass
class HostBatch:
    """A step's metadata as Python lists, before it goes to the device: eagerly as tensors of
    the step's own sizes (`to_device`), or copied into a captured graph's padded buffers."""

    kinds: list[str]
    max_query_len: int
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    token_request: list[int] = field(default_factory=list)
    query_start: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    slots: dict[str, list[int]] = field(default_factory=dict)
    tables: dict[str, list[list[int]]] = field(default_factory=dict)
    first_blocks: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kind in self.kinds:
            self.slots.setdefault(kind, [])
            self.tables.setdefault(kind, [])
            self.first_blocks.setdefault(kind, [])

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    def table_width(self, kind: str) -> int:
        return max(len(table) for table in self.tables[kind])

    def to_device(self, device: torch.device, block_size: int
                  ) -> tuple[torch.Tensor, BatchMetadata]:
        """input_ids and metadata as tensors (views of one copy), block tables padded with the
        null block."""
        parts = [self.input_ids, self.positions, self.token_request, self.query_start,
                 self.seq_lens]
        widths = {kind: self.table_width(kind) for kind in self.kinds}
        for kind, width in widths.items():
            padded = [v for table in self.tables[kind] for v in table + [0] * (width - len(table))]
            parts += [self.slots[kind], self.first_blocks[kind], padded]
        pieces = to_device([v for part in parts for v in part], device).split(
            [len(part) for part in parts])
        input_ids, positions, token_request, query_start, seq_lens = pieces[:5]
        kinds = {}
        for i, (kind, width) in enumerate(widths.items()):
            slots, first_blocks, tables = pieces[5 + 3 * i:8 + 3 * i]
            kinds[kind] = KindMetadata(slots, tables.view(self.num_requests, width), first_blocks)
        meta = BatchMetadata(
            positions=positions, token_request=token_request, query_start=query_start,
            seq_lens=seq_lens, max_query_len=self.max_query_len, kinds=kinds,
            block_size=block_size)
        return input_ids, meta
