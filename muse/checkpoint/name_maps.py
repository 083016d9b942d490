"""How checkpoint tensors become model tensors, one map per `config.json` `model_type`.

A name map turns the checkpoint's tensor names into a `LoadPlan`: for every model tensor name,
a source that says which checkpoint tensors it is read from and what shape it will have. Plans
are built from shard headers only; tensors are read when the loader asks a source for them, so
per-expert tensors are stacked one layer at a time and the checkpoint is never held twice.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from muse.checkpoint.reader import CheckpointReader
from muse.config import MODEL_TYPE, ConfigError


@dataclass(frozen=True)
class DirectSource:
    """A model tensor stored under its own name."""

    name: str
    shape: tuple[int, ...]

    @property
    def parts(self) -> tuple[str, ...]:
        return (self.name,)

    def read(self, reader: CheckpointReader, dtype: torch.dtype | None) -> torch.Tensor:
        # Always a copy: the reader's tensor lives in the file mapping, which is only 8-byte
        # aligned, and CPU kernels round differently on unaligned data.
        tensor = reader.get(self.name)
        return tensor.to(dtype or tensor.dtype, copy=True)


@dataclass(frozen=True)
class StackedExperts:
    """A fused expert tensor [experts, rows, columns] stored as one matrix per expert.

    `experts[e]` lists expert e's matrices; they are concatenated along rows (gate then up for
    `gate_up_proj`), then experts are stacked.
    """

    experts: tuple[tuple[str, ...], ...]
    shape: tuple[int, ...]

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(name for names in self.experts for name in names)

    def read(self, reader: CheckpointReader, dtype: torch.dtype | None) -> torch.Tensor:
        out: torch.Tensor | None = None
        for expert, names in enumerate(self.experts):
            row = 0
            for name in names:
                piece = reader.get(name)
                if out is None:
                    out = torch.empty(self.shape, dtype=dtype or piece.dtype)
                out[expert, row:row + piece.shape[0]] = piece
                row += piece.shape[0]
        assert out is not None, "a stacked source always has at least one expert"
        return out


TensorSource = DirectSource | StackedExperts


@dataclass
class LoadPlan:
    """Model tensor name -> source, plus problems found while grouping checkpoint tensors."""

    sources: dict[str, TensorSource] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    mis_shaped: list[str] = field(default_factory=list)


NameMap = Callable[[CheckpointReader], LoadPlan]


def same_names(reader: CheckpointReader) -> LoadPlan:
    """Every checkpoint tensor is the model tensor of the same name."""
    return LoadPlan({name: DirectSource(name, reader.shape(name)) for name in reader.names()})


_PER_EXPERT = re.compile(
    r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<projection>gate|up|down)_proj\.weight$")


def stack_per_expert(reader: CheckpointReader) -> LoadPlan:
    """Like `same_names`, but `...experts.{e}.{gate,up,down}_proj.weight` ([out, in] each) are
    stacked into `...experts.gate_up_proj` [E, 2*I, in] (gate rows first) and `down_proj`.

    This is how Hugging Face writes Qwen3-MoE experts, while its modules (and Muse's) hold
    them fused. Checkpoints that already store the fused tensors pass through unchanged.
    """
    plan = LoadPlan()
    layers: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for name in reader.names():
        match = _PER_EXPERT.match(name)
        if match:
            layers[match["prefix"]][int(match["expert"])][match["projection"]] = name
        else:
            plan.sources[name] = DirectSource(name, reader.shape(name))
    for prefix, experts in layers.items():
        count = max(experts) + 1
        names = {(expert, projection): f"{prefix}.{expert}.{projection}_proj.weight"
                 for expert in range(count) for projection in ("gate", "up", "down")}
        absent = [name for name in names.values() if name not in reader]
        if absent:
            plan.missing.extend(absent)
            continue
        gate_up = tuple((names[e, "gate"], names[e, "up"]) for e in range(count))
        down = tuple((names[e, "down"],) for e in range(count))
        gate_shape = _common_shape(reader, [n for pair in gate_up for n in pair], plan)
        down_shape = _common_shape(reader, [n for (n,) in down], plan)
        if gate_shape is not None:
            rows, columns = gate_shape
            plan.sources[f"{prefix}.gate_up_proj"] = StackedExperts(
                gate_up, (count, 2 * rows, columns))
        if down_shape is not None:
            plan.sources[f"{prefix}.down_proj"] = StackedExperts(down, (count, *down_shape))
    return plan


def _common_shape(reader: CheckpointReader, names: list[str],
                  plan: LoadPlan) -> tuple[int, ...] | None:
    """The shape all `names` share (they are stacked), or None after recording the odd ones."""
    first = reader.shape(names[0])
    odd = [f"`{name}` has shape {reader.shape(name)} but `{names[0]}` has {first}"
           for name in names[1:] if reader.shape(name) != first]
    if len(first) != 2:
        odd.insert(0, f"`{names[0]}` has shape {first} but an expert matrix must be 2-d")
    plan.mis_shaped.extend(odd)
    return None if odd else first


NAME_MAPS: dict[str, NameMap] = {
    MODEL_TYPE: same_names,
    "qwen3": same_names,
    "qwen3_moe": stack_per_expert,
}


def name_map_for(model_type: str) -> NameMap:
    if model_type not in NAME_MAPS:
        raise ConfigError(f"config.json field `model_type` must be one of {sorted(NAME_MAPS)}, "
                          f"got {model_type!r}")
    return NAME_MAPS[model_type]
