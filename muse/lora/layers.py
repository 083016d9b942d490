"""Adapter slots beside the engine's layers: every loaded adapter's factors, stacked by slot,
applied per token in one batched call (punica-style: `muse.kernels.lora`).

A step may mix requests of several adapters and of the base model. The runner gives each
token its request's slot (-1: the base model) in `LoRAContext.indices`; every adapted layer
adds its delta for those tokens, so one forward serves them all.

Fused layers (q/k/v, gate/up) hold one rank range per checkpoint part: part p's A rows sit at
rank offset p * R and its B at output rows of that part, block-diagonal, so one shrink and one
expand serve all parts (parts an adapter leaves out stay zero). A weight for the whole fused
parameter (PEFT's stacked `gate_up_proj` of experts) may use the full rank width.
Scales are folded into B when an adapter is written into its slot.
"""

from __future__ import annotations

import torch
from torch import nn

from muse.kernels.lora import lora_expand, lora_shrink
from muse.lora.peft_adapter import LoRAWeights


class LoRAContext:
    """The step's adapter slot of each token ([tokens] int32 on the device, -1 = base), shared by
    every adapted layer of a model; None when no token of the step uses an adapter.

    `experts_adapted`: some resident adapter adapts routed experts. Their deltas run in the
    plain experts path, which asks the host for expert counts, so such steps run eagerly;
    otherwise the fused experts kernel runs and steps with adapters replay CUDA graphs."""

    def __init__(self) -> None:
        self.indices: torch.Tensor | None = None
        self.experts_adapted = False


def _write(a: torch.Tensor, b: torch.Tensor, weights_a: torch.Tensor, weights_b: torch.Tensor,
           rank_offset: int, row_offset: int, scaling: float, what: str) -> None:
    """One adapter's factors into one slot's [R_total, in] / [out, R_total] views."""
    rank = weights_a.shape[-2]
    if rank_offset + rank > a.shape[-2]:
        raise ValueError(f"{what}: rank {rank} exceeds the slot's {a.shape[-2] - rank_offset} "
                         f"(raise --max-lora-rank)")
    if weights_a.shape[-1] != a.shape[-1]:
        raise ValueError(f"{what}: lora_A has {weights_a.shape[-1]} input features; the layer "
                         f"has {a.shape[-1]}")
    rows = weights_b.shape[-2]
    if row_offset + rows > b.shape[-2]:
        raise ValueError(f"{what}: lora_B has {rows} output features; the layer part has "
                         f"{b.shape[-2] - row_offset}")
    a[..., rank_offset:rank_offset + rank, :] = weights_a.to(a.dtype)
    b[..., row_offset:row_offset + rows, rank_offset:rank_offset + rank] = \
        (weights_b * scaling).to(b.dtype)


class LinearLoRA(nn.Module):
    """The slots of one linear layer: a [S, P * R, in], b [S, out, P * R]."""

    def __init__(self, context: LoRAContext, num_slots: int, max_rank: int, in_features: int,
                 part_rows: list[tuple[int, int]], dtype: torch.dtype,
                 device: torch.device) -> None:
        """part_rows: each checkpoint part's (first output row, rows) in the layer's output."""
        super().__init__()
        self.context = context
        self.max_rank = max_rank
        self.part_rows = part_rows
        width = len(part_rows) * max_rank
        out_features = sum(rows for _, rows in part_rows)
        self.register_buffer("a", torch.zeros(num_slots, width, in_features, dtype=dtype,
                                              device=device), persistent=False)
        self.register_buffer("b", torch.zeros(num_slots, out_features, width, dtype=dtype,
                                              device=device), persistent=False)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def write(self, slot: int, part: int | None, weights: LoRAWeights, what: str) -> None:
        """part None: the weight spans every part (the whole output, the full rank width)."""
        if weights.a.dim() != 2:
            raise ValueError(f"{what}: per-expert factors for a linear layer")
        row, rank_offset = (0, 0) if part is None else \
            (self.part_rows[part][0], part * self.max_rank)
        _write(self.a[slot], self.b[slot], weights.a, weights.b, rank_offset, row,
               weights.scaling, what)

    def add(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out + this step's deltas for the tokens that use an adapter."""
        indices = self.context.indices
        if indices is None:
            return out
        shape = out.shape
        out2d, x2d = out.reshape(-1, shape[-1]), x.reshape(-1, x.shape[-1])
        lora_expand(out2d, lora_shrink(x2d, self.a, indices), self.b, indices)
        return out2d.view(shape)


class ExpertsLoRA(nn.Module):
    """The slots of a stacked-experts layer, per projection and expert:
    gate_up a [E, S, 2R, L], b [E, S, 2I, 2R] (gate rows, then up rows);
    down a [E, S, R, I], b [E, S, L, R]."""

    PROJECTIONS = {"gate_up": 2, "down": 1}  # checkpoint parts of each

    def __init__(self, context: LoRAContext, num_slots: int, max_rank: int, num_experts: int,
                 hidden: int, intermediate: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.context = context
        self.max_rank = max_rank
        self.intermediate = intermediate
        shapes = {"gate_up": (hidden, 2 * intermediate), "down": (intermediate, hidden)}
        for projection, (inputs, outputs) in shapes.items():
            width = self.PROJECTIONS[projection] * max_rank
            self.register_buffer(f"{projection}_a", torch.zeros(
                num_experts, num_slots, width, inputs, dtype=dtype, device=device),
                persistent=False)
            self.register_buffer(f"{projection}_b", torch.zeros(
                num_experts, num_slots, outputs, width, dtype=dtype, device=device),
                persistent=False)

    def clear(self, slot: int) -> None:
        for projection in self.PROJECTIONS:
            getattr(self, f"{projection}_a")[:, slot].zero_()
            getattr(self, f"{projection}_b")[:, slot].zero_()

    def write(self, slot: int, projection: str, part: int | None, expert: int | None,
              weights: LoRAWeights, what: str) -> None:
        """expert None: `weights` holds every expert ([E, r, in] / [E, out, r]); part None: the
        weight spans the projection's parts (a stacked gate_up)."""
        a, b = getattr(self, f"{projection}_a"), getattr(self, f"{projection}_b")
        a, b = (a[:, slot], b[:, slot]) if expert is None else (a[expert, slot], b[expert, slot])
        if (weights.a.dim() == 3) != (expert is None):
            raise ValueError(f"{what}: per-expert factors do not match the target")
        row, rank_offset = (0, 0) if part is None else \
            (part * self.intermediate, part * self.max_rank)
        _write(a, b, weights.a, weights.b, rank_offset, row, weights.scaling, what)

    def active(self) -> bool:
        return self.context.indices is not None and self.context.experts_adapted

    def hook(self, out: torch.Tensor, rows: torch.Tensor, pairs: torch.Tensor, top_k: int,
             expert: int, projection: str) -> None:
        """Adds, in place, the deltas of `expert`'s `projection` to `out` (float32 rows of
        the pairs `pairs`, whose inputs are `rows`): the hook of `fused_experts_torch`."""
        indices = self.context.indices
        assert indices is not None
        pair_indices = indices[pairs // top_k]
        a, b = getattr(self, f"{projection}_a")[expert], getattr(self, f"{projection}_b")[expert]
        lora_expand(out, lora_shrink(rows, a, pair_indices), b, pair_indices)
