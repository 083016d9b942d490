"""FP8 E4M3 weights: one scale per tensor, per output channel, or per block of the weight.

The stored weight is float8_e4m3fn `[out, in]` and dequantizes as `w = fp8 * scale`, the
scale a float32 multiplier of the shape its strategy gives:

| strategy | scale shape | written by |
|---|---|---|
| `tensor` | `[]` or `[1]` (`weight_scale`) | compressed-tensors, ModelOpt `FP8` |
| `channel` | `[out, 1]` (`weight_scale`) | compressed-tensors |
| `block` | `[ceil(out / bo), ceil(in / bi)]` (`weight_scale`, or DeepSeek's `weight_scale_inv`, a multiplier despite its name) | compressed-tensors, HF `fp8` |

A fused q/k/v or gate/up layer keeps each part's per-tensor scale (one entry per part), so no
part is requantized.

How a linear runs is decided once, in `process_weights_after_loading`, from the device, the
shapes and `QuantOptions` (`layer.fp8_path`):

- `fp8-gemm` (W8A8 on FP8 tensor cores, `muse.kernels.fp8_gemm`): CUDA with compute
  capability >= 8.9 whose probe passed, the default there. Activations are quantized per
  token (dynamic), or with the checkpoint's static `input_scale` (a fused layer's parts: the
  largest, so no part's calibrated range is clipped). Needs out and in features multiples
  of 16. 128 x 128 blocks would quantize activations per token and 128 features (DeepSeek's
  recipe) for torch's block-scaled `_scaled_mm`, but cuBLAS refuses some row counts with
  them on the H200 (torch 2.11), so block-scaled weights run W8A16 for now.
- `w8a8-emulated`: the same activation quantization in plain PyTorch (`fp8_linear_torch`),
  where the FP8 GEMM does not run and `emulate_activations` asks for it.
- `w8a16` (weight-only; the default on CPU and wherever the FP8 GEMM does not run, and
  everywhere with `weight_only`): the weight is dequantized to the activation dtype and
  multiplied, the exact numerics of the dequantized model.

The experts of a fused MoE run weight-only (W8A16) on every device: the experts kernel takes
one activation dtype for all experts, and a grouped FP8 GEMM is not written yet. They are
handed to the MoE backend's experts kernel as they are stored (`muse.kernels.w8a16.Fp8Weight`:
one scale per row for per-tensor and per-channel experts, the block grid for block-scaled
ones), which scales each FP8 weight tile into the activation dtype inside its GEMMs.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from muse.kernels.fp8_gemm import (fp8_linear_scaled_mm, fp8_linear_torch, scaled_mm_shapes_ok,
                                   scaled_mm_supported)
from muse.kernels.moe_align import PairReduce
from muse.kernels.w8a16 import Fp8Weight
from muse.layers.quantization import WeightLoader, new_parameter
from muse.quantization.common import (QuantOptions, WeightOnlyLinearMethod, WeightOnlyMoEMethod,
                                      current_quant_options, expert_param, moe_tags, row_scales)

logger = logging.getLogger("muse")

STRATEGIES = ("tensor", "channel", "block")
# How an FP8 linear runs (`layer.fp8_path`), see the module docstring.
FP8_GEMM, W8A8_EMULATED, W8A16 = "fp8-gemm", "w8a8-emulated", "w8a16"


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


def choose_path(scheme: Fp8Scheme, options: QuantOptions, device: torch.device,
                out_features: int, in_features: int) -> str:
    """How an FP8 linear with this scheme and shape runs on `device` (see the module
    docstring)."""
    if options.weight_only:
        return W8A16
    block = scheme.block
    if block is not None and scheme.static_input_scale:
        return W8A16  # block scales with static activations: no kernel or recipe takes them
    if scaled_mm_shapes_ok(out_features, in_features, block) \
            and scaled_mm_supported(device, block):
        return FP8_GEMM
    if options.emulate_activations and (block is None or in_features % block[1] == 0):
        return W8A8_EMULATED
    return W8A16


_LOGGED: set[tuple[str, str]] = set()


class Fp8LinearMethod(WeightOnlyLinearMethod):
    """An FP8 linear: W8A8 on FP8 tensor cores, emulated W8A8, or W8A16 (`layer.fp8_path`,
    chosen after loading). `options` default to the engine's (`current_quant_options()`)."""

    def __init__(self, scheme: Fp8Scheme, options: QuantOptions | None = None) -> None:
        self.scheme = scheme
        self.options = options if options is not None else current_quant_options()

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
        out_features, in_features = layer.weight.shape
        path = choose_path(self.scheme, self.options, layer.weight.device, out_features,
                           in_features)
        layer.fp8_path = path
        if path == W8A16:
            return
        # The GEMM's operands: rowwise scales [out] or the block grid, float32 contiguous.
        gemm_scale = scale.data.reshape(-1) if self.scheme.block is None else scale.data
        layer.register_buffer("gemm_weight_scale", gemm_scale.float().contiguous(),
                              persistent=False)
        input_scale = layer.input_scale.data.float().max().reshape(1) \
            if self.scheme.static_input_scale else None
        layer.register_buffer("gemm_input_scale", input_scale, persistent=False)
        if (path, repr(self.scheme)) not in _LOGGED:
            _LOGGED.add((path, repr(self.scheme)))
            logger.info("FP8 linears (%s) run %s on %s", self.scheme, path,
                        layer.weight.device)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        path = getattr(layer, "fp8_path", W8A16)
        if path == W8A16:
            return super().apply(layer, x, bias)
        gemm = fp8_linear_scaled_mm if path == FP8_GEMM else fp8_linear_torch
        return gemm(x, layer.weight, layer.gemm_weight_scale, layer.gemm_input_scale, bias,
                    self.scheme.block)

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        return dequantize(layer.weight, layer.dequant_scale, self.scheme)


class Fp8MoEMethod(WeightOnlyMoEMethod):
    """The experts' gate/up and down projections in FP8, with the per-expert scales of the
    checkpoint's `experts.{e}.{gate,up,down}_proj.weight_scale` (per-tensor: one per part).
    Weight-only (W8A16) on every device: the experts as stored, read by the experts kernel
    (`layer.fp8`, built once after loading). Static `input_scale`s are loaded and kept."""

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

    def fp8_weight(self, layer: nn.Module, projection: str) -> Fp8Weight:
        """`gate_up` [E, 2I, L] (gate rows, then up rows) or `down` [E, L, I] with its scales:
        per row (a per-tensor scheme's expanded) or its block grid."""
        weight = getattr(layer, expert_param(projection, "weight"))
        scale = getattr(layer, expert_param(projection, self.scheme.scale_name))
        if self.scheme.strategy == "tensor":
            # One scalar per part and expert: rows of the gate half, then of the up half.
            parts = scale.shape[1]
            scale = row_scales(scale, [weight.shape[1] // parts] * parts)
        block = self.scheme.block if self.scheme.strategy == "block" else None
        return Fp8Weight(weight, scale, tuple(block) if block is not None else None)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # Built once, so that a forward runs no torch op on the weights (capturable).
        layer.fp8 = {projection: self.fp8_weight(layer, projection)
                     for projection in ("gate_up", "down")}

    def dequantized(self, layer: nn.Module, projection: str) -> torch.Tensor:
        return self.fp8_weight(layer, projection).dequantize()

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, reduce_pairs: PairReduce | None = None) -> torch.Tensor:
        return layer.experts_kernel(x, topk_weights, topk_ids, layer.fp8["gate_up"],
                                    layer.fp8["down"], layer.norm_weight, layer.eps,
                                    reduce_pairs=reduce_pairs)
