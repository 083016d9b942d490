"""The one-launch block copy of `muse.kernels.kv_blocks.KVBlocks` (see there)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse.kernels.kv_blocks import TILE


@triton.jit
def _copy_blocks_kernel(table_ptr, index_ptr, rows_ptr, starts_ptr, sizes_ptr,
                        WORDS: tl.constexpr, PAIRS: tl.constexpr, TILE: tl.constexpr,
                        TO_ROWS: tl.constexpr, GROUPED: tl.constexpr):
    i = tl.program_id(0)
    pair = tl.program_id(1)  # layer * 2 + (0: K, 1: V)
    offsets = tl.program_id(2) * TILE + tl.arange(0, TILE)
    mask = offsets < WORDS
    block = tl.load(index_ptr + i).to(tl.int64)
    cache = tl.load(table_ptr + pair).to(tl.pointer_type(rows_ptr.dtype.element_ty))
    cache_words = cache + block * WORDS + offsets
    if GROUPED:  # the pair's group's rows [blocks, its pairs] follow the earlier groups'
        start = tl.load(starts_ptr + pair).to(tl.int64)
        size = tl.load(sizes_ptr + pair).to(tl.int64)
        row = start * tl.num_programs(0) + i.to(tl.int64) * size + (pair - start)
    else:
        row = i.to(tl.int64) * PAIRS + pair
    row_words = rows_ptr + row * WORDS + offsets
    if TO_ROWS:
        tl.store(row_words, tl.load(cache_words, mask=mask), mask=mask)
    else:
        tl.store(cache_words, tl.load(row_words, mask=mask), mask=mask)


def copy_blocks(table: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, words: int,
                to_rows: bool, groups: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> None:
    """Between the caches whose addresses `table` holds (K and V of each layer in turn) and
    `rows` (int32 words, [len(index), len(table), words]): cache block index[i] of the pair
    p is row word range [i, p]. `to_rows`: caches -> rows; else rows -> caches.

    groups: (first pair of p's group, pairs in p's group) for each pair p: the rows are then
    each group's [len(index), its pairs, words] one after the other."""
    pairs = table.numel()
    grid = (index.numel(), pairs, triton.cdiv(words, TILE))
    starts, sizes = groups if groups is not None else (table, table)  # unread without groups
    _copy_blocks_kernel[grid](table, index, rows, starts, sizes, WORDS=words, PAIRS=pairs,
                              TILE=TILE, TO_ROWS=to_rows, GROUPED=groups is not None,
                              num_warps=4)
