"""Batched multi-LoRA (BGMV): every row of a batch applies its own adapter, in two steps.

The adapters live in slots of stacked weights: `lora_a` [S, R, K] and `lora_b` [S, N, R], R
the padded rank (an adapter of smaller rank has zero rows / columns past its own), any scaling
already folded into `lora_b`. `indices` [T] (int32 or int64) gives each row's slot, -1 for a
row without an adapter. The factors are usually in the activation dtype, but each of x, y and
the factors may be bfloat16, float16 or float32 on its own: all are read as float32 (a float32
y of expert outputs takes bfloat16 factors).

    u = lora_shrink(x, lora_a, indices)          # x [T, K] -> u [T, R] float32
    lora_expand(y, u, lora_b, indices)           # y [T, N] += u @ lora_b[slot].T, in place

Numerics: shrink accumulates x @ a.T in float32 and keeps u in float32; expand adds
u @ float32(b).T to float32(y) and rounds once to y's dtype. Rows whose index is -1 get
u = 0 and keep y bit for bit. The Triton kernels (`muse.kernels.lora_triton`) differ from the
twins only in the order of the float32 sums.

A fused projection (q/k/v, gate/up) shrinks once with its parts' A stacked along the rank,
[S, parts * R, K], and expands each part into its columns of the fused output:

    u = lora_shrink(x, lora_a_qkv, indices)                          # [T, 3R]
    for part, (b, start) in enumerate(((b_q, 0), (b_k, q_size), (b_v, q_size + kv_size))):
        lora_expand(y, u, b, indices, out_offset=start, rank_offset=part * R)

(A block-diagonal B [S, N_total, parts * R] also serves all parts in one expand, reading the
zeros off its diagonal blocks.)

`lora_shrink` / `lora_expand` run the Triton kernels on CUDA tensors (when Triton is
installed) and the twins elsewhere. The kernels read nothing back to the host, so a decode
step that calls them can be captured in a CUDA graph; the twins gather each row's weights
([T, R, K] and [T, N, R] float32 temporaries) and are meant for the CPU and for tests.
Indices must lie in [-1, S): neither path checks them, since checking needs the host.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_shrink_args(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor) -> None:
    """Shapes and dtypes only (no device work)."""
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"lora shrink: x must be [T, K] bfloat16, float16 or float32, got "
                         f"{x.dtype} {list(x.shape)}")
    in_features = x.shape[1]
    if (lora_a.dim() != 3 or lora_a.shape[2] != in_features
            or lora_a.dtype not in ACTIVATION_DTYPES):
        raise ValueError(f"lora shrink: lora_a must be [S, R, K={in_features}] bfloat16, "
                         f"float16 or float32, got {lora_a.dtype} {list(lora_a.shape)}")
    _check_indices(indices, x.shape[0])


def check_expand_args(y: torch.Tensor, u: torch.Tensor, lora_b: torch.Tensor,
                      indices: torch.Tensor, out_offset: int, rank_offset: int) -> None:
    """Shapes, dtypes and offsets only (no device work)."""
    if y.dim() != 2 or y.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"lora expand: y must be [T, N_total] bfloat16, float16 or float32, "
                         f"got {y.dtype} {list(y.shape)}")
    if u.dim() != 2 or u.shape[0] != y.shape[0] or u.dtype != torch.float32:
        raise ValueError(f"lora expand: u must be [T={y.shape[0]}, R_total] float32, got "
                         f"{u.dtype} {list(u.shape)}")
    if lora_b.dim() != 3 or lora_b.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"lora expand: lora_b must be [S, N, R] bfloat16, float16 or float32, "
                         f"got {lora_b.dtype} {list(lora_b.shape)}")
    _, out_features, rank = lora_b.shape
    if not 0 <= out_offset <= y.shape[1] - out_features:
        raise ValueError(f"lora expand: out_offset {out_offset} + N {out_features} must lie "
                         f"within y's {y.shape[1]} columns")
    if not 0 <= rank_offset <= u.shape[1] - rank:
        raise ValueError(f"lora expand: rank_offset {rank_offset} + R {rank} must lie within "
                         f"u's {u.shape[1]} columns")
    _check_indices(indices, y.shape[0])


def _check_indices(indices: torch.Tensor, num_rows: int) -> None:
    if indices.dim() != 1 or indices.shape[0] != num_rows or indices.dtype not in INDEX_DTYPES:
        raise ValueError(f"lora: indices must be [T={num_rows}] int32 or int64, got "
                         f"{indices.dtype} {list(indices.shape)}")


def lora_shrink_torch(x: torch.Tensor, lora_a: torch.Tensor,
                      indices: torch.Tensor) -> torch.Tensor:
    """u [T, R] float32: u[t] = lora_a[indices[t]] @ x[t], 0 where indices[t] is -1."""
    check_shrink_args(x, lora_a, indices)
    u = x.new_zeros((x.shape[0], lora_a.shape[1]), dtype=torch.float32)
    for slot, rows in _rows_by_slot(indices):
        u[rows] = x[rows].float() @ lora_a[slot].float().T
    return u


def lora_expand_torch(y: torch.Tensor, u: torch.Tensor, lora_b: torch.Tensor,
                      indices: torch.Tensor, out_offset: int = 0, rank_offset: int = 0) -> None:
    """In place: y[t, out_offset:+N] += u[t, rank_offset:+R] @ lora_b[indices[t]].T, summed
    in float32 and rounded once to y's dtype; rows whose index is -1 are left as they are."""
    check_expand_args(y, u, lora_b, indices, out_offset, rank_offset)
    _, out_features, rank = lora_b.shape
    columns = slice(out_offset, out_offset + out_features)
    for slot, rows in _rows_by_slot(indices):
        delta = u[rows, rank_offset:rank_offset + rank] @ lora_b[slot].float().T
        y[rows, columns] = (y[rows, columns].float() + delta).to(y.dtype)


def _rows_by_slot(indices: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, its rows) for each slot in `indices` (-1, no adapter, left out): one matmul per
    adapter present rather than a gathered weight per token, which on the CPU cost several
    times the base model's own step."""
    return [(slot, (indices == slot).nonzero().squeeze(1))
            for slot in indices.unique().tolist() if slot >= 0]


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """`lora_shrink_torch`'s result: the Triton kernel for CUDA tensors, the twin elsewhere."""
    if x.is_cuda and _triton_installed():
        # Imported here so that CPU-only processes never import Triton.
        from muse.kernels import lora_triton

        return lora_triton.lora_shrink_triton(x, lora_a, indices)
    return lora_shrink_torch(x, lora_a, indices)


def lora_expand(y: torch.Tensor, u: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor,
                out_offset: int = 0, rank_offset: int = 0) -> None:
    """`lora_expand_torch`'s update of y: the Triton kernel for CUDA tensors, the twin
    elsewhere."""
    if y.is_cuda and _triton_installed():
        from muse.kernels import lora_triton

        lora_triton.lora_expand_triton(y, u, lora_b, indices, out_offset, rank_offset)
        return
    lora_expand_torch(y, u, lora_b, indices, out_offset, rank_offset)
