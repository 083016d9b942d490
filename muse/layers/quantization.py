"""Quant methods: what a linear or MoE layer's parameters are and how its GEMM runs.

A layer decides its shard's logical shape (which features this rank holds); its quant method
decides how those features are stored and multiplied. Three calls, in this order:

1. `create_weights(layer, ...)` registers the parameters at the shard's storage shape and tags
   each with attributes the layer's `weight_loader` reads (see below). An FP4 method registers
   a packed uint8 weight `[out, in/2]`, block scales `[out, in/16]` and a global scale per
   fused shard; the unquantized methods one plain weight.
2. `process_weights_after_loading(layer)`, once every checkpoint tensor is in: a chance to
   repack, swizzle scales, or merge the per-shard global scales of a fused q/k/v or gate/up
   (take the max and rescale the block scales of the others).
3. `apply(layer, x, ...)`, every forward: the GEMM (linear) or the fused experts (MoE).

Parameter attributes the weight loaders understand (set with `set_weight_attrs`):

- `weight_loader(param, loaded, shard_id=None[, expert_id])`: reads this rank's part of a
  checkpoint tensor into the parameter (the layer's method, unless the quant method
  substitutes its own, e.g. for a layout that needs unpacking).
- `output_dim` / `input_dim`: the dimension that runs along the layer's output / input
  features, or absent. Storage may pack or block those features (2 FP4 values per byte, one
  scale per 16): loaders find the stored offset of a feature range by scaling it with the
  parameter's size along that dimension, so any packing that does not split a shard works.
- `per_shard`: the tensor holds one entry per fused shard (q/k/v, gate/up) along its first
  dimension (after the expert dimension for MoE); each shard's checkpoint scalar lands in its
  entry, and it is never split over ranks.
- `moe_projection` (MoE only): "gate_up" (the intermediate features are `output_dim`, gate
  half first) or "down" (they are `input_dim`); untagged MoE parameters (the expert norms)
  are only split by expert.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from muse.kernels.dense_linear import dense_linear
from muse.kernels.moe_align import PairReduce

WeightLoader = Callable[..., None]

# A projection's tensors in a checkpoint, quantized or not: the weight (packed FP4 in
# compressed-tensors' `weight_packed`), and the scales that quantized layouts add next to it
# (`weight_scale_inv`: DeepSeek's block FP8, a multiplier; the per-tensor scales of NVFP4).
QUANTIZED_LEAVES = ("weight", "weight_packed", "weight_scale", "weight_scale_inv",
                    "weight_scale_2", "weight_global_scale", "input_scale", "input_global_scale")


def set_weight_attrs(param: torch.Tensor, **attrs: Any) -> None:
    """Tag a parameter for the weight loaders; a tag set twice is a bug, so it raises."""
    for key, value in attrs.items():
        if hasattr(param, key):
            raise ValueError(f"parameter attribute `{key}` is already set")
        setattr(param, key, value)


def new_parameter(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                  weight_loader: WeightLoader, **attrs: Any) -> nn.Parameter:
    """Register an uninitialised, frozen parameter (inference only) with its loader tags."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(param, weight_loader=weight_loader, **attrs)
    layer.register_parameter(name, param)
    return param


class LinearMethodBase(ABC):
    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: WeightLoader) -> None:
        """Register the parameters of this rank's shard on `layer`.

        output_partition_sizes: this rank's width of each fused output shard (one entry for
        a plain layer; q, k, v or gate, up for fused ones), so per-shard scales can be sized.
        input_size / output_size: the unsharded widths (for methods whose scales need them).
        """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after loading; the default keeps the weights as loaded."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., input_size_per_partition] -> [..., sum(output_partition_sizes)]."""


class FusedMoEMethodBase(ABC):
    @abstractmethod
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        """Register `num_experts` (this rank's) experts at hidden width `hidden_size` (the
        latent width of a latent MoE) and this rank's share of the intermediate width."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after loading; the default keeps the weights as loaded."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, reduce_pairs: PairReduce | None = None) -> torch.Tensor:
        """x [T, hidden], topk_weights [T, k] float32, topk_ids [T, k] (local expert ids)
        -> [T, hidden]; `reduce_pairs` as in `muse.kernels.moe.fused_experts`."""


QuantMethod = LinearMethodBase | FusedMoEMethodBase


class QuantizationConfig(ABC):
    """A checkpoint's quantization (read from its config), handing each layer its method."""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        """The method for `layer` (named `prefix` in the checkpoint); None leaves it
        unquantized (modules the checkpoint excludes from quantization)."""


class UnquantizedLinearMethod(LinearMethodBase):
    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader: WeightLoader) -> None:
        new_parameter(layer, "weight", (sum(output_partition_sizes), input_size_per_partition),
                      params_dtype, weight_loader, output_dim=0, input_dim=1)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return dense_linear(x, layer.weight, bias)


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    def create_weights(self, layer: nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       weight_loader: WeightLoader) -> None:
        inter = intermediate_size_per_partition
        # The layout `fused_experts` reads and the checkpoint stores: gate rows, then up rows.
        new_parameter(layer, "gate_up_proj", (num_experts, 2 * inter, hidden_size),
                      params_dtype, weight_loader, output_dim=1, input_dim=2,
                      moe_projection="gate_up")
        new_parameter(layer, "down_proj", (num_experts, hidden_size, inter), params_dtype,
                      weight_loader, output_dim=1, input_dim=2, moe_projection="down")

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, reduce_pairs: PairReduce | None = None) -> torch.Tensor:
        return layer.experts_kernel(x, topk_weights, topk_ids, layer.gate_up_proj,
                                    layer.down_proj, layer.norm_weight, layer.eps,
                                    reduce_pairs=reduce_pairs)


def linear_method(quant_config: QuantizationConfig | None, layer: nn.Module,
                  prefix: str) -> LinearMethodBase:
    return _method(quant_config, layer, prefix, LinearMethodBase, UnquantizedLinearMethod)


def moe_method(quant_config: QuantizationConfig | None, layer: nn.Module,
               prefix: str) -> FusedMoEMethodBase:
    return _method(quant_config, layer, prefix, FusedMoEMethodBase, UnquantizedFusedMoEMethod)


def _method(quant_config: QuantizationConfig | None, layer: nn.Module, prefix: str,
            base: type, unquantized: type) -> Any:
    """The config's method for `layer`, checked to be a `base`; unquantized when none."""
    method = quant_config.get_quant_method(layer, prefix) if quant_config is not None else None
    if method is None:
        return unquantized()
    if not isinstance(method, base):
        raise TypeError(f"{type(quant_config).__name__} gave {type(method).__name__} for "
                        f"`{prefix}`; it must be a {base.__name__}")
    return method


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer's quant method finish its weights; the loader calls this once, last."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
