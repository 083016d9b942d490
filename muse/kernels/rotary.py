"""Per-head q/k RMSNorm followed by rotary embedding: the dispatcher and its PyTorch twin.

This is `AttentionProjections.qkv` after the projections: each q and k head is optionally
RMS-normalised over head_dim, then rotated with the rotate-half convention by cos/sin of shape
[tokens, head_dim] (float32, already multiplied by the attention scale). Rounding points follow
the reference: the norm is rounded to the input dtype before the rotation reads it, and the
rotation is computed in float32 and rounded once more.

`qk_norm_rope` (the "triton" attention backend's) runs the Triton kernel
(`muse.kernels.rotary_triton`), which handles q and k in a single launch with no host
synchronisation (safe under CUDA graph capture), and the twin for the calls the kernel does
not take; `qk_norm_rope_torch` (the "torch" backend's) is the reference ops themselves.
"""

from __future__ import annotations

import torch

from muse.reference.layers import rms_norm
from muse.rope import apply_rotary


def qk_norm_rope_torch(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference ops on q [T, Hq, D], k [T, Hk, D], cos/sin [T, D]; a None weight: no norm."""
    if q_weight is not None:
        q = rms_norm(q, q_weight, eps)
    if k_weight is not None:
        k = rms_norm(k, k_weight, eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm of q [T, Hq, D] and k [T, Hk, D], then rotary by cos/sin [T, D].

    Outputs are new contiguous tensors in the input dtype. The Triton kernel, or the twin for
    the unusual calls the kernel does not take: q and k of different dtypes, or a norm weight
    for only one of them.
    """
    fused = q.dtype == k.dtype and (q_weight is None) == (k_weight is None)
    if fused:
        # Imported here so that CPU-only processes never import Triton.
        from muse.kernels import rotary_triton

        return rotary_triton.qk_norm_rope_triton(q, k, q_weight, k_weight, cos, sin, eps)
    return qk_norm_rope_torch(q, k, q_weight, k_weight, cos, sin, eps)
