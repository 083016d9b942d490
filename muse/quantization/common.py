"""What the quant methods share: the weight-only GEMMs, per-part scalars made per-row scales,
how an expert tensor of a fused MoE is named and split, and the engine's settings for how
quantized layers run (`QuantOptions`)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from muse.kernels.moe_align import PairReduce
from muse.kernels.w4a16 import Fp4Weight, w4a16_linear
from muse.layers.quantization import FusedMoEMethodBase, LinearMethodBase


@dataclass(frozen=True)
class QuantOptions:
    """How a model's quantized layers run (`EngineArgs.quantization_weight_only` and
    `quantization_emulate_activations`).

    weight_only: FP8 linears run W8A16 (dequantize the weight, multiply in the activation
    dtype) even where FP8 tensor cores could run them W8A8.
    emulate_activations: activations are quantized as a W8A8 / W4A4 kernel would quantize
    them, then dequantized and multiplied (a reference of those numerics on hardware without
    the kernel): NVFP4 checkpoints with static activation scales (W4A4), linears and experts;
    FP8 linears where the FP8 GEMM does not run.
    """

    weight_only: bool = False
    emulate_activations: bool = False

    def __post_init__(self) -> None:
        if self.weight_only and self.emulate_activations:
            raise ValueError("quantization_weight_only and quantization_emulate_activations "
                             "exclude each other: choose one")


_OPTIONS: ContextVar[QuantOptions] = ContextVar("muse_quant_options", default=QuantOptions())


@contextmanager
def quant_options(options: QuantOptions) -> Iterator[None]:
    """The options quant methods created inside the block take (the engine builds its model
    inside one); outside any block the defaults hold."""
    token = _OPTIONS.set(options)
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def current_quant_options() -> QuantOptions:
    return _OPTIONS.get()


class WeightOnlyLinearMethod(LinearMethodBase):
    """Activations stay in the model's dtype: the weight is dequantized to it and multiplied,
    the numerics of the dequantized model."""

    @abstractmethod
    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight [out, in] in float32."""

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.dequantized(layer).to(x.dtype), bias)


class WeightOnlyMoEMethod(FusedMoEMethodBase):
    """The experts' weights dequantized to the activations' dtype, then the MoE backend's
    experts kernel, as for unquantized experts."""

    @abstractmethod
    def dequantized(self, layer: nn.Module, projection: str) -> torch.Tensor:
        """`gate_up` [E, 2I, L] or `down` [E, L, I] in float32."""

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, reduce_pairs: PairReduce | None = None) -> torch.Tensor:
        return layer.experts_kernel(x, topk_weights, topk_ids,
                                    self.dequantized(layer, "gate_up").to(x.dtype),
                                    self.dequantized(layer, "down").to(x.dtype),
                                    layer.norm_weight, layer.eps, reduce_pairs=reduce_pairs)


class Fp4LinearMethod(WeightOnlyLinearMethod):
    """A linear layer with FP4 weights (NVFP4, MXFP4), multiplied as stored: the W4A16 GEMM
    reads the packed values and scales (Triton on CUDA, its plain twin elsewhere, which is
    the dequantize-and-multiply of `WeightOnlyLinearMethod`)."""

    @abstractmethod
    def fp4_weight(self, layer: nn.Module) -> Fp4Weight:
        """The layer's loaded weight as the GEMM takes it (views of its parameters)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.fp4 = self.fp4_weight(layer)

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        return self.fp4_weight(layer).dequantize()

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return w4a16_linear(x, layer.fp4, bias)


class Fp4MoEMethod(WeightOnlyMoEMethod):
    """Experts with FP4 weights: the MoE backend's experts kernel reads the packed values and
    scales of `gate_up` and `down` (both backends take an `Fp4Weight` for either)."""

    @abstractmethod
    def fp4_weight(self, layer: nn.Module, projection: str) -> Fp4Weight:
        """`gate_up` [E, 2I, L] (gate rows, then up rows) or `down` [E, L, I]."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.fp4 = {projection: self.fp4_weight(layer, projection)
                     for projection in ("gate_up", "down")}

    def dequantized(self, layer: nn.Module, projection: str) -> torch.Tensor:
        return self.fp4_weight(layer, projection).dequantize()

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, reduce_pairs: PairReduce | None = None) -> torch.Tensor:
        return layer.experts_kernel(x, topk_weights, topk_ids, layer.fp4["gate_up"],
                                    layer.fp4["down"], layer.norm_weight, layer.eps,
                                    reduce_pairs=reduce_pairs)


def row_scales(scale: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Per-part scalars [..., parts] -> the scale of every output row [..., out, 1] (part p's
    scalar on its `sizes[p]` rows)."""
    counts = torch.tensor(sizes, device=scale.device)
    return scale.repeat_interleave(counts, dim=-1)[..., None]


def expert_param(projection: str, leaf: str) -> str:
    """The `FusedMoE` parameter that a checkpoint's `experts.{e}.{gate,up,down}_proj.{leaf}`
    loads into: `gate_up_proj` for the weight, `gate_up_proj_{leaf}` for the rest."""
    return f"{projection}_proj" if leaf == "weight" else f"{projection}_proj_{leaf}"


def moe_tags(projection: str, *, per_part: bool = False, rows: bool = False,
             columns: bool = False) -> dict:
    """How `FusedMoE.weight_loader` splits an expert tensor [E, ...]: one entry per part
    (`per_part`), or along its output rows and / or input columns. TP splits the rows of
    gate/up and the columns of down (the intermediate features); a down tensor without
    columns (per-channel scales) is loaded whole per expert."""
    tags: dict = {"moe_projection": projection}
    if per_part:
        return tags | {"per_shard": True}
    if rows:
        tags["output_dim"] = 1
    if columns:
        tags["input_dim"] = 2
    return tags
