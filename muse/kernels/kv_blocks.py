"""Whole KV blocks of many layers at once, between the paged caches and rows
[blocks, layers, 2 (K, V), block_size, kv_heads, head_dim]: the host tier's saves and loads,
and disaggregation's exports and imports.

The torch twins (`gather_blocks`, `put_blocks`) are two indexed copies a layer and a stack;
a 28-layer model's save is then ~90 kernel launches. `KVBlocks` on a GPU does each direction
in one Triton launch over all layers, reading the layers' cache addresses from a table on
the device (program (i, pair, tile) copies one tile of block i of one layer's K or V), words
of 4 bytes at a time whatever the cache dtype. The layers' caches must be contiguous
[blocks, block_size, kv_heads, head_dim] tensors of one shape and dtype (they are:
`allocate_kv_caches` gives the layers of a kind the same number of blocks).
"""

from __future__ import annotations

import torch

from muse.engine.transfer import to_device

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
TILE = 1024  # 4-byte words a program copies


def gather_blocks(kv_caches: KVCaches, layers: list[int], blocks: list[int]) -> torch.Tensor:
    """Blocks `blocks` of the layers `layers` (of one kind), on their device:
    [blocks, layers, 2 (K, V), block_size, kv_heads, head_dim]."""
    index = to_device(blocks, kv_caches[0][0].device)
    return torch.stack([torch.stack((_bytes(k).index_select(0, index),
                                     _bytes(v).index_select(0, index)), dim=1)
                        for k, v in (kv_caches[i] for i in layers)], dim=1
                       ).view(kv_caches[0][0].dtype)


def put_blocks(kv_caches: KVCaches, layers: list[int], blocks: list[int],
               rows: torch.Tensor) -> None:
    """Write rows [blocks, layers, 2, ...] (on the caches' device) into `blocks`."""
    index = to_device(blocks, kv_caches[0][0].device)
    rows = _bytes(rows)
    for position, layer in enumerate(layers):
        k, v = kv_caches[layer]
        _bytes(k).index_copy_(0, index, rows[:, position, 0])
        _bytes(v).index_copy_(0, index, rows[:, position, 1])


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The same bytes as an integer tensor of the element's size: indexed copies then work
    for every cache dtype (PyTorch lacks some for FP8 on a CPU)."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


class KVBlocks:
    """The blocks of the layers `layers` of `kv_caches`: one launch a direction on a GPU
    (or with `use_triton`), the twins elsewhere.

    `groups` (sizes of consecutive runs of `layers`, summing to its length; one group by
    default) splits the rows `gather_groups` reads, in that one launch, each group's
    contiguous."""

    def __init__(self, kv_caches: KVCaches, layers: list[int],
                 use_triton: bool | None = None, groups: list[int] | None = None) -> None:
        self.kv_caches, self.layers = kv_caches, layers
        self.groups = groups or [len(layers)]
        if sum(self.groups) != len(layers) or min(self.groups, default=1) < 1:
            raise ValueError(f"groups {groups} must split the {len(layers)} layers")
        # The kind's first layer: other kinds' caches may hold another number of blocks.
        cache = kv_caches[layers[0] if layers else 0][0]
        self.device = cache.device
        self.row_shape = (len(layers), 2, *cache.shape[1:])
        self.dtype = cache.dtype
        self.use_triton = cache.is_cuda if use_triton is None else use_triton
        if self.use_triton and layers:
            pairs = [kv_caches[i][j] for i in layers for j in (0, 1)]
            if any(not t.is_contiguous() or t.dtype != cache.dtype or t.shape != cache.shape
                   for t in pairs):
                raise ValueError("KVBlocks needs contiguous caches of one shape and dtype")
            self.words = cache[0].numel() * cache.element_size() // 4
            if self.words * 4 != cache[0].numel() * cache.element_size():
                raise ValueError("a KV block's bytes must be a multiple of 4")
            # The caches' addresses, read by the kernels (the caches live as long as this).
            self.table = torch.tensor([t.data_ptr() for t in pairs], dtype=torch.int64,
                                      device=self.device)
            # Each pair's group: its first pair and its number of pairs.
            starts = [2 * sum(self.groups[:g]) for g, size in enumerate(self.groups)
                      for _ in range(2 * size)]
            sizes = [2 * size for size in self.groups for _ in range(2 * size)]
            self.group_table = (torch.tensor(starts, dtype=torch.int64, device=self.device),
                                torch.tensor(sizes, dtype=torch.int64, device=self.device))

    def gather_groups(self, blocks: list[int]) -> list[torch.Tensor]:
        """Each group's [len(blocks), its layers, 2, block_size, kv_heads, head_dim] on the
        caches' device: views of one buffer on a GPU, filled in one launch."""
        if not (self.use_triton and self.layers and blocks):
            firsts = [sum(self.groups[:g]) for g in range(len(self.groups))]
            return [gather_blocks(self.kv_caches, self.layers[first:first + size], blocks)
                    for first, size in zip(firsts, self.groups)]
        from muse.kernels.kv_blocks_triton import copy_blocks

        rows = torch.empty((len(blocks), *self.row_shape), dtype=self.dtype, device=self.device)
        copy_blocks(self.table, to_device(blocks, self.device), rows.view(torch.int32),
                    self.words, to_rows=True, groups=self.group_table)
        parts, offset = [], 0
        flat = rows.view(-1)
        per_layer = rows[0, 0].numel()
        for size in self.groups:
            count = len(blocks) * size * per_layer
            parts.append(flat[offset:offset + count].view(len(blocks), size, *self.row_shape[1:]))
            offset += count
        return parts

    def put(self, blocks: list[int], rows: torch.Tensor) -> None:
        """Write rows [len(blocks), layers, 2, ...] (on the caches' device) into `blocks`."""
        if not (self.use_triton and self.layers and blocks):
            put_blocks(self.kv_caches, self.layers, blocks, rows)
            return
        from muse.kernels.kv_blocks_triton import copy_blocks

        copy_blocks(self.table, to_device(blocks, self.device),
                    rows.contiguous().view(torch.int32), self.words, to_rows=False)
