"""RMSNorm and the fused residual add + RMSNorm: dispatchers and their PyTorch twins.

The math follows `muse.reference.layers.rms_norm`: the row is normalised in float32,
multiplied by the float32 weight and rounded once to the input dtype. `add_rms_norm` first
forms the residual sum in the input dtype (as the reference's `x = x + attn` does) and
normalises that rounded sum, so its two results are exactly what the unfused code would see.

CUDA tensors take the Triton kernel (`muse.kernels.norms_triton`); everything else (CPU, tests
without a GPU) takes the twin. Both launch a fixed amount of work with no host synchronisation,
so they can be captured in a CUDA graph. The Triton sum of squares is reduced in a different
order from torch's, so float32 results agree to a few ulps rather than bit for bit; the twins
are bit-identical to the reference.
"""

from __future__ import annotations

import torch

# The twin of `rms_norm` is the reference op itself.
from muse.reference.layers import rms_norm as rms_norm_torch


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x.dtype first."""
    summed = (x + residual).to(x.dtype)
    return rms_norm_torch(summed, weight, eps), summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: float32 math, result in x.dtype."""
    if x.is_cuda:
        # Imported here so that CPU-only processes never import Triton.
        from muse.kernels import norms_triton

        return norms_triton.rms_norm_triton(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, summed): summed = x + residual in x.dtype, normed = rms_norm(summed)."""
    if x.is_cuda:
        from muse.kernels import norms_triton

        return norms_triton.add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_torch(x, residual, weight, eps)
