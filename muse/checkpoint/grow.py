"""Deeper checkpoints (`muse grow`): decoder layers inserted into a trained Muse model.

Each new layer is a copy of the layer it follows, with the projections that write into the
residual stream set to zero (attention's `o_proj`; the MLP's last projection: the latent
MoE's unpooler, or the experts' `down_proj` without one, and a shared or dense MLP's
`down_proj`). The grown model therefore computes exactly what its source computes, and
training starts from the source's function with the new layers' capacity (block expansion,
as in LLaMA Pro). A zero output projection still gets gradients (its input is the copied
layer's nonzero features), and the rest of the new layer follows once it moves.

Layer `i` of the source keeps its weights under its new index; the encoders, embeddings,
final norm and LM head are copied as they are. A drafter folder is not copied: a drafter
reads chosen layers of its target and must be trained again for the grown model.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from muse.checkpoint.average import AVERAGE_RECORD
from muse.checkpoint.configs import model_type_of, read_config_json
from muse.checkpoint.layout import CONFIG_FILE, GENERATION_CONFIG_FILE
from muse.checkpoint.reader import CheckpointReader
from muse.checkpoint.writer import (
    TensorSpec,
    check_destination,
    copy_other_files,
    write_generation_config,
    write_tensors,
)
from muse.config import LAYER_TYPES, MODEL_TYPE, MuseSparkConfig, with_overrides

GROW_RECORD = "grow.json"
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Files of the source that describe the source alone (its weights' history, its drafter).
NOT_COPIED = ("drafter", GROW_RECORD, AVERAGE_RECORD, CONFIG_FILE)


@dataclasses.dataclass(frozen=True)
class GrowPlan:
    """Where every layer of the grown model comes from: `sources[j]` is the source layer
    that layer `j` holds (or copies, when `new[j]`), `layer_types[j]` its kind."""

    sources: tuple[int, ...]
    new: tuple[bool, ...]
    layer_types: tuple[str, ...]


def plan_growth(layer_types: Sequence[str], insert_after: Sequence[int],
                new_types: Sequence[str] | None = None) -> GrowPlan:
    """The grown layer stack: after each source layer named in `insert_after` (repeats insert
    several), one new layer of the kind in `new_types` (default: the copied layer's)."""
    count = len(layer_types)
    if not insert_after:
        raise ValueError("--insert-after names no layer: nothing to grow")
    for index in insert_after:
        if not 0 <= index < count:
            raise ValueError(f"--insert-after {index}: the model has layers 0-{count - 1}")
    if new_types is None:
        new_types = [layer_types[index] for index in insert_after]
    if len(new_types) != len(insert_after):
        raise ValueError(f"--layer-types gives {len(new_types)} kinds for "
                         f"{len(insert_after)} new layers")
    for kind in new_types:
        if kind not in LAYER_TYPES:
            raise ValueError(f"--layer-types: {kind!r} is not one of {LAYER_TYPES}")
    kinds_after: dict[int, list[str]] = {}
    for index, kind in zip(insert_after, new_types):
        kinds_after.setdefault(index, []).append(kind)
    rows = []  # (source layer, new, kind) of each layer of the grown model
    for index, kind in enumerate(layer_types):
        rows.append((index, False, kind))
        rows.extend((index, True, added) for added in kinds_after.get(index, []))
    sources, new, kinds = zip(*rows)
    return GrowPlan(sources, new, kinds)


def writes_residual(suffix: str, has_unpooler: bool) -> bool:
    """Whether the layer tensor named `suffix` (after `model.layers.N.`) is a projection whose
    output is added to the residual stream."""
    if suffix.startswith("self_attn.o_proj."):
        return True
    if suffix in ("mlp.down_proj.weight", "mlp.shared_expert.down_proj.weight",
                  "mlp.unpooler.weight"):
        return True
    return suffix == "mlp.experts.down_proj" and not has_unpooler


def grow_checkpoint(source: str | Path, destination: str | Path, insert_after: Sequence[int],
                    new_types: Sequence[str] | None = None) -> GrowPlan:
    """Write `source` with new decoder layers (see the module's docstring) to `destination`,
    another folder; returns the plan it followed."""
    source, destination = Path(source), Path(destination)
    check_destination(destination, [source], "the grown checkpoint")
    data = read_config_json(source)
    if model_type_of(data) != MODEL_TYPE:
        raise ValueError(f"muse grow takes Muse checkpoints; {source} is a "
                         f"{model_type_of(data)!r} checkpoint")
    config = MuseSparkConfig.from_dict(data)
    text = config.text_config
    plan = plan_growth(text.layer_types, insert_after, new_types)
    with CheckpointReader(source) as reader:
        by_layer: dict[int, list[str]] = {}
        specs, origin = [], {}
        for name in reader.names():
            match = LAYER_NAME.match(name)
            if match is None:
                specs.append(TensorSpec(name, reader.shape(name), reader.dtype(name)))
                origin[name] = (name, "keep")
            else:
                by_layer.setdefault(int(match.group(1)), []).append(match.group(2))
        missing = [index for index in range(text.num_hidden_layers) if index not in by_layer]
        if missing:
            raise ValueError(f"{source} holds no tensors of decoder layers {missing}")
        for target, (index, is_new) in enumerate(zip(plan.sources, plan.new)):
            suffixes = by_layer[index]
            has_unpooler = "mlp.unpooler.weight" in suffixes
            for suffix in suffixes:
                old, name = f"model.layers.{index}.{suffix}", f"model.layers.{target}.{suffix}"
                specs.append(TensorSpec(name, reader.shape(old), reader.dtype(old)))
                zero = is_new and writes_residual(suffix, has_unpooler)
                origin[name] = (old, "zero" if zero else "copy" if is_new else "keep")

        def produce(spec: TensorSpec) -> torch.Tensor:
            old, how = origin[spec.name]
            tensor = reader.get(old)
            if how == "zero":
                return torch.zeros_like(tensor)
            # A copy is its own tensor: safetensors refuses two names on one storage.
            return tensor.clone() if how == "copy" else tensor

        write_tensors(destination, specs, produce)
    grown = with_overrides(config, {"num_hidden_layers": len(plan.sources),
                                    "layer_types": list(plan.layer_types)})
    grown.save(destination)
    copy_other_files(source, destination, skip=NOT_COPIED)
    if not (destination / GENERATION_CONFIG_FILE).is_file():
        write_generation_config(grown.text_config, destination)
    record = {"source": str(source), "insert_after": sorted(insert_after),
              "layers": [{"source_layer": index, "new": is_new, "layer_type": kind}
                         for index, is_new, kind in zip(plan.sources, plan.new,
                                                        plan.layer_types)]}
    (destination / GROW_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return plan
