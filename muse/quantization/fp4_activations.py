"""NVFP4 activations as a W4A4 GEMM quantizes them, emulated in plain PyTorch.

Blackwell runs NVFP4 W4A4 checkpoints by quantizing each activation row to NVFP4 on the fly:
blocks of 16 values, an FP8 E4M3 scale per block from the block's amax, relative to one
static float32 global scale per layer calibrated offline. Hopper and CPUs have no FP4 tensor
cores, so there W4A4 checkpoints run W4A16 by default; `fake_quantize_nvfp4` reproduces the
activation rounding (quantize, then dequantize to the activation dtype) so the W4A4 model's
numerics can be measured anywhere.

The numerics are those of compressed-tensors' `fake_quantize` for its NVFP4 input
activations (`compute_dynamic_scales_and_zp` then `fake_quantize`, strategy `tensor_group`,
the tool that writes the `nvfp4-pack-quantized` checkpoints), with `d` the global divisor
(compressed-tensors' `input_global_scale`; 1 / ModelOpt's `input_scale`):

    s     = e4m3(clamp(d * (amax(|block|) / 6), +-448))   (amax / 6 rounds in x's dtype)
    s     = 0.125 where s is 0                            (E4M3's eps, as compressed-tensors)
    q     = e2m1(clamp(x / (s / d), +-6))                 (in float32)
    x_hat = (q * (s / d)) in x's dtype

e2m1 rounds to the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to the even code (0.25 -> 0,
0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4): compressed-tensors' thresholds,
and the round-to-nearest-even of the hardware's conversion. A quantize kernel that computes
amax / 6 in float32 instead can pick another E4M3 block scale for bfloat16 activations where
the two roundings straddle an E4M3 midpoint (none in 200,000 random blocks).

A fused layer (q/k/v, gate/up) has one divisor per part but one input: `global_divisor` takes
the largest multiplier (smallest divisor), so no part's calibrated range is clipped; the parts
of one input are calibrated on the same activations, so they agree in practice.
"""

from __future__ import annotations

import logging

import torch

from muse.kernels.moe import fused_experts_torch
from muse.kernels.moe_align import PairReduce
from muse.kernels.w4a16 import E2M1_MAGNITUDES

logger = logging.getLogger("muse")

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
ZERO_SCALE = 0.125  # compressed-tensors' block scale where the E4M3 scale rounds to 0
# Midpoints between neighbouring E2M1 magnitudes; a magnitude on one goes down (bucketize)
# unless the upper neighbour has the even code.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)


def round_to_e2m1(values: torch.Tensor) -> torch.Tensor:
    """The nearest FP4 E2M1 value of each entry (ties to even), magnitudes saturating at 6,
    in `values`' dtype."""
    magnitude = values.abs()
    midpoints = torch.tensor(_MIDPOINTS, dtype=values.dtype, device=values.device)
    index = torch.bucketize(magnitude, midpoints)
    for tie in _TIES_UP:
        index = index + (magnitude == tie).to(index.dtype)
    table = torch.tensor(E2M1_MAGNITUDES, dtype=values.dtype, device=values.device)
    rounded = table[index]
    return torch.where(values < 0, -rounded, rounded)


def nvfp4_block_scales(x: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """The E4M3 block scales (as float32) of x [..., K] for global divisor `divisor` (a
    float32 scalar): [..., K / 16, 1]."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = (amax / E2M1_MAX).float() * divisor.float()
    scale = scale.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return torch.where(scale == 0, torch.full_like(scale, ZERO_SCALE), scale)


def fake_quantize_nvfp4(x: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 16) quantized to NVFP4 blocks with global divisor `divisor`
    and dequantized, in x's dtype (see the module docstring)."""
    if x.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 activations need widths divisible by {BLOCK}, got "
                         f"{x.shape[-1]}")
    if x.numel() == 0:
        return x
    effective = nvfp4_block_scales(x, divisor) / divisor.float()
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK).float()
    quantized = round_to_e2m1((blocks / effective).clamp(-E2M1_MAX, E2M1_MAX))
    return (quantized * effective).reshape(x.shape).to(x.dtype)


def global_divisor(stored: torch.Tensor, is_divisor: bool) -> torch.Tensor:
    """One float32 global divisor per row of `stored` [..., parts], the activation scales of a
    fused layer's parts as the checkpoint stores them (divisors, or multipliers when not
    `is_divisor`): the smallest divisor, i.e. the largest multiplier. Entries that are zero,
    negative or not finite (an expert calibration never reached) are skipped; a row left
    without any takes the smallest divisor of the other rows."""
    stored = stored.float()
    valid = torch.isfinite(stored) & (stored > 0)
    divisors = stored if is_divisor else 1.0 / stored
    divisors = torch.where(valid, divisors, torch.full_like(divisors, float("inf"))).amin(-1)
    usable = torch.isfinite(divisors)
    if not bool(usable.any()):
        raise ValueError("no W4A4 activation scale is positive and finite; the checkpoint's "
                         "activation quantization cannot be emulated")
    if not bool(usable.all()):
        logger.warning("%d of %d W4A4 activation scales are zero or not finite; they take "
                       "the largest of the others", int((~usable).sum()), usable.numel())
        divisors = torch.where(usable, divisors, divisors[usable].min())
    return divisors


def fused_experts_emulated(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                           gate_up: torch.Tensor, down: torch.Tensor,
                           norm_weight: torch.Tensor | None, eps: float,
                           gate_up_divisor: torch.Tensor, down_divisor: torch.Tensor,
                           reduce_pairs: PairReduce | None = None) -> torch.Tensor:
    """`muse.kernels.moe.fused_experts_torch` with W4A4 activations: each expert's input rows
    are NVFP4-fake-quantized with its gate/up divisor (`gate_up_divisor` [E]) and its
    intermediate h with its down divisor (`down_divisor` [E]) before the matmuls. It asks the
    host for the per-expert counts, so a step containing it cannot be captured in a CUDA
    graph."""
    divisors = {"gate_up": gate_up_divisor, "down": down_divisor}
    return fused_experts_torch(
        x, weights, expert_ids, gate_up, down, norm_weight, eps, reduce_pairs,
        activations=lambda rows, expert, projection: fake_quantize_nvfp4(
            rows, divisors[projection][expert]))
