"""How many KV blocks each attention kind gets out of a memory budget."""

from __future__ import annotations

import torch

from muse.config import FULL, SLIDING, TextConfig

CPU_DEFAULT_KV_BYTES = 256 * 2**20


def block_bytes(config: TextConfig, block_size: int, dtype: torch.dtype,
                num_kv_heads: int | None = None) -> dict[str, int]:
    """Bytes one block of each kind takes over all layers of that kind (K and V), with
    `num_kv_heads` per layer (a rank's share; default: all of the model's) and elements of
    the KV cache's `dtype` (1 byte for FP8, so twice the blocks of BF16 in one budget)."""
    heads = config.num_key_value_heads if num_kv_heads is None else num_kv_heads
    per_layer = 2 * block_size * heads * config.head_dim * dtype.itemsize
    return {kind: per_layer * config.layer_types.count(kind) for kind in dict.fromkeys(config.layer_types)}


def split_blocks(config: TextConfig, budget: int, block_size: int, dtype: torch.dtype,
                 max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, num_kv_heads: int | None = None,
                 draft_block_bytes: int = 0) -> dict[str, int]:
    """Blocks per kind (the null block included).

    `draft_block_bytes`: what each global-attention block also holds elsewhere (a drafter's
    context rows, which share the global layers' block tables).

    Sliding layers never hold more tokens than global ones, and each running request keeps at
    most a window plus the chunk it computes; the sliding pool gets that much for every
    sequence, twice over so cached windows of shared prefixes can stay, and global layers get
    the rest. No pool gets more than `max_num_seqs` full-length sequences could hold: a small
    model on a large GPU would otherwise take all its memory for blocks nobody can use.
    """
    sizes = block_bytes(config, block_size, dtype, num_kv_heads)
    if FULL in sizes:
        sizes[FULL] += draft_block_bytes
    most = max_num_seqs * -(-max_model_len // block_size) + 1
    if len(sizes) == 1:
        (kind, size), = sizes.items()
        return {kind: min(budget // size, most)}
    sliding, full = sizes[SLIDING], sum(v for k, v in sizes.items() if k != SLIDING)
    equal = budget // (sliding + full)
    window_blocks = -(-config.sliding_window // block_size) + 1
    need = max_num_seqs * (window_blocks + 1) + -(-max_num_batched_tokens // block_size)
    num_sliding = min(equal, 2 * need, most)
    num_full = min((budget - num_sliding * sliding) // full, most)
    return {kind: num_sliding if kind == SLIDING else num_full for kind in sizes}
