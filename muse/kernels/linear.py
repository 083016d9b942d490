"""y = x @ W^T for the few rows of a decode step: dispatcher and its twin (`F.linear`).

A decode step multiplies 1-16 activation rows by every projection matrix of every layer, so
each product is a stream of the weight matrix through the GPU with almost no arithmetic.
cuBLAS picks tiles for such shapes that leave HBM bandwidth unused (split-K with a separate
reduce kernel for the deep ones, a handful of programs for narrow ones such as the router's
128 columns). `muse.kernels.linear_triton` instead gives each program a thin slab of 16
output columns across the whole depth, so even a narrow matrix spreads over many programs and
each keeps several weight tiles in flight; larger row counts (prefill) go to cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many rows the weight stream dominates and the Triton kernel is used on CUDA.
SKINNY_MAX_ROWS = 16


def use_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (x.is_cuda and bias is None and x.dim() == 2 and 0 < x.shape[0] <= SKINNY_MAX_ROWS
            and weight.stride(1) == 1 and x.dtype == weight.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear, through the skinny Triton kernel when a CUDA step has few rows."""
    if use_skinny(x, weight, bias):
        from muse.kernels.linear_triton import skinny_linear

        return skinny_linear(x, weight)
    return F.linear(x, weight, bias)


class EngineLinear(nn.Linear):
    """nn.Linear whose forward takes `linear`: the same parameters and state-dict names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_engine_linears(module: nn.Module) -> None:
    """Make every nn.Linear under `module` an EngineLinear, in place.

    The class of each instance changes and nothing else: parameters, views into fused
    weights, hooks and names stay as they are."""
    for child in module.modules():
        if type(child) is nn.Linear:
            child.__class__ = EngineLinear
