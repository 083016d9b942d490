"""Per-head q/k RMSNorm followed by rotary embedding, as one Triton kernel with a PyTorch twin.

This is `AttentionProjections.qkv` after the projections: each q and k head is optionally
RMS-normalised over head_dim, then rotated with the rotate-half convention by cos/sin of shape
[tokens, head_dim] (float32, already multiplied by the attention scale). Rounding points follow
the reference: the norm is rounded to the input dtype before the rotation reads it, and the
rotation is computed in float32 and rounded once more.

The kernel runs one program per (token, head) over the q heads and then the k heads, so both
tensors cost a single launch with no host synchronisation (safe under CUDA graph capture).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable

import torch

# Triton is optional (the twin covers every device) and imported at the first launch, not with
# this module: its import fixes whether its own helpers are compiled or interpreted
# (TRITON_INTERPRET), and CPU-only processes need not pay for it.
HAS_TRITON = importlib.util.find_spec("triton") is not None
triton: Any = None
tl: Any = None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same ops as muse.reference.layers.rms_norm, so the twin is bit-identical to it.
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same ops as muse.reference.rope.apply_rotary for x [tokens, heads, dim].
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def qk_norm_rope_torch(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference ops on q [T, Hq, D], k [T, Hk, D], cos/sin [T, D]; a None weight: no norm."""
    if q_weight is not None:
        q = _rms_norm(q, q_weight, eps)
    if k_weight is not None:
        k = _rms_norm(k, k_weight, eps)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


@functools.cache
def _jit(fn: Callable) -> Callable:
    """`fn` as a Triton kernel, importing Triton into this module's globals on first use."""
    global triton, tl
    import triton
    import triton.language as tl
    return triton.jit(fn)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# A Triton kernel, decorated by `_jit` at its first launch.
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
                         q_st, q_sh, k_st, k_sh, qo_st, qo_sh, ko_st, ko_sh,
                         cos_st, sin_st, num_q_heads, eps,
                         HALF: tl.constexpr, BLOCK: tl.constexpr, HAS_NORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # Heads [0, num_q_heads) are q's, the rest k's: pick this program's row and weight.
    if head < num_q_heads:
        src = q_ptr + token * q_st + head * q_sh
        dst = qo_ptr + token * qo_st + head * qo_sh
        w_ptr = qw_ptr
    else:
        src = k_ptr + token * k_st + (head - num_q_heads) * k_sh
        dst = ko_ptr + token * ko_st + (head - num_q_heads) * ko_sh
        w_ptr = kw_ptr
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    # The two halves are loaded separately: rotate-half then needs no register shuffle.
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
    if HAS_NORM:
        a1 = x1.to(tl.float32)
        a2 = x2.to(tl.float32)
        mean_square = (tl.sum(a1 * a1, axis=0) + tl.sum(a2 * a2, axis=0)) / (2 * HALF)
        inv = tl.math.rsqrt(mean_square + eps)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        # The reference rounds the normed head to the input dtype before rotating it.
        x1 = (w1 * (a1 * inv)).to(x1.dtype)
        x2 = (w2 * (a2 * inv)).to(x2.dtype)
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    c1 = tl.load(cos_ptr + token * cos_st + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + token * cos_st + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + token * sin_st + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + token * sin_st + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1].
    out1 = a1 * c1 - a2 * s1
    out2 = a2 * c2 + a1 * s2
    tl.store(dst + offs, out1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + offs, out2.to(dst.dtype.element_ty), mask=mask)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    # Token and head strides are passed to the kernel; only the head_dim axis must be dense.
    return x if x.stride(-1) == 1 else x.contiguous()


def qk_norm_rope_triton(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                        k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on any device Triton can run on (the interpreter included)."""
    if not HAS_TRITON:
        raise RuntimeError("the Triton rotary kernel needs the `triton` package")
    (tokens, q_heads, dim), k_heads = q.shape, k.shape[1]
    if dim % 2 or k.shape[0] != tokens or k.shape[2] != dim or k.dtype != q.dtype:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} need "
                         "the same tokens, dtype and an even head_dim")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("the kernel norms both q and k or neither")
    q, k, cos, sin = _unit_last(q), _unit_last(k), _unit_last(cos), _unit_last(sin)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens and q_heads + k_heads:
        # Without a norm the weight pointers are never read; any tensor stands in for them.
        qw = q_weight.contiguous() if q_weight is not None else cos
        kw = k_weight.contiguous() if k_weight is not None else cos
        # The kernel picks one of the two in a branch, so they must share a pointer type;
        # float32 holds either exactly.
        if kw.dtype != qw.dtype:
            qw, kw = qw.float(), kw.float()
        half = dim // 2
        block = _next_power_of_2(half)
        _jit(_qk_norm_rope_kernel)[(tokens, q_heads + k_heads)](
            q, k, qw, kw, cos, sin, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos.stride(0), sin.stride(0), q_heads, eps,
            HALF=half, BLOCK=block, HAS_NORM=q_weight is not None,
            num_warps=max(1, min(4, block // 32)))  # a head is small: few threads suffice
    return q_out, k_out


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm of q [T, Hq, D] and k [T, Hk, D], then rotary by cos/sin [T, D].

    Outputs are new contiguous tensors in the input dtype. Triton on CUDA, the twin elsewhere
    (and for the unusual calls the kernel does not take: q and k of different dtypes, or a
    norm weight for only one of them).
    """
    fused = q.dtype == k.dtype and (q_weight is None) == (k_weight is None)
    if HAS_TRITON and q.is_cuda and fused:
        return qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps)
    return qk_norm_rope_torch(q, k, q_weight, k_weight, cos, sin, eps)
