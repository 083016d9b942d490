"""Random paged-attention batches, with metadata built the way the runner builds it: permuted
block tables padded with the null block 0, and sliding layers' tables starting at the first
block the window still needs."""

from __future__ import annotations

import torch

from muse.kernels.attention_metadata import BatchMetadata, KindMetadata


def make_batch(requests: list[tuple[int, int]], *, block_size: int, window: int | None,
               kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, device: str,
               seed: int = 0, extra_width: int = 0):
    """Random q and caches plus metadata for requests given as (cached tokens, new tokens)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(cached + new) // block_size) for cached, new in requests]
    num_blocks = sum(needed) + 3  # a few never-used blocks besides the null block
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    positions, token_request, query_start, seq_lens = [], [], [0], []
    slots, tables, firsts = [], [], []
    for index, ((cached, new), count) in enumerate(zip(requests, needed)):
        table, free = free[:count], free[count:]
        end = cached + new
        positions += range(cached, end)
        token_request += [index] * new
        query_start.append(query_start[-1] + new)
        seq_lens.append(end)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(cached, end)]
        first = 0 if window is None else max(0, cached - window + 1) // block_size
        firsts.append(first)
        tables.append(table[first:])
    # extra_width: tables wider than any request needs, as a captured graph's are.
    width = max(len(t) for t in tables) + extra_width

    def tensor(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    kind = KindMetadata(tensor(slots), tensor([t + [0] * (width - len(t)) for t in tables]),
                        tensor(firsts))
    meta = BatchMetadata(tensor(positions), tensor(token_request), tensor(query_start),
                         tensor(seq_lens), max(new for _, new in requests), {"kind": kind},
                         block_size)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    q = torch.randn(len(positions), kv_heads * group, head_dim, generator=gen)
    return q.to(device=device, dtype=dtype), k_cache, v_cache, meta, kind
