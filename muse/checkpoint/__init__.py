"""Checkpoint folders: safetensors io, config.json of Muse / Qwen3 / Qwen3-MoE, name maps.

The layout is described in docs/formats.md ("Checkpoint layout").
"""

from muse.checkpoint.configs import load_config, read_config_json
from muse.checkpoint.layout import ASSETS_DIR, CheckpointError
from muse.checkpoint.loading import LoadReport, load_reference_model, load_weights
from muse.checkpoint.name_maps import NAME_MAPS, LoadPlan, name_map_for
from muse.checkpoint.reader import CheckpointReader
from muse.checkpoint.writer import (
    DEFAULT_MAX_SHARD_BYTES,
    TensorSpec,
    copy_tokenizer_files,
    save_checkpoint,
    write_checkpoint,
)

__all__ = [
    "ASSETS_DIR",
    "DEFAULT_MAX_SHARD_BYTES",
    "NAME_MAPS",
    "CheckpointError",
    "CheckpointReader",
    "LoadPlan",
    "LoadReport",
    "TensorSpec",
    "copy_tokenizer_files",
    "load_config",
    "load_reference_model",
    "load_weights",
    "name_map_for",
    "read_config_json",
    "save_checkpoint",
    "write_checkpoint",
]
