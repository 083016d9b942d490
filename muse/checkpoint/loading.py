"""Filling a module from a checkpoint folder, and building the reference model from one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from muse.checkpoint.configs import load_config, model_type_of, read_config_json
from muse.checkpoint.layout import CheckpointError, format_names, is_encoder_tensor
from muse.checkpoint.name_maps import LoadPlan, name_map_for
from muse.checkpoint.reader import CheckpointReader
from muse.reference.model import MuseForCausalLM


@dataclass
class LoadReport:
    """What a non-strict load left out: model tensors not in the checkpoint, and the reverse."""

    missing: list[str]
    unexpected: list[str]


def _tensor_groups(module: nn.Module) -> dict[str, list[str]]:
    """Canonical name -> every name of that tensor; tied weights share one group."""
    groups: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return {names[0]: names for names in groups.values()}


def _check_fit(directory: Path, plan: LoadPlan, targets: dict[str, torch.Tensor],
               groups: dict[str, list[str]], strict: bool) -> tuple[dict[str, str], LoadReport]:
    """Pick each model tensor's checkpoint name; raise if the checkpoint does not fit."""
    chosen: dict[str, str] = {}
    for canonical, names in groups.items():
        found = next((name for name in names if name in plan.sources), None)
        if found is not None:
            chosen[canonical] = found
    covered = {name for names in groups.values() for name in names}
    missing = [canonical for canonical in groups if canonical not in chosen] + plan.missing
    # A decoder-only module leaves the media encoders' tensors for their own loader.
    skip_encoders = not any(is_encoder_tensor(name) for name in covered)
    unexpected = [name for name in plan.sources if name not in covered
                  and not (skip_encoders and is_encoder_tensor(name))]
    mis_shaped = list(plan.mis_shaped)
    for canonical, source_name in chosen.items():
        expected = tuple(targets[canonical].shape)
        found_shape = plan.sources[source_name].shape
        if found_shape != expected:
            mis_shaped.append(f"`{source_name}` has shape {found_shape} in the checkpoint but "
                              f"the model expects {expected}")
    problems = []
    if mis_shaped:
        problems.append(f"{len(mis_shaped)} tensor(s) with the wrong shape: "
                        f"{format_names(mis_shaped, separator='; ')}")
    if strict and missing:
        problems.append(f"{len(missing)} tensor(s) the model needs are missing: "
                        f"{format_names(missing)}")
    if strict and unexpected:
        problems.append(f"{len(unexpected)} tensor(s) the model has no place for: "
                        f"{format_names(unexpected)}")
    if problems:
        raise CheckpointError(f"checkpoint {directory} does not fit the model: "
                              + "; ".join(problems))
    return chosen, LoadReport(missing=missing, unexpected=unexpected)


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if leaf in owner._parameters:
        owner._parameters[leaf] = value
    else:
        owner._buffers[leaf] = value


@torch.no_grad()
def load_weights(module: nn.Module, directory: str | Path, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, strict: bool = True) -> LoadReport:
    """Fill `module` (parameter names in the checkpoint layout) from a checkpoint folder.

    The checkpoint's config.json `model_type` picks the name map (muse_spark, qwen3, qwen3_moe).
    Every shape is checked from shard headers before any tensor is read. Floating-point tensors
    become `dtype` (default: the module tensor's dtype); tensors go to `device` (default: where
    the module tensor is, or the CPU for a module built on the meta device). A tensor whose
    dtype or device changes, or that was on the meta device, is replaced rather than copied
    into, and tied names keep sharing it.
    strict: raise on missing or unexpected tensors; shape mismatches always raise.
    """
    directory = Path(directory)
    name_map = name_map_for(model_type_of(read_config_json(directory)))
    groups = _tensor_groups(module)
    targets = module.state_dict(keep_vars=True)
    with CheckpointReader(directory) as reader:
        plan = name_map(reader)
        chosen, report = _check_fit(directory, plan, targets, groups, strict)
        for canonical, source_name in chosen.items():
            target = targets[canonical]
            want_dtype = dtype if dtype is not None and target.is_floating_point() \
                else target.dtype
            want_device = torch.device(device) if device is not None else (
                torch.device("cpu") if target.is_meta else target.device)
            tensor = plan.sources[source_name].read(reader, want_dtype)
            if not target.is_meta and target.dtype == want_dtype and target.device == want_device:
                target.copy_(tensor)
                continue
            tensor = tensor.to(want_device)
            if isinstance(target, nn.Parameter):
                tensor = nn.Parameter(tensor, requires_grad=target.requires_grad)
            for name in groups[canonical]:
                _set_tensor(module, name, tensor)
    return report


def load_reference_model(directory: str | Path, dtype: torch.dtype = torch.float32,
                         device: torch.device | str = "cpu") -> MuseForCausalLM:
    """The reference decoder with a checkpoint's weights; built on the meta device first so
    the weights are materialised once."""
    config = load_config(directory)
    with torch.device("meta"):
        model = MuseForCausalLM(config.text_config)
    load_weights(model, directory, dtype=dtype, device=device)
    return model.eval()
