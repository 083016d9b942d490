"""Grouping a MoE layer's (token, slot) pairs by expert into fixed-size blocks.

The Triton experts path (`moe_triton.py`) runs it before its GEMMs: torch ops of static
shapes only, so it can run inside a captured CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Applied to the float32 per-pair expert outputs before the per-expert norm and the combine
# (the tensor-parallel all-reduce of intermediate-sharded experts).
PairReduce = Callable[[torch.Tensor], torch.Tensor]


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case length of the sorted, padded pair list, a multiple of `block_m`.

    At most min(pairs, experts) experts receive a pair, and each wastes < block_m rows of
    padding; this is tighter than experts * (block_m - 1) when decoding (8 pairs, 128 experts).
    """
    bound = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_pairs(expert_ids: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs by expert into blocks of `block_m` rows.

    Returns sorted_pairs [max_padded] int64 (pair ids, the sentinel T*k on padding rows) and
    block_expert [max_padded // block_m] int64 (the expert of each block, -1 past the last
    used block). Every op has an output shape fixed by the input shapes and never reads a
    value back to the host (no nonzero/unique/.item(); bincount's output size would depend on
    the largest id on CUDA, so the counts come from scatter_add into a fixed [E]).
    """
    flat = expert_ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    padded_len = max_padded_pairs(num_pairs, num_experts, block_m)

    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_end = padded_counts.cumsum(0)
    padded_start = padded_end - padded_counts
    start = counts.cumsum(0) - counts

    # A pair's destination: its expert's padded start plus its rank among that expert's pairs.
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - start[sorted_experts]
    dest = padded_start[sorted_experts] + rank
    sorted_pairs = torch.full((padded_len,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, dest, order)

    # The block starting at row r belongs to the first expert whose padded run ends after r;
    # experts without pairs have empty runs and are skipped by the search.
    block_start = torch.arange(0, padded_len, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_pairs, block_expert
