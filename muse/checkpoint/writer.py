"""Writing checkpoint folders: safetensors shards + index, config, generation config, tokenizer.

Tensors are produced one shard at a time, so a checkpoint can be written from a source that
never holds the whole model (a seeded generator, a model materialised layer by layer).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from muse.checkpoint.layout import (
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    SAFETENSORS_METADATA,
    SINGLE_WEIGHTS_FILE,
    TOKENIZER_PREFIX,
    is_weights_file,
    shard_file_name,
)
from muse.config import MuseSparkConfig, TextConfig

# The shard size transformers uses by default: small enough for hub uploads and parallel reads.
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
TIED_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written, known before it exists, so shards can be planned up front."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_shards(specs: Sequence[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of at most `max_shard_bytes`; a larger tensor gets a shard alone."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_tensors(directory: str | Path, specs: Sequence[TensorSpec],
                  produce: Callable[[TensorSpec], torch.Tensor],
                  max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Write the weights of a checkpoint; returns the file names written.

    `produce` is called once per spec, in the order of `specs`, and only the current shard's
    tensors are kept alive. One shard is written as `model.safetensors`; more get an index.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # Stale shards or an old index from an earlier save would be mixed into this one.
    for stale in directory.iterdir():
        if stale.is_file() and is_weights_file(stale.name):
            stale.unlink()
    shards = plan_shards(specs, max_shard_bytes)
    files = [SINGLE_WEIGHTS_FILE] if len(shards) == 1 else [
        shard_file_name(i + 1, len(shards)) for i in range(len(shards))]
    for file, shard in zip(files, shards):
        tensors = {spec.name: produce(spec).contiguous() for spec in shard}
        save_file(tensors, directory / file, metadata=SAFETENSORS_METADATA)
        del tensors
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(spec.nbytes for spec in specs)},
            "weight_map": {spec.name: file for file, shard in zip(files, shards)
                           for spec in shard},
        }
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_generation_config(text: TextConfig, directory: str | Path,
                            sampling: Mapping[str, Any] | None = None) -> None:
    """Special token ids, plus default sampling fields (temperature, top_p, ...) if given."""
    data: dict[str, Any] = {
        "bos_token_id": text.bos_token_id,
        "eos_token_id": text.eos_token_id,
        "pad_token_id": text.pad_token_id,
        **(sampling or {}),
    }
    Path(directory, GENERATION_CONFIG_FILE).write_text(json.dumps(data, indent=2) + "\n")


def copy_tokenizer_files(source: str | Path, directory: str | Path) -> list[Path]:
    """Copy every file of `source` whose name starts with `tokenizer`; returns the copies."""
    copies = []
    for path in sorted(Path(source).glob(f"{TOKENIZER_PREFIX}*")):
        if path.is_file():
            copies.append(Path(shutil.copy2(path, Path(directory) / path.name)))
    return copies


def check_destination(destination: Path, sources: Sequence[Path], written: str) -> None:
    """Refuse to write a derived checkpoint (`written`: "the merged checkpoint", ...) over a
    folder it is read from: its tensors are read while the new files are written."""
    if destination.exists() and any(destination.resolve() == s.resolve() for s in sources):
        raise ValueError(f"write {written} to another folder than its source")


def copy_other_files(source: str | Path, destination: str | Path,
                     skip: Sequence[str] = ()) -> None:
    """Every file and folder of the checkpoint `source` but its weights (and the names in
    `skip`) into `destination`, as they are: config, tokenizer, generation config, a drafter."""
    for path in Path(source).iterdir():
        if path.name in skip or (path.is_file() and is_weights_file(path.name)):
            continue
        target = Path(destination) / path.name
        if path.is_dir():
            shutil.copytree(path, target, dirs_exist_ok=True)
        else:
            shutil.copy2(path, target)


def write_checkpoint(directory: str | Path, config: MuseSparkConfig,
                     specs: Sequence[TensorSpec], produce: Callable[[TensorSpec], torch.Tensor],
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                     sampling: Mapping[str, Any] | None = None,
                     tokenizer_from: str | Path | None = None) -> Path:
    """A whole checkpoint folder from tensor specs and a producer (see `write_tensors`).

    config.json records the dtype the floating-point weights are stored in.
    """
    directory = Path(directory)
    write_tensors(directory, specs, produce, max_shard_bytes)
    stored = next((spec.dtype for spec in specs if spec.dtype.is_floating_point), None)
    if stored is not None:
        config = dataclasses.replace(config, dtype=dtype_name(stored))
    config.save(directory)
    write_generation_config(config.text_config, directory, sampling)
    if tokenizer_from is not None:
        copy_tokenizer_files(tokenizer_from, directory)
    return directory


def save_checkpoint(state_dict: Mapping[str, torch.Tensor], config: MuseSparkConfig,
                    directory: str | Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    dtype: torch.dtype | None = None,
                    sampling: Mapping[str, Any] | None = None,
                    tokenizer_from: str | Path | None = None) -> Path:
    """Save a model's state dict (reference-model names) as a checkpoint folder.

    dtype: cast floating-point tensors to it; None keeps each tensor's dtype.
    sampling: default sampling fields for generation_config.json.
    tokenizer_from: a folder whose `tokenizer*` files are copied alongside (e.g. ASSETS_DIR).
    With tied embeddings `lm_head.weight` is not stored: it is `model.embed_tokens.weight`.
    """
    tensors = {name: tensor for name, tensor in state_dict.items()
               if not (name == TIED_HEAD and config.text_config.tie_word_embeddings)}

    def stored_dtype(tensor: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype

    specs = [TensorSpec(name, tuple(tensor.shape), stored_dtype(tensor))
             for name, tensor in tensors.items()]

    def produce(spec: TensorSpec) -> torch.Tensor:
        return tensors[spec.name].detach().to(device="cpu", dtype=spec.dtype)

    return write_checkpoint(directory, config, specs, produce, max_shard_bytes, sampling,
                            tokenizer_from)
