"""Filling the engine model: checkpoint tensors streamed one at a time into their parameters.

Each checkpoint name is routed to the parameter that holds it (fused projections take their
part by `shard_id`, per-expert tensors by `expert_id`) and handed to that parameter's
`weight_loader` as a lazy safetensors slice, so a rank reads only its own part and the host
holds about one tensor at a time, never the model. The same routing fills a model from
named tensors in memory (a preset's seeded random weights).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from muse.checkpoint.layout import CheckpointError, format_names, is_encoder_tensor
from muse.checkpoint.reader import CheckpointReader
from muse.layers.fused_moe import per_expert_target
from muse.layers.lazy_slice import LazySlice
from muse.layers.quantization import QUANTIZED_LEAVES, process_weights_after_loading

# Checkpoint projection -> (fused engine parameter, its part), as the layers name them.
FUSED_PARTS = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
               "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
               "up_proj": ("gate_up_proj", 1)}
_PROJECTION = re.compile(r"^(?P<owner>.+)\.(?P<projection>[a-z_]+)\.(?P<leaf>"
                         + "|".join(("bias",) + QUANTIZED_LEAVES) + ")$")
_EXPERT = re.compile(r"^(?P<owner>.+\.experts)\.(?P<rest>\d+\..+)$")
# FP8 KV-cache scales: on the attention module (compressed-tensors, vLLM) or on the k / v
# projection (ModelOpt). A query scale is accepted and unused: queries stay in the model's
# dtype.
_KV_SCALE = re.compile(r"^(?P<attention>.+\.self_attn)\.(?:(?P<leaf>[kv]_scale)|"
                       r"k_proj\.(?P<k>k_scale)|v_proj\.(?P<v>v_scale)|(?:q_proj\.)?q_scale)$")


def route(name: str) -> tuple[str, dict[str, Any]]:
    """A checkpoint tensor name -> (engine parameter name, weight_loader keyword arguments)."""
    expert = _EXPERT.match(name)
    if expert is not None:
        target = per_expert_target(expert["rest"])
        if target is not None:
            param_name, expert_id, shard_id = target
            return f"{expert['owner']}.{param_name}", {"shard_id": shard_id,
                                                       "expert_id": expert_id}
    projection = _PROJECTION.match(name)
    if projection is not None and projection["projection"] in FUSED_PARTS \
            and ".experts." not in name:
        fused, part = FUSED_PARTS[projection["projection"]]
        return f"{projection['owner']}.{fused}.{projection['leaf']}", {"shard_id": part}
    return name, {}


def default_weight_loader(param: nn.Parameter, loaded: Any, **_: Any) -> None:
    tensor = loaded[:] if not isinstance(loaded, torch.Tensor) else loaded
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"shape {tuple(tensor.shape)} where the parameter has "
                         f"{tuple(param.shape)}")
    param.data.copy_(tensor)


@torch.no_grad()
def load_named_tensors(model: nn.Module, tensors: Iterable[tuple[str, Any]],
                       where: str) -> None:
    """Route each (name, tensor or lazy slice) into the model; every parameter must be filled.

    where: what the tensors come from, for error messages.
    """
    params = dict(model.named_parameters())
    filled: set[str] = set()
    unexpected: list[str] = []
    for name, loaded in tensors:
        if is_encoder_tensor(name):
            continue  # the media encoders' (loaded beside the decoder), not this model's
        held = getattr(model, "checkpoint_target", lambda n: n)(name)
        if held is None:
            continue  # another pipeline stage's tensor
        if _load_kv_scale(model, name, held, loaded, where):
            continue
        target, arguments = route(held)
        param = params.get(target)
        if param is None:
            if target not in params and _is_tied_head(model, target):
                continue  # the LM head shares the embedding's table
            unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, loaded, **arguments)
        except ValueError as error:
            raise CheckpointError(f"{where}: cannot load `{name}` into `{target}`: "
                                  f"{error}") from None
        filled.add(target)
    missing = [name for name in params if name not in filled]
    problems = []
    if missing:
        problems.append(f"{len(missing)} parameter(s) the model needs are missing: "
                        f"{format_names(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) the model has no place for: "
                        f"{format_names(unexpected)}")
    if problems:
        raise CheckpointError(f"{where} does not fit the model: " + "; ".join(problems))
    process_weights_after_loading(model)


def _load_kv_scale(model: nn.Module, name: str, held: str, loaded: Any, where: str) -> bool:
    """Load checkpoint tensor `name` (`held` on this rank) into its attention layer if it is
    a KV-cache scale the model has a place for; whether it was."""
    match = _KV_SCALE.match(held)
    if match is None:
        return False
    try:
        attention = model.get_submodule(match["attention"])
    except AttributeError:
        return False
    if not hasattr(attention, "load_kv_scale"):
        return False
    leaf = match["leaf"] or match["k"] or match["v"]
    if leaf is not None:
        try:
            attention.load_kv_scale(leaf, LazySlice.of(loaded).read())
        except ValueError as error:
            raise CheckpointError(f"{where}: cannot load `{name}`: {error}") from None
    return True


def _is_tied_head(model: nn.Module, name: str) -> bool:
    return name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)


def load_checkpoint(model: nn.Module, directory: str | Path) -> None:
    """Stream a checkpoint folder (one file or shards, safetensors) into `model`.

    Slices are views of the memory-mapped shards, so reading allocates nothing beyond the
    parameters; the pages of a shard that were read stay mapped until it is released, so the
    shards are loaded one after the other and each is released when its tensors are in.
    """
    with CheckpointReader(directory) as reader:
        load_named_tensors(model, _slices_shard_by_shard(reader), f"checkpoint {directory}")


def _slices_shard_by_shard(reader: CheckpointReader) -> Iterator[tuple[str, Any]]:
    names_of: dict[str, list[str]] = {}
    for name in reader.names():  # an index may list the shards' tensors interleaved
        names_of.setdefault(reader.file_of(name), []).append(name)
    for file, names in names_of.items():
        for name in names:
            yield name, reader.get_slice(name)
        reader.release(file)
