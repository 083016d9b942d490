"""Folding a LoRA adapter into its base checkpoint (`muse merge-lora`): W + s * B @ A written
as a plain checkpoint, served and trained like any other, with no adapter slot and no LoRA
kernels at run time (PEFT's `merge_and_unload`, for a checkpoint folder).

Each delta is computed in float32 and added to the weight in float32, then stored in the
weight's own dtype; every other tensor and file of the base folder is copied as it is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from muse.checkpoint.reader import CheckpointReader
from muse.checkpoint.writer import TensorSpec, copy_other_files, write_tensors
from muse.lora.peft_adapter import AdapterError, LoRAWeights, read_adapter


def _delta(weights: LoRAWeights) -> torch.Tensor:
    """scaling * B @ A: [out, in], or [E, out, in] for stacked experts."""
    return weights.scaling * torch.matmul(weights.b, weights.a)


def _target_name(reader: CheckpointReader, key: str) -> str:
    """The checkpoint tensor an adapter key adapts: a module's `.weight`, or a stacked-experts
    parameter by its own path."""
    for name in (f"{key}.weight", key):
        if name in reader:
            return name
    raise AdapterError(f"the adapter adapts `{key}`, which the base checkpoint does not have "
                       f"(neither `{key}.weight` nor `{key}`): is it the adapter's base?")


def merge_adapter(base: str | Path, adapter: str | Path, destination: str | Path) -> list[str]:
    """Write `base` with `adapter` folded into its weights to `destination` (a new folder);
    returns the names of the tensors changed."""
    base, destination = Path(base), Path(destination)
    if destination.exists() and destination.resolve() == base.resolve():
        raise ValueError("write the merged checkpoint to another folder than its base")
    config = json.loads((base / "config.json").read_text())
    text = config.get("text_config", config)
    experts = text.get("num_experts") or text.get("num_local_experts")
    lora = read_adapter(adapter, num_experts=experts)
    with CheckpointReader(base) as reader:
        targets = {_target_name(reader, key): weights for key, weights in lora.weights.items()}
        for name, weights in targets.items():
            shape, delta_shape = reader.shape(name), tuple(_delta_shape(weights))
            if shape != delta_shape:
                raise AdapterError(f"`{name}` is {shape} in the base checkpoint, but the "
                                   f"adapter's delta is {delta_shape}")
        specs = [TensorSpec(name, reader.shape(name), reader.dtype(name))
                 for name in reader.names()]

        def produce(spec: TensorSpec) -> torch.Tensor:
            tensor = reader.get(spec.name)
            if spec.name not in targets:
                return tensor
            merged = tensor.float() + _delta(targets[spec.name])
            return merged.to(spec.dtype)

        write_tensors(destination, specs, produce)
    copy_other_files(base, destination)
    return sorted(targets)


def _delta_shape(weights: LoRAWeights) -> torch.Size:
    b, a = weights.b, weights.a
    return torch.Size([*b.shape[:-1], a.shape[-1]])
