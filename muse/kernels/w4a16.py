"""W4A16 GEMMs on FP4 weights (NVFP4, MXFP4), multiplied as checkpoints store them.

An FP4 weight is an `Fp4Weight`: E2M1 values packed two per byte along the input dimension
(`packed` uint8 [..., out, in/2], low nibble = even input; bit 3 the sign, bits 0-2 index the
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), one scale per block of inputs and an optional float32
factor per output row:

    w[..., n, k] = e2m1[..., n, k] * scale[..., n, k // block] * row_factor[..., n, 0]

| format | block | `scales` [..., out, in/block] | `row_factor` [..., out, 1] |
|---|---|---|---|
| `"nvfp4"` | 16 | float8_e4m3fn | the per-tensor factor of the row's part (a multiplier) |
| `"mxfp4"` | 32 | E8M0: uint8 (or float8_e8m0fnu) s, 2^(s - 127) | usually None |

The leading `...` is empty for a linear layer's weight `[out, in]` and the expert dimension for
a fused MoE's `[E, out, in]`.

The numerics are those of the dequantized model, which `WeightOnlyLinearMethod` runs today:
`w` is formed in float32 (e2m1 * scale exactly, then one rounding for the row factor), rounded
to the activations' dtype, and multiplied with float32 accumulation. The Triton kernels
(`muse.kernels.w4a16_triton`, and the fused experts of `muse.kernels.moe_triton`) read the
packed bytes and scales, about 4.5 bits a weight instead of 16, and form the same rounded
weight tile in registers before each `tl.dot`; only the accumulation order differs from the
twins'. One activation row (batch-1 decode) takes a GEMV without `tl.dot`
(`w4a16_triton.w4a16_gemv`) that multiplies each block's sum by its scale and each output
by its row factor, so it also skips the per-weight rounding to the activation dtype.

How the quant methods call them (`muse.quantization`): build the `Fp4Weight`s once, in
`process_weights_after_loading` (the per-part factors already expanded per row, e.g. with
`row_scales`), so that a forward allocates nothing but its outputs and stays capturable:

    # a linear layer (the packed tensor is `weight_packed` or `weight` by layout)
    weight = Fp4Weight("nvfp4", layer.weight_packed, layer.weight_scale, layer.row_factor)
    y = w4a16_linear(x, weight, bias)                 # x [..., in] -> y [..., out]

    # a fused MoE: gate_up [E, 2I, L] (gate rows, then up rows; each part's factor on its
    # rows, row_factor [E, 2I, 1]) and down [E, L, I]
    out = layer.experts_kernel(x, topk_weights, topk_ids, gate_up, down, layer.norm_weight,
                               layer.eps, reduce_pairs=reduce_pairs)

`w4a16_linear` runs the Triton kernel on CUDA tensors and the twin elsewhere.
`experts_kernel` is the MoE backend's `fused_experts` (`fused_experts_torch` or
`moe_triton.fused_experts`): both take an `Fp4Weight` wherever they take a dense expert
tensor, and each of gate_up and down may be dense or FP4 on its own. gpt-oss's
`[E, 2I, H/32, 16]` blocks are the `[E, 2I, H/2]` packed bytes (`.flatten(-2)`, a view) once
its interleaved gate and up rows are loaded gate rows first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from muse.kernels.w8a16 import Fp8Weight

Fp4Format = Literal["nvfp4", "mxfp4"]

# Inputs per scale, and the scale dtypes each format accepts.
SCALE_BLOCK = {"nvfp4": 16, "mxfp4": 32}
_SCALE_DTYPES = {"nvfp4": (torch.float8_e4m3fn,),
                 "mxfp4": (torch.uint8, torch.float8_e8m0fnu)}
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# Compared by identity: its fields are tensors.
@dataclass(frozen=True, eq=False)
class Fp4Weight:
    """A dense `[out, in]` or stacked-experts `[E, out, in]` weight in NVFP4 or MXFP4.

    Built once per layer; construction checks only shapes and dtypes (no device work).
    """

    format: Fp4Format
    packed: torch.Tensor  # uint8 [..., out, in / 2]
    scales: torch.Tensor  # [..., out, in / block]: float8_e4m3fn (nvfp4) or E8M0 (mxfp4)
    row_factor: torch.Tensor | None = None  # float [..., out, 1]
    # The scales' bytes (uint8), as the kernels read them; viewed once here so that a
    # forward runs no torch op on the weight.
    scale_bytes: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.format not in SCALE_BLOCK:
            raise ValueError(f"Fp4Weight.format must be one of {sorted(SCALE_BLOCK)}, "
                             f"got {self.format!r}")
        if self.packed.dtype != torch.uint8 or self.packed.dim() < 2:
            raise ValueError(f"Fp4Weight.packed must be uint8 [..., out, in/2], got "
                             f"{self.packed.dtype} {list(self.packed.shape)}")
        allowed = _SCALE_DTYPES[self.format]
        if self.scales.dtype not in allowed:
            raise ValueError(f"Fp4Weight.scales of {self.format} must be one of "
                             f"{[str(d) for d in allowed]}, got {self.scales.dtype}")
        *lead, out, half = self.packed.shape
        expected = (*lead, out, 2 * half // self.block)
        if (2 * half) % self.block or tuple(self.scales.shape) != expected:
            raise ValueError(f"Fp4Weight.scales must be [..., out, in/{self.block}] = "
                             f"{list(expected)} for packed {list(self.packed.shape)} (in = "
                             f"{2 * half} must be a multiple of {self.block}), got "
                             f"{list(self.scales.shape)}")
        if self.row_factor is not None and (
                not self.row_factor.is_floating_point()
                or tuple(self.row_factor.shape) != (*lead, out, 1)):
            raise ValueError(f"Fp4Weight.row_factor must be a float tensor "
                             f"{[*lead, out, 1]} or None, got {self.row_factor.dtype} "
                             f"{list(self.row_factor.shape)}")
        devices = {t.device for t in (self.packed, self.scales, self.row_factor)
                   if t is not None}
        if len(devices) > 1:
            raise ValueError(f"Fp4Weight tensors must be on one device, got {devices}")
        scale_bytes = (self.scales if self.scales.dtype == torch.uint8
                       else self.scales.view(torch.uint8))
        object.__setattr__(self, "scale_bytes", scale_bytes)

    @property
    def block(self) -> int:
        """Inputs per scale: 16 (NVFP4) or 32 (MXFP4)."""
        return SCALE_BLOCK[self.format]

    @property
    def scale_is_e8m0(self) -> bool:
        return self.format == "mxfp4"

    @property
    def shape(self) -> torch.Size:
        """The logical shape [..., out, in]."""
        *lead, out, half = self.packed.shape
        return torch.Size((*lead, out, 2 * half))

    def dequantize(self) -> torch.Tensor:
        """float32 [..., out, in]: (e2m1 * scale) * row_factor."""
        scale = (self.scales.to(torch.float32) if self.format == "nvfp4"
                 else e8m0_to_float32(self.scale_bytes))
        w = unpack_e2m1(self.packed) * scale.repeat_interleave(self.block, dim=-1)
        if self.row_factor is not None:
            w = w * self.row_factor.to(torch.float32)
        return w


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n / 2] -> float32 [..., n], the low nibble the even element."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=packed.device)
    table = torch.cat([magnitudes, -magnitudes])
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).long()
    return table[nibbles].flatten(-2)


def e8m0_to_float32(exponents: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (uint8 biased exponents) -> float32 2^(s - 127), exactly; 255 is NaN."""
    biased = exponents.to(torch.int32)
    # s >= 1 is the float32 with that exponent field; s = 0 is the subnormal 2^-127.
    value = torch.where(biased == 0, 1 << 22, biased << 23).view(torch.float32)
    return torch.where(biased == 255, torch.nan, value)


def dense_weight(weight: torch.Tensor | Fp4Weight | Fp8Weight,
                 dtype: torch.dtype) -> torch.Tensor:
    """A dense weight as is; a quantized one (FP4, FP8) dequantized and rounded to `dtype`."""
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize().to(dtype)


def w4a16_linear_torch(x: torch.Tensor, weight: Fp4Weight,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain PyTorch twin: x [..., in] @ dequantized(weight).T (+ bias) in x's dtype."""
    return F.linear(x, dense_weight(weight, x.dtype), bias)


def w4a16_linear_triton(x: torch.Tensor, weight: Fp4Weight,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel (`muse.kernels.w4a16_triton.w4a16_linear`); CUDA-graph capturable."""
    # Imported here so that the CPU path works where Triton is not installed.
    from muse.kernels import w4a16_triton

    return w4a16_triton.w4a16_linear(x, weight, bias)


def w4a16_linear(x: torch.Tensor, weight: Fp4Weight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., out] = x [..., in] @ w.T (+ bias) in x's dtype (bfloat16, float16 or float32),
    accumulated in float32: the Triton kernel for CUDA tensors, the twin elsewhere."""
    if x.is_cuda:
        return w4a16_linear_triton(x, weight, bias)
    return w4a16_linear_torch(x, weight, bias)
