"""FP8 E4M3 expert weights multiplied as checkpoints store them (W8A16).

An FP8 weight is an `Fp8Weight`: float8_e4m3fn values `[..., out, in]` and float32 scales,
one per output row, or (`block`) one per block of rows x inputs:

    w[..., n, k] = e4m3[..., n, k] * scale[..., n, 0]                          (rows)
    w[..., n, k] = e4m3[..., n, k] * scale[..., n // block_n, k // block_k]      (blocks)

Per-channel checkpoints store the row scale; per-tensor ones (one scalar per fused part,
gate and up) are expanded to their rows once, after loading (`row_scales` in
`muse.quantization.common`); 128 x 128 block checkpoints (DeepSeek's layout) keep their grid.

The numerics are those of the dequantized model: `w` is formed in float32 (one rounding, the
product by the scale), rounded to the activations' dtype, and multiplied with float32
accumulation. The twin (`fused_experts_torch`) dequantizes and rounds the whole tensor first;
the fused experts' Triton GEMMs (`muse.kernels.moe_triton`) read the FP8 bytes, 8 bits a
weight instead of 16, and form the same rounded tile in registers inside their K loop (a
block-scaled weight's K tiles never straddle a scale block), so nothing but the
accumulation order differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


# Compared by identity: its fields are tensors.
@dataclass(frozen=True, eq=False)
class Fp8Weight:
    """A dense `[out, in]` or stacked-experts `[E, out, in]` FP8 weight with per-row or
    per-block scales.

    Built once per layer; construction checks only shapes and dtypes (no device work).
    """

    weight: torch.Tensor  # float8_e4m3fn [..., out, in]
    # float32 [..., out, 1] (rows), or [..., ceil(out / block_n), ceil(in / block_k)]
    scale: torch.Tensor
    block: tuple[int, int] | None = None  # (block_n, block_k) of block scales
    # The weight's bytes (uint8), as the kernels read them (Triton's interpreter cannot take
    # float8 tensors); viewed once here so that a forward runs no torch op on the weight.
    weight_bytes: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.weight.dtype != torch.float8_e4m3fn or self.weight.dim() < 2:
            raise ValueError(f"Fp8Weight.weight must be float8_e4m3fn [..., out, in], got "
                             f"{self.weight.dtype} {list(self.weight.shape)}")
        *lead, out, inp = self.weight.shape
        if self.block is None:
            expected = (*lead, out, 1)
        else:
            block_n, block_k = self.block
            expected = (*lead, -(-out // block_n), -(-inp // block_k))
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != expected:
            raise ValueError(f"Fp8Weight.scale must be float32 {list(expected)}, got "
                             f"{self.scale.dtype} {list(self.scale.shape)}")
        if self.weight.device != self.scale.device:
            raise ValueError(f"Fp8Weight tensors must be on one device, got "
                             f"{self.weight.device} and {self.scale.device}")
        object.__setattr__(self, "weight_bytes", self.weight.view(torch.uint8))

    @property
    def shape(self) -> torch.Size:
        """The logical shape [..., out, in]."""
        return self.weight.shape

    def dequantize(self) -> torch.Tensor:
        """float32 [..., out, in]: e4m3 * scale (its row's, or its block's)."""
        values = self.weight.to(torch.float32)
        if self.block is None:
            return values * self.scale
        (block_n, block_k), (out, inp) = self.block, self.weight.shape[-2:]
        rows = self.scale.repeat_interleave(block_n, dim=-2)[..., :out, :]
        return values * rows.repeat_interleave(block_k, dim=-1)[..., :inp]
