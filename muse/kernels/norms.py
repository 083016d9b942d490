"""RMSNorm and the fused residual add + RMSNorm: the PyTorch twins of `norms_triton`.

The math follows `muse.reference.layers.rms_norm`: the row is normalised in float32,
multiplied by the float32 weight and rounded once to the input dtype. `add_rms_norm` first
forms the residual sum in the input dtype (as the reference's `x = x + attn` does) and
normalises that rounded sum, so its two results are exactly what the unfused code would see.

The Triton kernels (`muse.kernels.norms_triton`) are the "triton" attention backend's norms
(see `muse.kernels.backends`), the twins the "torch" backend's. Both launch a fixed amount of work with no host synchronisation,
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
