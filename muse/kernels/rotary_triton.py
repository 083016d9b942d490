"""Per-head q/k RMSNorm followed by rotary embedding, as one Triton kernel.

Same contract and rounding points as `muse.kernels.rotary.qk_norm_rope_torch`. The kernel runs
one program per (token, group of up to 8 heads) over the q heads and then the k heads, so both
tensors cost a single launch with no host synchronisation (safe under CUDA graph capture).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse.kernels.pdl import pdl_options, start_dependent_kernel


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
                         q_st, q_sh, k_st, k_sh, qo_st, qo_sh, ko_st, ko_sh,
                         cos_st, sin_st, num_q_heads, num_k_heads, eps,
                         HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
                         HAS_NORM: tl.constexpr, PDL: tl.constexpr):
    start_dependent_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    # Head groups [0, q_groups) are q's, the rest k's: pick this program's rows and weight.
    q_groups = tl.cdiv(num_q_heads, BLOCK_H)
    if group < q_groups:
        heads = group * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < num_q_heads
        src = q_ptr + token * q_st + heads * q_sh
        dst = qo_ptr + token * qo_st + heads * qo_sh
        w_ptr = qw_ptr
    else:
        heads = (group - q_groups) * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < num_k_heads
        src = k_ptr + token * k_st + heads * k_sh
        dst = ko_ptr + token * ko_st + heads * ko_sh
        w_ptr = kw_ptr
    offs = tl.arange(0, BLOCK)
    col_ok = offs < HALF
    mask = head_ok[:, None] & col_ok[None, :]
    # The two halves are loaded separately: rotate-half then needs no register shuffle.
    x1 = tl.load(src[:, None] + offs[None, :], mask=mask, other=0.0)
    x2 = tl.load(src[:, None] + HALF + offs[None, :], mask=mask, other=0.0)
    if HAS_NORM:
        a1 = x1.to(tl.float32)
        a2 = x2.to(tl.float32)
        mean_square = (tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)) / (2 * HALF)
        inv = tl.math.rsqrt(mean_square + eps)[:, None]
        w1 = tl.load(w_ptr + offs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        # The reference rounds the normed head to the input dtype before rotating it.
        x1 = (w1 * (a1 * inv)).to(x1.dtype)
        x2 = (w2 * (a2 * inv)).to(x2.dtype)
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    # One token's cos / sin serve all the heads of the program.
    c1 = tl.load(cos_ptr + token * cos_st + offs, mask=col_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + token * cos_st + HALF + offs, mask=col_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + token * sin_st + offs, mask=col_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + token * sin_st + HALF + offs, mask=col_ok, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1].
    out1 = a1 * c1[None, :] - a2 * s1[None, :]
    out2 = a2 * c2[None, :] + a1 * s2[None, :]
    tl.store(dst[:, None] + offs[None, :], out1.to(qo_ptr.dtype.element_ty), mask=mask)
    tl.store(dst[:, None] + HALF + offs[None, :], out2.to(qo_ptr.dtype.element_ty), mask=mask)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    # Token and head strides are passed to the kernel; only the head_dim axis must be dense.
    return x if x.stride(-1) == 1 else x.contiguous()


def qk_norm_rope_triton(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                        k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on any device Triton can run on (the interpreter included)."""
    (tokens, q_heads, dim), k_heads = q.shape, k.shape[1]
    if dim % 2 or k.shape[0] != tokens or k.shape[2] != dim or k.dtype != q.dtype:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} need "
                         "the same tokens, dtype and an even head_dim")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("the kernel norms both q and k or neither")
    q, k, cos, sin = _unit_last(q), _unit_last(k), _unit_last(cos), _unit_last(sin)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens and q_heads + k_heads and dim:  # an empty output needs no launch
        # Without a norm the weight pointers are never read; any tensor stands in for them.
        qw = q_weight.contiguous() if q_weight is not None else cos
        kw = k_weight.contiguous() if k_weight is not None else cos
        # The kernel picks one of the two in a branch, so they must share a pointer type;
        # float32 holds either exactly.
        if kw.dtype != qw.dtype:
            qw, kw = qw.float(), kw.float()
        half = dim // 2
        block = triton.next_power_of_2(half)
        # Prefill: up to 8 heads of a token per program (a program per (token, head) spent
        # more time being scheduled than working: 180 us per layer for an 8K-token chunk,
        # 70 us with 8). Decode: a program per head, which spreads the few tokens' work over
        # more SMs (1.7 us per layer at batch 1 instead of 2.9).
        block_h = 1 if tokens <= 64 else min(8, triton.next_power_of_2(max(q_heads, k_heads)))
        groups = triton.cdiv(q_heads, block_h) + triton.cdiv(k_heads, block_h)
        _qk_norm_rope_kernel[(tokens, groups)](
            q, k, qw, kw, cos, sin, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos.stride(0), sin.stride(0), q_heads, k_heads, eps,
            HALF=half, BLOCK=block, BLOCK_H=block_h, HAS_NORM=q_weight is not None,
            **pdl_options(q.device),
            num_warps=max(1, min(4, block_h * block // 32)))
    return q_out, k_out
