"""Storing a step's new keys and values in the paged cache, K and V in one launch.

The torch twin (`muse.kernels.paged_attention.write_kv`) is two indexed copies; at decode
each is a whole kernel launch for a few hundred bytes, so one program per token writes both.
An FP8 cache stores `fp8(k / k_scale)` as the twin does, the scales read from the device
(one per kv head) so a captured graph sees scales set after its capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse.kernels.paged_attention import FP8_MAX, check_kv_scales
from muse.kernels.pdl import pdl_options, start_dependent_kernel


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, k_scale_ptr,
                     v_scale_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
                     stride_ch, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                     FP8_MAX: tl.constexpr, PDL: tl.constexpr):
    start_dependent_kernel(PDL)
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    if FP8:
        k_scale = tl.load(k_scale_ptr + heads, mask=heads < KV_HEADS, other=1.0)
        v_scale = tl.load(v_scale_ptr + heads, mask=heads < KV_HEADS, other=1.0)
        # Correctly rounded division (`/` may be approximate on the GPU): the same bits as
        # the twin's.
        k = tl.minimum(tl.maximum(tl.math.div_rn(k.to(tl.float32), k_scale), -FP8_MAX),
                       FP8_MAX)
        v = tl.minimum(tl.maximum(tl.math.div_rn(v.to(tl.float32), v_scale), -FP8_MAX),
                       FP8_MAX)
    target = slot * stride_cs + heads * stride_ch + dims
    tl.store(k_cache_ptr + target, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + target, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Same contract as the twin: k, v [tokens, kv_heads, head_dim] (last dim contiguous)
    into caches [blocks, block_size, kv_heads, head_dim] at flat slots `slot_mapping`; an FP8
    cache with float32 scales [kv_heads]."""
    fp8 = check_kv_scales(k_cache, k_scale, v_scale)
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    # A flat slot s is (block s // bs, offset s % bs): with contiguous caches its address is
    # s times the stride of one slot.
    slot_stride = k_cache.stride(1)
    _write_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale if fp8 else slot_mapping,
        v_scale if fp8 else slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), slot_stride, k_cache.stride(2),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), FP8=fp8, FP8_MAX=FP8_MAX,
        **pdl_options(k.device),
        num_warps=1 if kv_heads * head_dim <= 512 else 4)
