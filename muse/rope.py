"""Rotary position embedding with optional YaRN context extension (shared by every model path)."""

from __future__ import annotations

import math

import torch

from muse.config import RopeParameters


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_positions: int) -> float:
    # The rotary dimension whose wavelength completes `num_rotations` turns over the context.
    return dim * math.log(max_positions / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def inverse_frequencies(params: RopeParameters, head_dim: int) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies and the attention scale that multiplies cos and sin."""
    # Built on the CPU even inside a meta-device context: these are constants, not weights.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
    base_frequencies = params.rope_theta ** exponents
    if params.rope_type == "default":
        return 1.0 / base_frequencies, 1.0
    # YaRN: high-frequency pairs (many turns in the original context) are kept as they are,
    # low-frequency pairs are interpolated by `factor`, with a linear ramp in between.
    low = math.floor(_yarn_correction_dim(params.beta_fast, head_dim, params.rope_theta,
                                          params.original_max_position_embeddings))
    high = math.ceil(_yarn_correction_dim(params.beta_slow, head_dim, params.rope_theta,
                                          params.original_max_position_embeddings))
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pairs = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp
    inv_freq = (1.0 / (params.factor * base_frequencies)) * (1.0 - keep) \
        + (1.0 / base_frequencies) * keep
    attention_scale = 0.1 * math.log(params.factor) + 1.0 if params.factor > 1 else 1.0
    return inv_freq, attention_scale


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape positions.shape + (head_dim,), in float32."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * scale, angles.sin() * scale


def rotary_cos_sin(positions: torch.Tensor, params: RopeParameters,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cos_sin(positions, *inverse_frequencies(params, head_dim))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` of shape [..., tokens, heads, head_dim] by cos/sin of shape [..., tokens, dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
