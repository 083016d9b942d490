"""Non-causal attention over packed variable-length sequences: the dispatcher and its twin.

The vision encoder packs the patches of every image (and every frame group of every video) of
a step into one [total, heads, head_dim] tensor; `cu_seqlens` ([sequences + 1] int32, starting
at 0) marks where each sequence starts, and a token attends to every token of its own sequence
and to nothing else, i.e. a block-diagonal mask. Heads of q, k and v are equal (no GQA).

`varlen_attention` runs the Triton kernel (`muse.kernels.varlen_attention_triton`) on CUDA and
the twin elsewhere; `varlen_attention_torch` is the twin, the oracle the kernel is tested
against: sequences sorted by length into buckets (the longest of a bucket at most
`BUCKET_RATIO` times its shortest), each bucket padded to its longest and run as one masked
SDPA call, computed in float32 and rounded once to q's dtype. It is differentiable, so
training takes it on CUDA too. A `VarlenLayout` holds the buckets of one packed step, so the
layers of an encoder share them instead of each working them out from `cu_seqlens` again:
a step then costs a few operations a layer, not a few per sequence, which is what bounds a
training step of a small encoder on a GPU.
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


# Padding a bucket costs at most this factor in each sequence's length.
BUCKET_RATIO = 1.25


class VarlenLayout:
    """The buckets of one packed step, from its sequence bounds (`cu_seqlens` as host ints),
    made on a device when first asked for and kept."""

    def __init__(self, bounds: list[int]) -> None:
        spans = sorted((end - start, start) for start, end in zip(bounds[:-1], bounds[1:])
                       if end > start)
        self.buckets: list[list[tuple[int, int]]] = []  # (length, start) per sequence
        for length, start in spans:
            if not self.buckets or length > BUCKET_RATIO * self.buckets[-1][0][0]:
                self.buckets.append([])
            self.buckets[-1].append((length, start))
        self._on: dict[torch.device, tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                           torch.Tensor]] = {}

    def on(self, device: torch.device) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                                torch.Tensor]:
        """Per bucket, (rows [sequences, longest] long: the packed row of each padded slot,
        0 in padding; valid [sequences, longest] bool), and the packed rows of every valid
        slot in bucket order."""
        if device not in self._on:
            buckets, rows = [], []
            for bucket in self.buckets:
                longest = bucket[-1][0]
                offsets = torch.arange(longest)
                lengths = torch.tensor([length for length, _ in bucket])
                starts = torch.tensor([start for _, start in bucket])
                valid = offsets[None, :] < lengths[:, None]
                index = torch.where(valid, starts[:, None] + offsets[None, :], 0)
                buckets.append((index.to(device), valid.to(device)))
                rows.append(index[valid])
            self._on[device] = (buckets, torch.cat(rows).to(device) if rows else
                                torch.zeros(0, dtype=torch.long, device=device))
        return self._on[device]


def varlen_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cu_seqlens: torch.Tensor, scale: float,
                           max_seqlen: int | None = None,
                           layout: VarlenLayout | None = None) -> torch.Tensor:
    """q, k, v [total, heads, head_dim] -> [total, heads, head_dim]; max_seqlen is unused.

    `layout`, when the caller keeps one for the step, spares reading `cu_seqlens` back and
    bucketing again."""
    check_varlen_inputs(q, k, v, cu_seqlens)
    if layout is None:
        layout = VarlenLayout(cu_seqlens.tolist())
    buckets, rows = layout.on(q.device)
    if not buckets:
        return torch.zeros_like(q)
    pieces = []
    for index, valid in buckets:
        # [sequences, heads, longest, head_dim], as SDPA takes it; padded keys masked out.
        q_pad, k_pad, v_pad = (x[index].transpose(1, 2).float() for x in (q, k, v))
        attended = F.scaled_dot_product_attention(q_pad, k_pad, v_pad, scale=scale,
                                                  attn_mask=valid[:, None, None, :])
        pieces.append(attended.transpose(1, 2)[valid])
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    # float(): under autocast SDPA returns bf16 whatever its inputs.
    out = out.index_copy(0, rows, torch.cat(pieces).float())
    return out.to(q.dtype)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens: torch.Tensor, scale: float,
                     max_seqlen: int | None = None,
                     layout: VarlenLayout | None = None) -> torch.Tensor:
    """q, k, v [total, heads, head_dim] -> [total, heads, head_dim], block-diagonal by
    `cu_seqlens`. `max_seqlen` (the longest sequence) sizes the kernel's grid; passing it
    spares a device-to-host copy."""
    # The Triton kernel has no backward: training takes the torch path.
    if q.is_cuda and not (torch.is_grad_enabled() and q.requires_grad):
        # Imported here so that CPU-only processes never import Triton.
        from muse.kernels.varlen_attention_triton import varlen_attention_triton

        return varlen_attention_triton(q, k, v, cu_seqlens, scale, max_seqlen)
    return varlen_attention_torch(q, k, v, cu_seqlens, scale, max_seqlen, layout)
