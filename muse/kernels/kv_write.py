"""Storing a step's new keys and values in the paged cache, K and V in one launch.

The torch twin (`muse.kernels.paged_attention.write_kv`) is two indexed copies; at decode
each is a whole kernel launch for a few hundred bytes, so one program per token writes both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    target = slot * stride_cs + heads * stride_ch + dims
    tl.store(k_cache_ptr + target, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + target, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same contract as the twin: k, v [tokens, kv_heads, head_dim] (last dim contiguous)
    into caches [blocks, block_size, kv_heads, head_dim] at flat slots `slot_mapping`."""
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
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), slot_stride, k_cache.stride(2),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1 if kv_heads * head_dim <= 512
        else 4)
