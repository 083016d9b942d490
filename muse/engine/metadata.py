"""A step's metadata on the host (built from per-request entries), and its copy to the device as
the model's `BatchMetadata`."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from muse.engine.kv_cache import window_start_block
from muse.engine.kv_transfers import KVTransfers
from muse.engine.transfer import to_device
from muse.kernels.attention_metadata import BatchMetadata, KindMetadata

if TYPE_CHECKING:
    from muse.engine.request import Request
    from muse.engine.scheduler import ScheduledRequest

    BlockTables = Callable[[Request], dict[str, list[int]]]


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
    dp_num_tokens: list[int] | None = None  # see BatchMetadata
    # Encoder rows that replace some of the step's token embeddings
    # (`muse.multimodal.engine_inputs.MediaSlice`); a step with any runs eagerly.
    media: list = field(default_factory=list)
    # Copies between the KV tiers made before the step (`muse.engine.kv_transfers`).
    kv_transfers: KVTransfers | None = None
    # Each request's LoRA adapter slot (-1: the base model); None when no request of the step
    # uses an adapter (such steps run as without LoRA, CUDA graphs included).
    lora_slots: list[int] | None = None

    @classmethod
    def dummy(cls, kinds: list[str], num_tokens: int = 1, block_size: int = 1,
              num_requests: int = 1) -> HostBatch:
        """Requests of `num_tokens` tokens each whose K/V goes to the null block and which read
        only that block: what an idle data-parallel rank runs so that the MoE collectives of
        the busy ones meet, the memory profile's largest step, and the step-cost profile's
        steps."""
        width = -(-num_tokens // block_size)
        total = num_tokens * num_requests
        return cls(kinds=kinds, max_query_len=num_tokens, input_ids=[0] * total,
                   positions=list(range(num_tokens)) * num_requests,
                   token_request=[r for r in range(num_requests) for _ in range(num_tokens)],
                   query_start=list(range(0, total + 1, num_tokens)),
                   seq_lens=[num_tokens] * num_requests,
                   slots={kind: [0] * total for kind in kinds},
                   tables={kind: [[0] * width] * num_requests for kind in kinds},
                   first_blocks={kind: [0] * num_requests for kind in kinds})

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

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

    def split(self, num_parts: int) -> list[tuple[HostBatch, range]]:
        """Up to `num_parts` sub-batches of contiguous requests (pipeline micro-batches), each
        with its tokens' range in this batch, in order.

        Requests are never split, so there are at most `num_requests` parts. Each cut is the
        request boundary nearest an equal share of the tokens, which keeps every part within
        one request of `num_tokens / parts`. The parts depend on the requests' token counts
        alone (`query_start`), which every rank of a step agrees on, so all pipeline stages cut
        the step the same way.
        """
        parts = max(1, min(num_parts, self.num_requests))
        if parts == 1:
            return [(self, range(self.query_start[-1]))]
        starts, cuts = self.query_start, [0]
        for k in range(1, parts):
            target = starts[-1] * k / parts
            cut = bisect_left(starts, target)
            if target - starts[cut - 1] <= starts[cut] - target:
                cut -= 1
            # Leave at least one request for this part and for each after it.
            cuts.append(min(max(cut, cuts[-1] + 1), self.num_requests - (parts - k)))
        cuts.append(self.num_requests)
        return [self._requests(first, end) for first, end in zip(cuts, cuts[1:])]

    def _requests(self, first: int, end: int) -> tuple[HostBatch, range]:
        """Requests first..end-1 as a batch of their own, and their tokens' range here."""
        tokens = range(self.query_start[first], self.query_start[end])
        return self.token_slice(tokens.start, tokens.stop), tokens

    def token_slice(self, start: int, end: int) -> HostBatch:
        """Tokens start..end-1 as a batch of their own: the requests they belong to, each
        with the queries of its own in the range (a request cut at `end` attends as if its
        context ended there, which causality makes exact)."""
        first, last = self.token_request[start], self.token_request[end - 1]
        lengths = [min(self.query_start[r + 1], end) - max(self.query_start[r], start)
                   for r in range(first, last + 1)]
        query_start = [0]
        for length in lengths:
            query_start.append(query_start[-1] + length)
        return HostBatch(
            kinds=list(self.kinds), max_query_len=max(lengths),
            input_ids=self.input_ids[start:end], positions=self.positions[start:end],
            token_request=[r - first for r in self.token_request[start:end]],
            query_start=query_start,
            seq_lens=[self.positions[start + q_end - 1] + 1 for q_end in query_start[1:]],
            slots={kind: slots[start:end] for kind, slots in self.slots.items()},
            tables={kind: tables[first:last + 1] for kind, tables in self.tables.items()},
            first_blocks={kind: blocks[first:last + 1]
                          for kind, blocks in self.first_blocks.items()},
            dp_num_tokens=self.dp_num_tokens,
            lora_slots=self.lora_slots[first:last + 1] if self.lora_slots is not None
            else None)

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
        if self.lora_slots is not None:
            parts.append(self.lora_slots)
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
            block_size=block_size, dp_num_tokens=self.dp_num_tokens,
            lora_slots=pieces[-1] if self.lora_slots is not None else None)
        return input_ids, meta


class BatchEntry(NamedTuple):
    """One scheduled request as the batch needs it."""

    token_ids: list[int]  # the step's input tokens, positions start..start+num_new_tokens-1
    start: int  # tokens whose KV is already cached
    num_new_tokens: int
    tables: dict[str, list[int]]  # whole block table per kind


def build_host_batch(kinds: Sequence[str], block_size: int, sliding_window: int | None,
                     entries: Iterable[BatchEntry]) -> HostBatch:
    """The step's batch, requests in the order of `entries` (the driver and every mirror build
    it with this one function, so they agree)."""
    batch = HostBatch(kinds=list(kinds), max_query_len=0)
    for index, (token_ids, start, num_new_tokens, tables) in enumerate(entries):
        end = start + num_new_tokens
        batch.max_query_len = max(batch.max_query_len, num_new_tokens)
        batch.input_ids.extend(token_ids)
        new_positions = range(start, end)
        batch.positions.extend(new_positions)
        batch.token_request.extend([index] * num_new_tokens)
        batch.query_start.append(batch.query_start[-1] + num_new_tokens)
        batch.seq_lens.append(end)
        for kind in batch.kinds:
            table = tables[kind]
            batch.slots[kind].extend(table[p // block_size] * block_size + p % block_size
                                     for p in new_positions)
            first = window_start_block(kind, start, sliding_window, block_size)
            batch.first_blocks[kind].append(first)
            batch.tables[kind].append(table[first:-(-end // block_size)])
    return batch


def scheduled_entries(scheduled: Iterable[ScheduledRequest], block_tables: BlockTables
                      ) -> Iterator[BatchEntry]:
    """The driver's entries, read from its requests (before `num_computed_tokens` advances)."""
    for item in scheduled:
        request, start = item.request, item.request.num_computed_tokens
        yield BatchEntry(request.token_ids(start, start + item.num_new_tokens), start,
                         item.num_new_tokens, block_tables(request))
