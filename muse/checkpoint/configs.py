"""Reading a checkpoint folder's `config.json`, whichever model family wrote it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from muse.checkpoint.hf_configs import HF_CONFIG_READERS
from muse.checkpoint.layout import CONFIG_FILE, CheckpointError
from muse.config import MODEL_TYPE, ConfigError, MuseSparkConfig


def read_config_json(directory: str | Path) -> dict[str, Any]:
    """The raw config.json of a checkpoint folder, as a dict."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint directory {directory} has no {CONFIG_FILE}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def model_type_of(data: dict[str, Any]) -> str:
    # Muse's own config.json may leave the type out; MuseSparkConfig.from_dict assumes it too.
    return data.get("model_type", MODEL_TYPE)


def load_config(directory: str | Path) -> MuseSparkConfig:
    """The model configuration of a Muse, Qwen3 or Qwen3-MoE checkpoint folder."""
    data = read_config_json(directory)
    model_type = model_type_of(data)
    if model_type == MODEL_TYPE:
        return MuseSparkConfig.from_dict(data)
    if model_type not in HF_CONFIG_READERS:
        allowed = sorted([MODEL_TYPE, *HF_CONFIG_READERS])
        raise ConfigError(f"config.json field `model_type` must be one of {allowed}, "
                          f"got {model_type!r}")
    return HF_CONFIG_READERS[model_type](data)
