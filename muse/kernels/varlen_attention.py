"""Non-causal attention over packed variable-length sequences: the dispatcher and its twin.

The vision encoder packs the patches of every image (and every frame group of every video) of
a step into one [total, heads, head_dim] tensor; `cu_seqlens` ([sequences + 1] int32, starting
at 0) marks where each sequence starts, and a token attends to every token of its own sequence
and to nothing else, i.e. a block-diagonal mask. Heads of q, k and v are equal (no GQA).

`varlen_attention` runs the Triton kernel (`muse.kernels.varlen_attention_triton`) on CUDA and
the twin elsewhere; `varlen_attention_torch` is the twin, the oracle the kernel is tested
against: one SDPA call per sequence length (sequences of a length batched), computed in
float32 and rounded once to q's dtype. It is differentiable, so training takes it on CUDA too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_varlen_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        cu_seqlens: torch.Tensor) -> None:
    if q.dim() != 3 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k and v must share one shape [total, heads, head_dim]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D tensor [sequences + 1] starting at 0")


def varlen_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens: torch.Tensor, scale: float,
                           max_seqlen: int | None = None) -> torch.Tensor:
    """q, k, v [total, heads, head_dim] -> [total, heads, head_dim]; max_seqlen is unused.

    Sequences of one length go through one SDPA call as a batch (a step's images are often
    all one size), in float32; differentiable, so training uses it too."""
    check_varlen_inputs(q, k, v, cu_seqlens)
    bounds = cu_seqlens.tolist()
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    pieces, order = [], []
    for length, starts in by_length.items():
        rows = (torch.tensor(starts, device=q.device)[:, None]
                + torch.arange(length, device=q.device)[None, :]).reshape(-1)
        # [sequences, heads, length, head_dim], as SDPA takes it.
        q_seq, k_seq, v_seq = (x[rows].unflatten(0, (len(starts), length)).transpose(1, 2)
                               .float() for x in (q, k, v))
        attended = F.scaled_dot_product_attention(q_seq, k_seq, v_seq, scale=scale)
        pieces.append(attended.transpose(1, 2).flatten(0, 1))
        order.append(rows)
    if not pieces:
        return torch.zeros_like(q)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    # float(): under autocast SDPA returns bf16 whatever its inputs.
    out = out.index_copy(0, torch.cat(order), torch.cat(pieces).float())
    return out.to(q.dtype)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens: torch.Tensor, scale: float,
                     max_seqlen: int | None = None) -> torch.Tensor:
    """q, k, v [total, heads, head_dim] -> [total, heads, head_dim], block-diagonal by
    `cu_seqlens`. `max_seqlen` (the longest sequence) sizes the kernel's grid; passing it
    spares a device-to-host copy."""
    # The Triton kernel has no backward: training takes the torch path.
    if q.is_cuda and not (torch.is_grad_enabled() and q.requires_grad):
        # Imported here so that CPU-only processes never import Triton.
        from muse.kernels.varlen_attention_triton import varlen_attention_triton

        return varlen_attention_triton(q, k, v, cu_seqlens, scale, max_seqlen)
    return varlen_attention_torch(q, k, v, cu_seqlens, scale, max_seqlen)
