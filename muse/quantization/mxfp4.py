"""MXFP4 weights (OCP microscaling): FP4 E2M1 values in groups of 32 sharing one E8M0 scale.

The E2M1 values are packed as for NVFP4 (two per byte along the input dimension, the low
nibble first). Each group of 32 values has one scale, an E8M0 power of two stored as a uint8
exponent with bias 127: `w = e2m1 * 2 ** (s - 127)`. There is no per-tensor scale.

Two layouts:

- compressed-tensors `mxfp4-pack-quantized` (llm-compressor's `MXFP4A16`; config groups with
  4-bit float weights, `strategy: group`, `group_size: 32`): any linear or expert projection
  has `weight_packed` uint8 `[out, in/2]` and `weight_scale` uint8 `[out, in/32]`; experts are
  stored per expert (`experts.{e}.{gate,up,down}_proj`).
- gpt-oss (`quantization_config: {quant_method: "mxfp4", modules_to_not_convert}`): stacked
  experts only, `experts.gate_up_proj_blocks` uint8 `[E, 2I, H/32, 16]` with
  `gate_up_proj_scales` uint8 `[E, 2I, H/32]` (gate and up rows interleaved: row 2i is gate
  feature i, row 2i + 1 up feature i), `down_proj_blocks` `[E, H, I/32, 16]` with
  `down_proj_scales` `[E, H, I/32]`, optional `*_bias`; every other layer unquantized.

The packed values and scales are kept as parameters in the checkpoint's shapes (a rank's
slice of them), so a kernel can read them as they are; gpt-oss's interleaved gate/up rows are
put in the engine's order (gate rows, then up rows) as they are loaded. Like NVFP4 the GEMM is
weight-only (W4A16): the GEMM and the experts kernel read the packed values and scales as
they are (`muse.kernels.w4a16`).
Tensor and expert parallelism shard packed values and scales with their rows and groups:
every rank's input width (down_proj's: its share of the intermediate features) must be a
multiple of 32. The experts kernel has no bias: gpt-oss's expert biases load only when zero.
"""

from __future__ import annotations

import torch
from torch import nn

from muse.checkpoint.layout import CheckpointError
from muse.layers.quantization import WeightLoader, new_parameter
from muse.kernels.w4a16 import Fp4Weight
from muse.quantization.common import Fp4LinearMethod, Fp4MoEMethod, expert_param, moe_tags

GROUP = 32
E8M0_BIAS = 127
LAYOUTS = ("compressed-tensors", "gpt-oss")


def _check_groups(width: int, what: str) -> None:
    if width % GROUP:
        raise ValueError(f"{what}: MXFP4 needs input widths divisible by {GROUP}, got {width} "
                         "(with tensor parallelism, each rank's share)")


class Mxfp4LinearMethod(Fp4LinearMethod):
    """A linear layer in compressed-tensors' MXFP4 (`weight_packed`, `weight_scale`)."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: WeightLoader) -> None:
        out, inp = sum(output_partition_sizes), input_size_per_partition
        _check_groups(inp, getattr(layer, "prefix", "layer"))
        new_parameter(layer, "weight_packed", (out, inp // 2), torch.uint8, weight_loader,
                      output_dim=0, input_dim=1)
        new_parameter(layer, "weight_scale", (out, inp // GROUP), torch.uint8, weight_loader,
                      output_dim=0, input_dim=1)

    def fp4_weight(self, layer: nn.Module) -> Fp4Weight:
        return Fp4Weight("mxfp4", layer.weight_packed, layer.weight_scale)


class Mxfp4MoEMethod(Fp4MoEMethod):
    """The experts in MXFP4.

    layout "compressed-tensors": per-expert tensors `experts.{e}.{gate,up,down}_proj.
    {weight_packed,weight_scale}` into `gate_up_proj_weight_packed` [E, 2I, L/2], ... .
    layout "gpt-oss": the stacked `gate_up_proj_blocks` [E, 2I, L/32, 16] and
    `gate_up_proj_scales` [E, 2I, L/32] (gate/up interleaved in the checkpoint, gate rows then
    up rows here), `down_proj_blocks` [E, L, I/32, 16] and `down_proj_scales` [E, L, I/32].
    `expert_bias`: the checkpoint has `gate_up_proj_bias` / `down_proj_bias`; the experts
    kernel has no bias, so they are loaded and must be zero.
    """

    def __init__(self, layout: str, expert_bias: bool = False) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown MXFP4 layout {layout!r}; one of {LAYOUTS}")
        self.layout = layout
        self.expert_bias = expert_bias

    def _names(self, projection: str) -> tuple[str, str]:
        """The (packed values, scales) parameters of `gate_up` or `down`."""
        if self.layout == "gpt-oss":
            return f"{projection}_proj_blocks", f"{projection}_proj_scales"
        return (expert_param(projection, "weight_packed"),
                expert_param(projection, "weight_scale"))

    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        inter = intermediate_size_per_partition
        shapes = {"gate_up": (2 * inter, hidden_size), "down": (hidden_size, inter)}
        for projection, (out, inp) in shapes.items():
            _check_groups(inp, f"{getattr(layer, 'prefix', 'experts')} {projection}")
            tags = moe_tags(projection, rows=True, columns=True)
            if self.layout == "gpt-oss" and projection == "gate_up":
                tags["interleaved"] = True
            packed, scales = self._names(projection)
            packed_shape = (out, inp // GROUP, GROUP // 2) if self.layout == "gpt-oss" \
                else (out, inp // 2)
            new_parameter(layer, packed, (num_experts, *packed_shape), torch.uint8,
                          weight_loader, **tags)
            new_parameter(layer, scales, (num_experts, out, inp // GROUP), torch.uint8,
                          weight_loader, **tags)
        if self.expert_bias:
            # Biases along the output rows: gate/up's shard with the intermediate features,
            # down's run along the hidden width (loaded whole per expert).
            new_parameter(layer, "gate_up_proj_bias", (num_experts, 2 * inter), torch.float32,
                          weight_loader, moe_projection="gate_up", output_dim=1,
                          interleaved=self.layout == "gpt-oss")
            new_parameter(layer, "down_proj_bias", (num_experts, hidden_size), torch.float32,
                          weight_loader, moe_projection="down")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        if not self.expert_bias:
            return
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            bias = getattr(layer, name)
            if bias.count_nonzero():
                prefix = getattr(layer, "prefix", "") or "experts"
                raise CheckpointError(
                    f"`{prefix}.{name}` has non-zero entries ({int(bias.count_nonzero())} of "
                    f"{bias.numel()} on this rank): muse's experts have no bias, so only an "
                    "all-zero expert bias can be loaded")

    def fp4_weight(self, layer: nn.Module, projection: str) -> Fp4Weight:
        packed, scales = (getattr(layer, name) for name in self._names(projection))
        if self.layout == "gpt-oss":
            packed = packed.flatten(-2)  # [E, out, groups, 16] -> [E, out, in / 2]
        return Fp4Weight("mxfp4", packed, scales)
