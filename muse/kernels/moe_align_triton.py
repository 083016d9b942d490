"""`align_pairs` in one Triton launch.

The torch version (`moe_align.align_pairs`, the twin) is a chain of about twenty small ops
(a sort, scatters, cumulative sums, a search), each a few microseconds of GPU work behind tens
of microseconds of host work: in an eager prefill step the GPU waits for the host through the
whole chain, every MoE layer (docs/performance.md, "Prefill: where the GPU waits for the
host"). Here one program per expert computes the same result:

1. the histogram of every pair's expert (each program counts all pairs: a few hundred
   thousand ids at most, read from L2), its padded run lengths and their running sum, so each
   program knows where its expert's run starts;
2. its own pairs, in pair order (stable, as the twin's sort), written from that start, then
   the sentinel on the run's padding rows and the expert's id on the run's blocks;
3. the last program also fills the rows and blocks past the last run (sentinel, -1).

The output equals the twin's exactly. Shapes are fixed by the input shapes and nothing is read
back to the host, so it is capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse.kernels.moe_align import max_padded_pairs
from muse.kernels.pdl import pdl_options, start_dependent_kernel

# Pairs read at a time.
CHUNK = 1024


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, padded_len,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                  PDL: tl.constexpr):
    start_dependent_kernel(PDL)
    expert = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)

    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for first in range(0, num_pairs, CHUNK):
        pairs = first + lanes
        valid = pairs < num_pairs
        ids = tl.load(ids_ptr + pairs, mask=valid, other=0).to(tl.int32)
        counts += tl.histogram(ids, BLOCK_E, mask=valid)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    mine = experts == expert
    count = tl.sum(tl.where(mine, counts, 0))
    run_end = tl.sum(tl.where(mine, ends, 0))
    run_start = run_end - tl.sum(tl.where(mine, padded, 0))

    written = run_start
    for first in range(0, num_pairs, CHUNK):
        pairs = first + lanes
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        hit = (ids == expert).to(tl.int32)
        rank = tl.cumsum(hit, 0) - 1
        tl.store(sorted_ptr + written + rank, pairs.to(tl.int64), mask=hit > 0)
        written += tl.sum(hit)
    # The run's padding (fewer than BLOCK_M rows) and its blocks.
    padding = run_start + count + tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + padding, tl.full([BLOCK_M], 0, tl.int64) + num_pairs,
             mask=padding < run_end)
    for block in range(run_start // BLOCK_M, run_end // BLOCK_M):
        tl.store(block_expert_ptr + block, expert.to(tl.int64))

    if expert == num_experts - 1:  # past the last run: sentinel rows, blocks of no expert
        total = tl.sum(padded)
        for first in range(total, padded_len, CHUNK):
            rows = first + lanes
            tl.store(sorted_ptr + rows, tl.full([CHUNK], 0, tl.int64) + num_pairs,
                     mask=rows < padded_len)
        for first in range(total // BLOCK_M, padded_len // BLOCK_M, CHUNK):
            blocks = first + lanes
            tl.store(block_expert_ptr + blocks, tl.full([CHUNK], -1, tl.int64),
                     mask=blocks < padded_len // BLOCK_M)


def align_pairs_triton(expert_ids: torch.Tensor, num_experts: int, block_m: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_align.align_pairs` (same arguments and result) in one launch."""
    flat = expert_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_pairs = flat.numel()
    padded_len = max_padded_pairs(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(padded_len, dtype=torch.int64, device=flat.device)
    block_expert = torch.empty(padded_len // block_m, dtype=torch.int64, device=flat.device)
    _align_kernel[(num_experts,)](
        flat, sorted_pairs, block_expert, num_pairs, num_experts, padded_len,
        BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts), CHUNK=CHUNK,
        **pdl_options(flat.device))
    return sorted_pairs, block_expert
