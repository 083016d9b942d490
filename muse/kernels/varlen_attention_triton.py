"""Non-causal attention over packed variable-length sequences, in Triton.

Same contract and result as `muse.kernels.varlen_attention.varlen_attention_torch`. One
program per (sequence, tile of BLOCK_M queries, head) walks all keys of its own sequence in
tiles of BLOCK_N with the flash-attention online softmax, accumulating in float32. The grid is
sized for the longest sequence; programs whose tile lies past their sequence's end exit at
once. Keys of other sequences are never loaded, so the block-diagonal mask costs nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse.kernels.paged_attention_triton import online_softmax_step
from muse.kernels.varlen_attention import check_varlen_inputs

# Scores are kept in base 2 (the scale is multiplied by log2(e)) so the kernel can use exp2.
_LOG2E = 1.4426950408889634


@triton.jit
def _varlen_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens_ptr, scale_log2,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_ot, stride_oh,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    sequence = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + sequence)
    length = tl.load(cu_seqlens_ptr + sequence + 1) - start
    if tile * BLOCK_M >= length:
        return

    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    row_mask = offs_m < length
    q_offsets = (start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for key_start in range(0, length, BLOCK_N):
        keys = key_start + offs_n
        key_mask = keys < length
        kv_mask = key_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + (start + keys)[:, None] * stride_kt + head * stride_kh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + (start + keys)[:, None] * stride_vt + head * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(key_mask[None, :], s, float("-inf"))
        # Every tile holds at least one real key (the loop stops at `length`).
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, PRECISION)

    out = acc / l_i[:, None]
    out_offsets = (start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


def varlen_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens: torch.Tensor, scale: float,
                            max_seqlen: int | None = None, block_m: int | None = None,
                            block_n: int | None = None) -> torch.Tensor:
    """q, k, v [total, heads, head_dim] -> [total, heads, head_dim], block-diagonal by
    `cu_seqlens` [sequences + 1]. Without `max_seqlen` it is read from `cu_seqlens` (one
    device-to-host copy)."""
    check_varlen_inputs(q, k, v, cu_seqlens)
    # The kernel steps along head_dim with unit stride.
    q, k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty_like(q)
    num_sequences = cu_seqlens.numel() - 1
    if q.shape[0] == 0 or num_sequences == 0:
        return out
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
    head_dim = q.shape[2]
    # tl.dot needs every dimension >= 16 and power-of-two tiles; padding is masked off.
    block_d = max(16, triton.next_power_of_2(head_dim))
    wide = q.element_size() >= 4
    # float32 runs its dots on FMA units at IEEE precision, so its tiles are smaller to bound
    # registers; 16-bit inputs take the tensor cores' larger tiles.
    block_m = block_m or (64 if wide else 128)
    block_n = block_n or (32 if wide else 64)
    grid = (num_sequences, triton.cdiv(max(max_seqlen, 1), block_m), q.shape[1])
    _varlen_attention_kernel[grid](
        q, k, v, out, cu_seqlens.to(torch.int32), scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        # float32 callers expect float32 accuracy; the default TF32 would cost ~1e-3 relative.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=8 if block_m >= 128 else 4, num_stages=2)
    return out
