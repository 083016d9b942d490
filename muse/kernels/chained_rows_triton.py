"""The one-launch twin of `muse.speculative.chained_step.chained_rows_torch` (see there):
program r writes request r's q token rows and its request rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _chained_rows_kernel(accepted_ptr, accepted_stride, emitted_ptr, emitted_stride,
                         emitted_column, drafts_ptr, drafts_stride, drafts_column, starts_ptr,
                         firsts_ptr, tables_ptr, token_rows_ptr, request_rows_ptr, requests,
                         width,
                         Q: tl.constexpr, Q_POW2: tl.constexpr, KINDS: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr):
    r = tl.program_id(0)
    j = tl.arange(0, Q_POW2)
    in_query = j < Q
    t = tl.load(accepted_ptr + r * accepted_stride)
    first_position = tl.load(starts_ptr + r) + t + 1
    positions = first_position + j
    anchor = tl.load(emitted_ptr + r * emitted_stride + t * emitted_column)
    drafts = tl.load(drafts_ptr + r * drafts_stride + (j - 1) * drafts_column,
                     mask=in_query & (j > 0), other=0)
    tokens = requests * Q
    row = r * Q + j
    tl.store(token_rows_ptr + row, tl.where(j == 0, anchor, drafts), mask=in_query)
    tl.store(token_rows_ptr + tokens + row, positions, mask=in_query)
    tl.store(request_rows_ptr + r, first_position + Q)
    for k in tl.static_range(KINDS):
        first = tl.load(firsts_ptr + k * requests + r)
        block = tl.load(tables_ptr + (k * requests + r) * width + positions // BLOCK_SIZE - first,
                        mask=in_query, other=0)
        tl.store(token_rows_ptr + (2 + k) * tokens + row,
                 block * BLOCK_SIZE + positions % BLOCK_SIZE, mask=in_query)
        tl.store(request_rows_ptr + (1 + k) * requests + r, first)


def chained_rows(accepted: torch.Tensor, emitted: torch.Tensor, drafts: torch.Tensor,
                 starts: torch.Tensor, firsts: torch.Tensor, tables: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`chained_rows_torch` in one launch (integer tensors; accepted, emitted and drafts may
    be strided views)."""
    requests, q = drafts.shape[0], drafts.shape[1] + 1
    kinds, width = tables.shape[0], tables.shape[2]
    token_rows = torch.empty(2 + kinds, requests * q, dtype=torch.long, device=drafts.device)
    request_rows = torch.empty(1 + kinds, requests, dtype=torch.long, device=drafts.device)
    _chained_rows_kernel[(requests,)](
        accepted, accepted.stride(0), emitted, *emitted.stride(), drafts, *drafts.stride(),
        starts.contiguous(), firsts.contiguous(), tables.contiguous(), token_rows,
        request_rows, requests, width, Q=q, Q_POW2=triton.next_power_of_2(q), KINDS=kinds,
        BLOCK_SIZE=block_size, num_warps=1)
    return token_rows, request_rows
