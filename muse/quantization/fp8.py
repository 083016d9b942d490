"""FP8 E4M3 weights: one scale per tensor, per output channel, or per block of the weight.

The stored weight is float8_e4m3fn `[out, in]` and dequantizes as `w = fp8 * scale`, the
scale a float32 multiplier of the shape its strategy gives:

| strategy | scale shape | written by |
|---|---|---|
| `tensor` | `[]` or `[1]` (`weight_scale`) | compressed-tensors, ModelOpt `FP8` |
| `channel` | `[out, 1]` (`weight_scale`) | compressed-tensors |
| `block` | `[ceil(out / bo), ceil(in / bi)]` (`weight_scale`, or DeepSeek's `weight_scale_inv`, a multiplier despite its name) | compressed-tensors, HF `fp8` |

A fused q/k/v or gate/up layer keeps each part's per-tensor scale (one entry per part), so no
part is requantized. Static activation scales (`input_scale`) are loaded and kept; the GEMM
here is weight-only (activations stay in the model's dtype): it dequantizes the weight and
multiplies, the exact numerics of the dequantized-BF16 reference.
"""

from __future__ import annotations

import torch
from torch import nn

from muse.layers.quantization import WeightLoader, new_parameter
from muse.quantization.common import (WeightOnlyLinearMethod, WeightOnlyMoEMethod, expert_param,
                                      moe_tags, row_scales)

STRATEGIES = ("tensor", "channel", "block")


class Fp8Scheme:
    """How a checkpoint's FP8 weights are scaled."""

    def __init__(self, strategy: str, block: tuple[int, int] | None = None,
                 scale_name: str = "weight_scale", static_input_scale: bool = False) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"FP8 weight strategy must be one of {STRATEGIES}, got "
                             f"{strategy!r}")
        if (strategy == "block") != (block is not None):
            raise ValueError("a block size is given exactly for the block strategy")
        self.strategy = strategy
        self.block = block
        self.scale_name = scale_name
        self.static_input_scale = static_input_scale

    def __repr__(self) -> str:
        block = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        return f"Fp8Scheme({self.strategy}{block}, {self.scale_name})"


def dequantize(weight: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme) -> torch.Tensor:
    """float32 `[..., out, in]` from the FP8 weight and its scale (leading dims: experts)."""
    values = weight.to(torch.float32)
    if scheme.strategy != "block":
        return values * scale  # [..., out, 1], a per-channel view of any scale
    rows, cols = scheme.block
    out, inp = weight.shape[-2:]
    expanded = scale.repeat_interleave(rows, dim=-2)[..., :out, :]
    return values * expanded.repeat_interleave(cols, dim=-1)[..., :inp]


def _scale_shape(scheme: Fp8Scheme, out: int, inp: int, parts: int) -> tuple[int, ...]:
    if scheme.strategy == "tensor":
        return (parts,)
    if scheme.strategy == "channel":
        return (out, 1)
    return (-(-out // scheme.block[0]), -(-inp // scheme.block[1]))


class Fp8LinearMethod(WeightOnlyLinearMethod):
    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: WeightLoader) -> None:
        scheme, out = self.scheme, sum(output_partition_sizes)
        new_parameter(layer, "weight", (out, input_size_per_partition), torch.float8_e4m3fn,
                      weight_loader, output_dim=0, input_dim=1)
        shape = _scale_shape(scheme, out, input_size_per_partition, len(output_partition_sizes))
        tags = {"per_shard": True} if scheme.strategy == "tensor" else \
            {"output_dim": 0} if scheme.strategy == "channel" else {"output_dim": 0, "input_dim": 1}
        new_parameter(layer, scheme.scale_name, shape, torch.float32, weight_loader, **tags)
        if scheme.static_input_scale:
            new_parameter(layer, "input_scale", (len(output_partition_sizes),), torch.float32,
                          weight_loader, per_shard=True)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        scale = getattr(layer, self.scheme.scale_name)
        if self.scheme.strategy == "tensor":
            scale = row_scales(scale.data, layer.output_partition_sizes)
        layer.register_buffer("dequant_scale", scale.data, persistent=False)

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        return dequantize(layer.weight, layer.dequant_scale, self.scheme)


class Fp8MoEMethod(WeightOnlyMoEMethod):
    """The experts' gate/up and down projections in FP8, with the per-expert scales of the
    checkpoint's `experts.{e}.{gate,up,down}_proj.weight_scale` (per-tensor: one per part)."""

    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        scheme, inter = self.scheme, intermediate_size_per_partition
        shapes = {"gate_up": (2 * inter, hidden_size, 2), "down": (hidden_size, inter, 1)}
        for projection, (out, inp, parts) in shapes.items():
            name = f"{projection}_proj"
            new_parameter(layer, name, (num_experts, out, inp), torch.float8_e4m3fn,
                          weight_loader, **moe_tags(projection, rows=True, columns=True))
            shape = (num_experts, *_scale_shape(scheme, out, inp, parts))
            # Per channel: one scale per output row; per block: the blocks' grid.
            tags = moe_tags(projection, per_part=scheme.strategy == "tensor", rows=True,
                            columns=scheme.strategy == "block")
            new_parameter(layer, expert_param(projection, scheme.scale_name), shape,
                          torch.float32, weight_loader, **tags)
            if scheme.static_input_scale:
                new_parameter(layer, expert_param(projection, "input_scale"),
                              (num_experts, parts), torch.float32, weight_loader,
                              **moe_tags(projection, per_part=True))

    def dequantized(self, layer: nn.Module, projection: str) -> torch.Tensor:
        weight = getattr(layer, expert_param(projection, "weight"))
        scale = getattr(layer, expert_param(projection, self.scheme.scale_name))
        if self.scheme.strategy == "tensor":
            # One scalar per part and expert: rows of the gate half, then of the up half.
            parts = scale.shape[1]
            scale = row_scales(scale, [weight.shape[1] // parts] * parts)
        return dequantize(weight, scale, self.scheme)
