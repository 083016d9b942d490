"""NVFP4 weights: FP4 E2M1 values in blocks of 16, an FP8 E4M3 scale per block and one FP32
scale per tensor.

Two values per byte along the input dimension, the low nibble first; bit 3 of a nibble is the
sign and bits 0-2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. `w = e2m1 * block_scale *
g`, where the per-tensor factor g is stored two ways:

| layout | weight | block scale | per-tensor | static activations |
|---|---|---|---|---|
| compressed-tensors `nvfp4-pack-quantized` | `weight_packed` | `weight_scale` | `weight_global_scale`, a divisor (g = 1 / it) | `input_global_scale` |
| ModelOpt `NVFP4` | `weight` | `weight_scale` | `weight_scale_2`, a multiplier | `input_scale` |

A fused q/k/v or gate/up keeps each part's per-tensor factor (nothing is requantized). The
GEMM is weight-only (W4A16): the weight is dequantized to the activation dtype and multiplied,
exactly the dequantized-BF16 model's numerics; static activation scales (W4A4 checkpoints)
are loaded and kept.
"""

from __future__ import annotations

import torch
from torch import nn

from muse.layers.quantization import WeightLoader, new_parameter
from muse.quantization.common import (WeightOnlyLinearMethod, WeightOnlyMoEMethod, expert_param,
                                      moe_tags, row_scales)

BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n / 2] -> float32 [..., n], the low nibble the even element."""
    magnitudes = torch.tensor(E2M1_VALUES, device=packed.device)
    table = torch.cat([magnitudes, -magnitudes])
    pairs = torch.stack([packed & 0xF, packed >> 4], dim=-1).long()
    return table[pairs].flatten(-2)


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor,
                     row_factor: torch.Tensor) -> torch.Tensor:
    """float32 [..., out, in] from packed [..., out, in / 2], block scales [..., out, in / 16]
    and each row's per-tensor factor [..., out, 1]."""
    blocks = block_scale.to(torch.float32).repeat_interleave(BLOCK, dim=-1)
    return unpack_e2m1(packed) * blocks * row_factor


class Nvfp4Layout:
    """Where a checkpoint's NVFP4 tensors are and how its per-tensor factor reads."""

    def __init__(self, layout: str, static_input_scale: bool = False) -> None:
        if layout == "compressed-tensors":
            self.weight, self.factor, self.input = ("weight_packed", "weight_global_scale",
                                                    "input_global_scale")
            self.factor_is_divisor = True
        elif layout == "modelopt":
            self.weight, self.factor, self.input = "weight", "weight_scale_2", "input_scale"
            self.factor_is_divisor = False
        else:
            raise ValueError(f"unknown NVFP4 layout {layout!r}")
        self.layout = layout
        self.static_input_scale = static_input_scale

    def multiplier(self, factor: torch.Tensor) -> torch.Tensor:
        return 1.0 / factor if self.factor_is_divisor else factor

    def __repr__(self) -> str:
        return f"Nvfp4Layout({self.layout})"


def _check_blocks(width: int, what: str) -> None:
    if width % BLOCK:
        raise ValueError(f"{what}: NVFP4 needs input widths divisible by {BLOCK}, got {width}")


class Nvfp4LinearMethod(WeightOnlyLinearMethod):
    def __init__(self, layout: Nvfp4Layout) -> None:
        self.layout = layout

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: WeightLoader) -> None:
        layout, out, inp = self.layout, sum(output_partition_sizes), input_size_per_partition
        parts = len(output_partition_sizes)
        _check_blocks(inp, getattr(layer, "prefix", "layer"))
        new_parameter(layer, layout.weight, (out, inp // 2), torch.uint8, weight_loader,
                      output_dim=0, input_dim=1)
        new_parameter(layer, "weight_scale", (out, inp // BLOCK), torch.float8_e4m3fn,
                      weight_loader, output_dim=0, input_dim=1)
        new_parameter(layer, layout.factor, (parts,), torch.float32, weight_loader,
                      per_shard=True)
        if layout.static_input_scale:
            new_parameter(layer, layout.input, (parts,), torch.float32, weight_loader,
                          per_shard=True)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        factor = self.layout.multiplier(getattr(layer, self.layout.factor).data)
        layer.register_buffer("row_factor", row_scales(factor, layer.output_partition_sizes),
                              persistent=False)

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        return dequantize_nvfp4(getattr(layer, self.layout.weight), layer.weight_scale,
                                layer.row_factor)


class Nvfp4MoEMethod(WeightOnlyMoEMethod):
    """The experts' projections in NVFP4, from `experts.{e}.{gate,up,down}_proj.*`."""

    def __init__(self, layout: Nvfp4Layout) -> None:
        self.layout = layout

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        layout, inter = self.layout, intermediate_size_per_partition
        shapes = {"gate_up": (2 * inter, hidden_size, 2), "down": (hidden_size, inter, 1)}
        for projection, (out, inp, parts) in shapes.items():
            _check_blocks(inp, f"{getattr(layer, 'prefix', 'experts')} {projection}")
            blocks = moe_tags(projection, rows=True, columns=True)
            new_parameter(layer, expert_param(projection, layout.weight),
                          (num_experts, out, inp // 2), torch.uint8, weight_loader, **blocks)
            new_parameter(layer, expert_param(projection, "weight_scale"),
                          (num_experts, out, inp // BLOCK), torch.float8_e4m3fn,
                          weight_loader, **blocks)
            for leaf in (layout.factor,) + ((layout.input,) if layout.static_input_scale
                                            else ()):
                new_parameter(layer, expert_param(projection, leaf), (num_experts, parts),
                              torch.float32, weight_loader, **moe_tags(projection,
                                                                      per_part=True))

    def dequantized(self, layer: nn.Module, projection: str) -> torch.Tensor:
        layout = self.layout
        packed = getattr(layer, expert_param(projection, layout.weight))
        factor = layout.multiplier(getattr(layer, expert_param(projection, layout.factor)))
        parts = factor.shape[1]
        rows = row_scales(factor, [packed.shape[1] // parts] * parts)
        return dequantize_nvfp4(packed, getattr(layer, expert_param(projection, "weight_scale")),
                                rows)
