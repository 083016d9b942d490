"""A verify step built on the device from the verify step before it, before that one is read
back: speculation's overlapped schedule.

A plain decode step can be launched before its predecessor is read back because its shape
is known: one token per request, the sampled one, which the device already holds. A verify
step's is not, on the host: where each request's next block starts depends on how many of its
drafts the step before accepted. On the device it is all there: the accepted count t, the
token emitted last (the anchor of the next block), and the next drafts, which the drafter made
right behind the verification. So the next step's inputs are made there, request r's block
at positions p .. p + q - 1 with p = start_r + t_r + 1:

    input_ids  anchor_r, draft_r,1 .. draft_r,q-1
    positions  p .. p + q - 1
    slots      block_table_r[position // block_size] * block_size + position % block_size
    seq_lens   p + q

The host gives what does not depend on t: the block tables, with blocks allocated for the
longest case (every draft accepted), starting at the window's first block for the earliest
case. Attention masks keys by position, so blocks in the table that a later start no longer
needs are never read.

`ChainedBatch` is that step's batch; the worker copies it into a verify graph's buffers or runs
it eagerly (`BatchMetadata` straight from its tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from muse.engine.transfer import to_device
from muse.kernels.attention_metadata import BatchMetadata, KindMetadata


@dataclass
class ChainedBatch:
    """A verify step of `num_requests` requests of `query_len` tokens each, on the device."""

    query_len: int
    input_ids: torch.Tensor  # [requests * query_len]
    positions: torch.Tensor  # [requests * query_len]
    seq_lens: torch.Tensor  # [requests]
    slots: dict[str, torch.Tensor]  # kind -> [requests * query_len]
    tables: dict[str, torch.Tensor]  # kind -> [requests, width] from each first block
    first_blocks: dict[str, torch.Tensor]  # kind -> [requests]
    host_tables: dict[str, list[list[int]]]  # the tables' rows as the host built them
    block_size: int
    kv_transfers: object = None  # copies between KV tiers to make first (`KVTransfers`)

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def table_width(self, kind: str) -> int:
        return self.tables[kind].shape[1]

    def metadata(self) -> BatchMetadata:
        """The step as the model reads it eagerly."""
        requests, q = self.num_requests, self.query_len
        device = self.input_ids.device
        return BatchMetadata(
            positions=self.positions,
            token_request=torch.arange(requests, device=device).repeat_interleave(q),
            query_start=torch.arange(requests + 1, device=device) * q,
            seq_lens=self.seq_lens, max_query_len=q,
            kinds={kind: KindMetadata(self.slots[kind], self.tables[kind],
                                      self.first_blocks[kind]) for kind in self.slots},
            block_size=self.block_size)


def chained_batch(accepted: torch.Tensor, emitted: torch.Tensor, drafts: torch.Tensor,
                  starts: list[int], tables: dict[str, list[list[int]]],
                  first_blocks: dict[str, list[int]], block_size: int) -> ChainedBatch:
    """The verify step after one whose requests started at `starts` (the position of the token
    before their drafts) and accepted `accepted` [R] drafts, emitting `emitted` [R, >= t + 1]
    (the accepted drafts and one more); `drafts` [R, q - 1] are the next block's drafts.
    `tables[kind][r]` holds request r's blocks from block `first_blocks[kind][r]` on, enough
    for its longest case. Only device work: nothing here waits for the step before."""
    requests, q = drafts.shape[0], drafts.shape[1] + 1
    device = drafts.device
    kinds = list(tables)
    widths = [max(len(row) for row in tables[kind]) for kind in kinds]
    staged = to_device(starts + [block for kind in kinds for block in first_blocks[kind]]
                       + [block for kind, width in zip(kinds, widths) for row in tables[kind]
                          for block in row + [0] * (width - len(row))], device)
    start, *rest = staged.split([requests] * (1 + len(kinds))
                                + [requests * width for width in widths])
    firsts, flat_tables = rest[:len(kinds)], rest[len(kinds):]
    anchors = emitted.gather(1, accepted[:, None])
    first_position = start + accepted + 1
    positions = first_position[:, None] + torch.arange(q, device=device)
    slots, device_tables, device_firsts = {}, {}, {}
    for kind, first, flat, width in zip(kinds, firsts, flat_tables, widths):
        table = flat.view(requests, width)
        blocks = table.gather(1, positions // block_size - first[:, None])
        slots[kind] = (blocks * block_size + positions % block_size).view(-1)
        device_tables[kind], device_firsts[kind] = table, first
    return ChainedBatch(
        query_len=q, input_ids=torch.cat([anchors, drafts], dim=1).view(-1),
        positions=positions.view(-1), seq_lens=first_position + q, slots=slots,
        tables=device_tables, first_blocks=device_firsts, host_tables=tables,
        block_size=block_size)
