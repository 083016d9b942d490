"""Weighted averages of checkpoints of one architecture (`muse average`): a "model soup", or
with a fine-tuned model and the model it started from, an interpolation between the two
(WiSE-FT), which often keeps the fine-tuning's gains while losing less of what the starting
model did well.

Each floating-point tensor is averaged in float32 and stored in its dtype; the sources must
hold the same tensor names, shapes and dtypes, and any other tensor must be equal in all of
them. Every other file of the first source (config, tokenizer, training records) is copied,
and `average.json` records the sources and weights.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import torch

from muse.checkpoint.reader import CheckpointReader
from muse.checkpoint.writer import (
    TensorSpec,
    check_destination,
    copy_other_files,
    write_tensors,
)

AVERAGE_RECORD = "average.json"


def average_weights(weights: Sequence[float] | None, count: int) -> list[float]:
    """The weights of `count` sources: equal when None; otherwise as given, normalised to sum
    to one (so `3 1` means 0.75 / 0.25)."""
    if weights is None:
        return [1.0 / count] * count
    if len(weights) != count:
        raise ValueError(f"--weights gives {len(weights)} weights for {count} checkpoints")
    if any(not weight >= 0 for weight in weights) or not sum(weights) > 0:
        raise ValueError(f"--weights must be >= 0 and not all zero, got {list(weights)}")
    total = sum(weights)
    return [weight / total for weight in weights]


def average_checkpoints(sources: Sequence[str | Path], destination: str | Path,
                        weights: Sequence[float] | None = None) -> list[float]:
    """Write the weighted average of `sources` (at least two checkpoint folders) to
    `destination`, a folder other than any source; returns the weights used."""
    if len(sources) < 2:
        raise ValueError("average needs at least two checkpoints")
    sources = [Path(source) for source in sources]
    destination = Path(destination)
    check_destination(destination, sources, "the average")
    used = average_weights(weights, len(sources))
    with ExitStack() as stack:
        readers = [stack.enter_context(CheckpointReader(source)) for source in sources]
        first = readers[0]
        specs = [TensorSpec(name, first.shape(name), first.dtype(name)) for name in first.names()]
        for source, reader in zip(sources[1:], readers[1:]):
            if set(reader.names()) != set(first.names()):
                differ = sorted(set(reader.names()) ^ set(first.names()))
                raise ValueError(f"{source} and {sources[0]} hold different tensors "
                                 f"(e.g. {differ[:3]})")
            for spec in specs:
                if (reader.shape(spec.name), reader.dtype(spec.name)) != (spec.shape, spec.dtype):
                    raise ValueError(
                        f"`{spec.name}` is {reader.shape(spec.name)} {reader.dtype(spec.name)} "
                        f"in {source} but {spec.shape} {spec.dtype} in {sources[0]}")

        def produce(spec: TensorSpec) -> torch.Tensor:
            tensors = [reader.get(spec.name) for reader in readers]
            if not spec.dtype.is_floating_point:
                if any(not torch.equal(tensors[0], other) for other in tensors[1:]):
                    raise ValueError(f"`{spec.name}` ({spec.dtype}) differs between the "
                                     "checkpoints and cannot be averaged")
                return tensors[0]
            total = sum(weight * tensor.float() for weight, tensor in zip(used, tensors))
            return total.to(spec.dtype)

        write_tensors(destination, specs, produce)
    copy_other_files(sources[0], destination, skip=(AVERAGE_RECORD,))
    record = {"sources": [str(source) for source in sources], "weights": used}
    (destination / AVERAGE_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return used
