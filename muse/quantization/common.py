"""What the quant methods share: per-part scalars made per-row scales, and how an expert
tensor of a fused MoE is named and split."""

from __future__ import annotations

import torch


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
