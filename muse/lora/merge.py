"""Folding a LoRA adapter into its base checkpoint (`muse merge-lora`): W + s * B @ A written
as a plain checkpoint, served and trained like any other, with no adapter slot and no LoRA
kernels at run time (PEFT's `merge_and_unload`, for a checkpoint folder).

Each delta is computed in float32 and added to the weight in float32, then stored in the
weight's own dtype; every other tensor and file of the base folder is copied as it is.
"""

from __future__ import annotations

from pathlib import Path

import torch

from muse.checkpoint.configs import load_config
from muse.checkpoint.reader import CheckpointReader
from muse.checkpoint.writer import (
    TensorSpec,
    check_destination,
    copy_other_files,
    write_tensors,
)
from muse.lora.peft_adapter import AdapterError, read_adapter


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
    check_destination(destination, [base], "the merged checkpoint")
    lora = read_adapter(adapter, num_experts=load_config(base).text_config.num_experts)
    with CheckpointReader(base) as reader:
        targets = {_target_name(reader, key): weights for key, weights in lora.weights.items()}
        for name, weights in targets.items():
            if reader.shape(name) != weights.delta_shape:
                raise AdapterError(f"`{name}` is {reader.shape(name)} in the base checkpoint, "
                                   f"but the adapter's delta is {weights.delta_shape}")
        specs = [TensorSpec(name, reader.shape(name), reader.dtype(name))
                 for name in reader.names()]

        def produce(spec: TensorSpec) -> torch.Tensor:
            tensor = reader.get(spec.name)
            if spec.name not in targets:
                return tensor
            merged = tensor.float() + targets[spec.name].delta()
            return merged.to(spec.dtype)

        write_tensors(destination, specs, produce)
    copy_other_files(base, destination)
    return sorted(targets)
