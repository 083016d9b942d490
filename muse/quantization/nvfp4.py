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
GEMM is weight-only (W4A16) by default: the W4A16 kernels (`muse.kernels.w4a16`; Triton on
CUDA, on the CPU their twin, which dequantizes and multiplies) read the packed values and
scales and form the weight in the activation dtype, exactly the dequantized-BF16 model's
numerics; that is how engines run W4A4 checkpoints on GPUs without FP4 tensor cores (Hopper).

W4A4 emulation: when the checkpoint has static activation scales (`input_global_scale` /
`input_scale`) and `QuantOptions.emulate_activations` is set (the engine's
`quantization_emulate_activations`), activations are quantized to NVFP4 blocks and
dequantized (`muse.quantization.fp4_activations`) before the W4A16 multiply: the linears'
inputs, and in the fused MoE each expert's input and its intermediate h, each with its own
expert's scale (the experts then run the plain PyTorch path, `fused_experts_emulated`, which
asks the host for expert counts: the engine runs eagerly, without CUDA graphs, when
emulating). A fused layer uses the largest multiplier of its parts' activation scales.
"""

from __future__ import annotations

import torch
from torch import nn

from muse.kernels.moe_align import PairReduce
from muse.kernels.w4a16 import Fp4Weight
from muse.layers.quantization import WeightLoader, new_parameter
from muse.quantization.common import (Fp4LinearMethod, Fp4MoEMethod, QuantOptions,
                                      current_quant_options, expert_param, moe_tags, row_scales)
from muse.quantization.fp4_activations import (BLOCK, fake_quantize_nvfp4,
                                               fused_experts_emulated, global_divisor)


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


def _emulates(layout: Nvfp4Layout, options: QuantOptions | None) -> bool:
    """W4A4 emulation: asked for, and the checkpoint has static activation scales."""
    options = options if options is not None else current_quant_options()
    return options.emulate_activations and layout.static_input_scale


class Nvfp4LinearMethod(Fp4LinearMethod):
    """W4A16, or W4A4 emulation (`self.emulate`) when asked for and the checkpoint has
    activation scales; `options` default to the engine's (`current_quant_options()`)."""

    def __init__(self, layout: Nvfp4Layout, options: QuantOptions | None = None) -> None:
        self.layout = layout
        self.emulate = _emulates(layout, options)

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
        super().process_weights_after_loading(layer)
        if self.emulate:
            layer.register_buffer("input_divisor", global_divisor(
                getattr(layer, self.layout.input).data, self.layout.factor_is_divisor),
                persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.emulate:
            x = fake_quantize_nvfp4(x, layer.input_divisor)
        return super().apply(layer, x, bias)

    def fp4_weight(self, layer: nn.Module) -> Fp4Weight:
        return Fp4Weight("nvfp4", getattr(layer, self.layout.weight), layer.weight_scale,
                         layer.row_factor)


class Nvfp4MoEMethod(Fp4MoEMethod):
    """The experts' projections in NVFP4, from `experts.{e}.{gate,up,down}_proj.*`: W4A16
    through the MoE backend's experts kernel, or W4A4 emulation (`self.emulate`) through
    `fused_experts_emulated`, each expert's activations with its own scales."""

    def __init__(self, layout: Nvfp4Layout, options: QuantOptions | None = None) -> None:
        self.layout = layout
        self.emulate = _emulates(layout, options)

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

    def fp4_weight(self, layer: nn.Module, projection: str) -> Fp4Weight:
        layout = self.layout
        packed = getattr(layer, expert_param(projection, layout.weight))
        factor = layout.multiplier(getattr(layer, expert_param(projection, layout.factor)))
        parts = factor.shape[1]
        rows = row_scales(factor, [packed.shape[1] // parts] * parts)
        return Fp4Weight("nvfp4", packed,
                         getattr(layer, expert_param(projection, "weight_scale")), rows)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        if not self.emulate:
            return
        for projection in ("gate_up", "down"):
            stored = getattr(layer, expert_param(projection, self.layout.input)).data
            layer.register_buffer(f"{projection}_input_divisor", global_divisor(
                stored, self.layout.factor_is_divisor), persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, reduce_pairs: PairReduce | None = None) -> torch.Tensor:
        if not self.emulate:
            return super().apply(layer, x, topk_weights, topk_ids, reduce_pairs)
        return fused_experts_emulated(x, topk_weights, topk_ids,
                                      self.dequantized(layer, "gate_up").to(x.dtype),
                                      self.dequantized(layer, "down").to(x.dtype),
                                      layer.norm_weight, layer.eps,
                                      layer.gate_up_input_divisor, layer.down_input_divisor,
                                      reduce_pairs=reduce_pairs)
