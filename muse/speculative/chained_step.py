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
it eagerly (`BatchMetadata` straight from its tensors). Its per-token rows (input ids,
positions, each kind's slots) and per-request rows (context lengths, each kind's first block)
are two stacked tensors, laid out as a graph's input buffers, so the step reaches a graph in
two copies. They are made by `chained_rows`: a dozen small tensor operations on the host's
side for every step, so on a GPU one Triton launch (`muse.kernels.chained_rows_triton`) of
which `chained_rows_torch` is the twin; the host's time per step is what a batch-1 verify
step waits on.
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
    token_rows: torch.Tensor  # [2 + kinds, requests * query_len]: ids, positions, slots
    request_rows: torch.Tensor  # [1 + kinds, requests]: seq_lens, first blocks
    kinds: list[str]
    # Each kind's block tables from each request's first block, padded to one width
    # [kinds, requests, width]; `widths`: each kind's own width.
    padded_tables: torch.Tensor
    widths: dict[str, int]
    host_tables: dict[str, list[list[int]]]  # the tables' rows as the host built them
    block_size: int
    kv_transfers: object = None  # copies between KV tiers to make first (`KVTransfers`)

    @property
    def input_ids(self) -> torch.Tensor:
        return self.token_rows[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.token_rows[1]

    @property
    def slots(self) -> dict[str, torch.Tensor]:
        return {kind: self.token_rows[2 + i] for i, kind in enumerate(self.kinds)}

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.request_rows[0]

    @property
    def first_blocks(self) -> dict[str, torch.Tensor]:
        return {kind: self.request_rows[1 + i] for i, kind in enumerate(self.kinds)}

    @property
    def num_requests(self) -> int:
        return self.request_rows.shape[1]

    @property
    def num_tokens(self) -> int:
        return self.token_rows.shape[1]

    def table_width(self, kind: str) -> int:
        return self.widths[kind]

    @property
    def tables(self) -> dict[str, torch.Tensor]:
        """Each kind's tables [requests, its width], contiguous: copies made on each call
        (for the eager path; a graph takes `host_tables`' changed rows)."""
        return {kind: self.padded_tables[i, :, :self.widths[kind]].contiguous()
                for i, kind in enumerate(self.kinds)}

    def metadata(self) -> BatchMetadata:
        """The step as the model reads it eagerly."""
        requests, q = self.num_requests, self.query_len
        device = self.token_rows.device
        slots, firsts, tables = self.slots, self.first_blocks, self.tables
        return BatchMetadata(
            positions=self.positions,
            token_request=torch.arange(requests, device=device).repeat_interleave(q),
            query_start=torch.arange(requests + 1, device=device) * q,
            seq_lens=self.seq_lens, max_query_len=q,
            kinds={kind: KindMetadata(slots[kind], tables[kind], firsts[kind])
                   for kind in self.kinds},
            block_size=self.block_size)


def chained_batch(accepted: torch.Tensor, emitted: torch.Tensor, drafts: torch.Tensor,
                  starts: list[int], tables: dict[str, list[list[int]]],
                  first_blocks: dict[str, list[int]], block_size: int,
                  use_triton: bool | None = None) -> ChainedBatch:
    """The verify step after one whose requests started at `starts` (the position of the token
    before their drafts) and accepted `accepted` [R] drafts, emitting `emitted` [R, >= t + 1]
    (the accepted drafts and one more); `drafts` [R, q - 1] are the next block's drafts.
    `tables[kind][r]` holds request r's blocks from block `first_blocks[kind][r]` on, enough
    for its longest case. Only device work: nothing here waits for the step before.
    `use_triton`: the one-launch kernel (default: on a GPU)."""
    requests = drafts.shape[0]
    kinds = list(tables)
    width = max(len(row) for kind in kinds for row in tables[kind])
    # One copy from the host: the starts, each kind's first blocks, each kind's tables padded
    # to one width [kinds, R, width].
    staged = to_device(starts + [block for kind in kinds for block in first_blocks[kind]]
                       + [block for kind in kinds for row in tables[kind]
                          for block in row + [0] * (width - len(row))], drafts.device)
    start, firsts, flat = staged.split([requests, len(kinds) * requests,
                                        len(kinds) * requests * width])
    padded = flat.view(len(kinds), requests, width)
    use_triton = drafts.is_cuda if use_triton is None else use_triton
    if use_triton:
        from muse.kernels.chained_rows_triton import chained_rows
    else:
        chained_rows = chained_rows_torch
    token_rows, request_rows = chained_rows(accepted, emitted, drafts, start,
                                            firsts.view(len(kinds), requests), padded,
                                            block_size)
    return ChainedBatch(
        query_len=drafts.shape[1] + 1, token_rows=token_rows, request_rows=request_rows,
        kinds=kinds, padded_tables=padded,
        widths={kind: max(len(row) for row in tables[kind]) for kind in kinds},
        host_tables=tables, block_size=block_size)


def chained_rows_torch(accepted: torch.Tensor, emitted: torch.Tensor, drafts: torch.Tensor,
                       starts: torch.Tensor, firsts: torch.Tensor, tables: torch.Tensor,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chained step's rows: token rows [2 + K, R * q] (input ids, positions, then each of
    the K kinds' cache slots) and request rows [1 + K, R] (context lengths, then each kind's
    first block), from accepted [R], emitted [R, >= t + 1], drafts [R, q - 1], starts [R],
    firsts [K, R] and tables [K, R, width] (kind k's blocks of request r from its first)."""
    requests, q = drafts.shape[0], drafts.shape[1] + 1
    anchors = emitted.gather(1, accepted[:, None])
    first_position = starts + accepted + 1
    positions = first_position[:, None] + torch.arange(q, device=drafts.device)
    blocks = tables.gather(2, (positions // block_size - firsts[..., None]))
    slots = blocks * block_size + positions % block_size
    token_rows = torch.cat([torch.cat([anchors, drafts], dim=1)[None], positions[None], slots])
    request_rows = torch.cat([(first_position + q)[None], firsts])
    return token_rows.view(-1, requests * q), request_rows
