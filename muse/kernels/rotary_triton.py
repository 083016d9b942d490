"""Per-head q/k RMSNorm followed by rotary embedding, as one Triton kernel.

Same contract and rounding points as `muse.kernels.rotary.qk_norm_rope_torch`. The kernel runs
one program per (token, group of up to 8 heads) over the q heads and then the k heads, so both
tensors cost a single launch with no host synchronisation (safe under CUDA graph capture).

`qk_norm_rope_write_kv_triton` also stores the step's keys and values in the paged cache, as
`muse.kernels.kv_write` would: the k heads' programs write their rotated keys and the matching
value heads straight to their slots, so a decode layer saves the store's launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse.kernels.paged_attention import FP8_MAX, check_kv_scales
from muse.kernels.pdl import pdl_options, start_dependent_kernel


@triton.jit
def _store_halves(dst, offs, HALF: tl.constexpr, first, second, mask):
    tl.store(dst[:, None] + offs[None, :], first, mask=mask)
    tl.store(dst[:, None] + HALF + offs[None, :], second, mask=mask)


@triton.jit
def _to_cache(x, scale, cache_ptr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """x as the cache stores it: fp8(x / scale) for an FP8 cache (correctly rounded division,
    the twin's bits), else x in the cache's dtype."""
    if FP8:
        x = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale), -FP8_MAX), FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
                         q_st, q_sh, k_st, k_sh, qo_st, qo_sh, ko_st, ko_sh,
                         cos_st, sin_st, num_q_heads, num_k_heads, eps,
                         v_ptr, v_st, v_sh, k_cache_ptr, v_cache_ptr, slots_ptr, k_scale_ptr,
                         v_scale_ptr, stride_cs, stride_ch,
                         HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
                         HAS_NORM: tl.constexpr, STORE_KV: tl.constexpr, FP8: tl.constexpr,
                         FP8_MAX: tl.constexpr, PDL: tl.constexpr):
    """STORE_KV: the k heads go to the caches at the token's slot (with the value heads of
    the same indices) instead of to ko_ptr."""
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
    out1 = (a1 * c1[None, :] - a2 * s1[None, :]).to(qo_ptr.dtype.element_ty)
    out2 = (a2 * c2[None, :] + a1 * s2[None, :]).to(qo_ptr.dtype.element_ty)
    if STORE_KV:
        if group < q_groups:
            _store_halves(dst, offs, HALF, out1, out2, mask)
        else:
            slot = tl.load(slots_ptr + token)
            target = k_cache_ptr + slot * stride_cs + heads * stride_ch
            k_scale = 1.0
            v_scale = 1.0
            if FP8:
                k_scale = tl.load(k_scale_ptr + heads, mask=head_ok, other=1.0)[:, None]
                v_scale = tl.load(v_scale_ptr + heads, mask=head_ok, other=1.0)[:, None]
            _store_halves(target, offs, HALF, _to_cache(out1, k_scale, k_cache_ptr, FP8, FP8_MAX),
                          _to_cache(out2, k_scale, k_cache_ptr, FP8, FP8_MAX), mask)
            values = v_ptr + token * v_st + heads * v_sh
            v1 = tl.load(values[:, None] + offs[None, :], mask=mask)
            v2 = tl.load(values[:, None] + HALF + offs[None, :], mask=mask)
            _store_halves(v_cache_ptr + slot * stride_cs + heads * stride_ch, offs, HALF,
                          _to_cache(v1, v_scale, v_cache_ptr, FP8, FP8_MAX),
                          _to_cache(v2, v_scale, v_cache_ptr, FP8, FP8_MAX), mask)
    else:
        _store_halves(dst, offs, HALF, out1, out2, mask)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    # Token and head strides are passed to the kernel; only the head_dim axis must be dense.
    return x if x.stride(-1) == 1 else x.contiguous()


def qk_norm_rope_triton(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                        k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on any device Triton can run on (the interpreter included)."""
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    return _launch(q, k, q_weight, k_weight, cos, sin, eps, k_out, None), k_out


def qk_norm_rope_write_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                                 cos: torch.Tensor, sin: torch.Tensor, eps: float,
                                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 slot_mapping: torch.Tensor,
                                 k_scale: torch.Tensor | None = None,
                                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`qk_norm_rope_triton`'s q, with the rotated k and v [tokens, kv_heads, head_dim]
    stored in the caches [blocks, block_size, kv_heads, head_dim] at flat slots
    `slot_mapping`, as `write_kv_triton` stores them (an FP8 cache with float32 scales
    [kv_heads]); one launch."""
    if v.shape != k.shape:
        raise ValueError(f"v {tuple(v.shape)} must have k's shape {tuple(k.shape)}")
    fp8 = check_kv_scales(k_cache, k_scale, v_scale)
    store = (_unit_last(v), k_cache, v_cache, slot_mapping, k_scale if fp8 else slot_mapping,
             v_scale if fp8 else slot_mapping, fp8)
    return _launch(q, k, q_weight, k_weight, cos, sin, eps, k, store)


def _launch(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
            k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float,
            k_out: torch.Tensor, store: tuple | None) -> torch.Tensor:
    """q's output; k's goes to k_out, or with `store` (v, caches, slots, scales, fp8) to the
    caches (k_out then stands in for the unused pointer)."""
    (tokens, q_heads, dim), k_heads = q.shape, k.shape[1]
    if dim % 2 or k.shape[0] != tokens or k.shape[2] != dim or k.dtype != q.dtype:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} need "
                         "the same tokens, dtype and an even head_dim")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("the kernel norms both q and k or neither")
    q, k, cos, sin = _unit_last(q), _unit_last(k), _unit_last(cos), _unit_last(sin)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not (tokens and q_heads + k_heads and dim):  # an empty output needs no launch
        return q_out
    # Without a norm the weight pointers are never read; any tensor stands in for them.
    qw = q_weight.contiguous() if q_weight is not None else cos
    kw = k_weight.contiguous() if k_weight is not None else cos
    # The kernel picks one of the two in a branch, so they must share a pointer type;
    # float32 holds either exactly.
    if kw.dtype != qw.dtype:
        qw, kw = qw.float(), kw.float()
    if store is None:  # the cache arguments are never read
        v, k_cache, v_cache, slots, k_scale, v_scale, fp8 = k, k, k, k, k, k, False
        cache_strides = (0, 0)
    else:
        v, k_cache, v_cache, slots, k_scale, v_scale, fp8 = store
        # A flat slot s is (block s // bs, offset s % bs): with contiguous caches its address
        # is s times the stride of one slot.
        cache_strides = (k_cache.stride(1), k_cache.stride(2))
    half = dim // 2
    block = triton.next_power_of_2(half)
    # Prefill: up to 8 heads of a token per program (a program per (token, head) spent more
    # time being scheduled than working: 180 us per layer for an 8K-token chunk, 70 us with
    # 8). Decode: a program per head, which spreads the few tokens' work over more SMs (1.7 us
    # per layer at batch 1 instead of 2.9).
    block_h = 1 if tokens <= 64 else min(8, triton.next_power_of_2(max(q_heads, k_heads)))
    groups = triton.cdiv(q_heads, block_h) + triton.cdiv(k_heads, block_h)
    _qk_norm_rope_kernel[(tokens, groups)](
        q, k, qw, kw, cos, sin, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos.stride(0), sin.stride(0), q_heads, k_heads, eps,
        v, v.stride(0), v.stride(1), k_cache, v_cache, slots, k_scale, v_scale, *cache_strides,
        HALF=half, BLOCK=block, BLOCK_H=block_h, HAS_NORM=q_weight is not None,
        STORE_KV=store is not None, FP8=fp8, FP8_MAX=FP8_MAX, **pdl_options(q.device),
        num_warps=max(1, min(4, block_h * block // 32)))
    return q_out
