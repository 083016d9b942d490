"""What the quant methods share: the weight-only GEMMs, per-part scalars made per-row scales,
and how an expert tensor of a fused MoE is named and split."""

from __future__ import annotations

from abc import abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from muse.kernels.moe_align import PairReduce
from muse.layers.quantization import FusedMoEMethodBase, LinearMethodBase


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
