"""Seeded random checkpoints of any Muse configuration, written without holding the model.

The model is built on the meta device for its parameter names and shapes only; each tensor is
then drawn, written into the current shard and dropped, so memory stays near one shard however
large the model is. A config with `vision_config` / `audio_config` also gets its encoders'
tensors (`vision_tower.*`, `audio_tower.*`), the very values the engine draws for the preset
from the same seed (`build_media_encoders`, held whole: encoders are a small part of the model),
and a `processor_config.json` with the preset's processor settings.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from muse.checkpoint.layout import ASSETS_DIR, CheckpointError, is_weights_file
from muse.checkpoint.writer import (
    DEFAULT_MAX_SHARD_BYTES,
    TensorSpec,
    dtype_name,
    write_checkpoint,
)
from muse.config import ConfigError, MuseSparkConfig
from muse.info import human_bytes, human_count
from muse.multimodal.engine_inputs import MediaEncoders, build_media_encoders, has_encoders
from muse.multimodal.processor import preset_processor_config
from muse.reference.model import MuseForCausalLM, initial_value


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a name such as a config's `dtype` stands for."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"`dtype` must name a torch dtype such as 'bfloat16' or 'float32', "
                          f"got {name!r}")
    return dtype


def _check_disk_space(directory: Path, specs: list[TensorSpec], config: MuseSparkConfig) -> None:
    needed = sum(spec.nbytes for spec in specs)
    existing = directory
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if directory.is_dir():
        # Old weight files in the folder are replaced, so their space comes back.
        free += sum(path.stat().st_size for path in directory.iterdir()
                    if path.is_file() and is_weights_file(path.name))
    if needed > free:
        parameters = sum(spec.numel for spec in specs)
        raise CheckpointError(
            f"a random checkpoint of {config.name or 'this configuration'} needs "
            f"{human_bytes(needed)} of disk ({human_count(parameters)} parameters in "
            f"{dtype_name(specs[0].dtype)}) but {existing} has {human_bytes(free)} free")


def init_random_checkpoint(config: MuseSparkConfig, directory: str | Path, seed: int = 0,
                           dtype: torch.dtype | str | None = None, std: float | None = None,
                           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write a checkpoint of seeded random weights plus the tokenizer files from muse/assets.

    The tensors equal those of `MuseForCausalLM(config.text_config).init_weights(seed, std)`
    cast to `dtype` (a torch dtype or its name; default: the config's `dtype`): the same seed
    gives bit-identical files. Encoder tensors, when the config has encoders, equal
    `build_media_encoders(config, seed, ...)`'s cast to `dtype`. Raises CheckpointError up
    front when the folder's disk cannot hold the checkpoint.
    """
    directory = Path(directory)
    text = config.text_config
    dtype = dtype or config.dtype
    dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    std = text.initializer_range if std is None else std
    with torch.device("meta"):
        model = MuseForCausalLM(text)
    # named_parameters lists a tied LM head once, as the embedding, and walks parameters in
    # the order init_weights draws them, which is what keeps the two bit-identical.
    specs = [TensorSpec(name, tuple(param.shape), dtype)
             for name, param in model.named_parameters()]
    if has_encoders(config):
        # Shapes from a meta-device build: the disk check comes before drawing any weight.
        with torch.device("meta"):
            shapes = MediaEncoders(config).state_dict()
        specs += [TensorSpec(name, tuple(tensor.shape), dtype) for name, tensor in shapes.items()]
    _check_disk_space(directory, specs, config)
    encoders = build_media_encoders(config, seed, torch.float32, "cpu")
    encoder_tensors = encoders.state_dict() if encoders is not None else {}
    generator = torch.Generator().manual_seed(seed)

    def produce(spec: TensorSpec) -> torch.Tensor:
        if spec.name in encoder_tensors:
            return encoder_tensors[spec.name].to(dtype)
        # Decoder tensors come first, in the order init_weights draws them.
        return initial_value(spec.name, spec.shape, generator, std).to(dtype)

    written = write_checkpoint(directory, config, specs, produce, max_shard_bytes,
                               tokenizer_from=ASSETS_DIR)
    if encoders is not None:
        preset_processor_config(config.name).save(written)
    return written
