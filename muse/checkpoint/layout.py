"""The on-disk layout of a checkpoint folder, shared by the reader and the writer.

A folder holds `config.json`, `generation_config.json`, the weights as one `model.safetensors`
or as shards `model-00001-of-0000N.safetensors` listed in `model.safetensors.index.json`, and
the tokenizer files. Tensor names are the reference model's `state_dict()` names, plus the
vision and audio encoders' under `vision_tower.` and `audio_tower.` when the config has them.
"""

from __future__ import annotations

import re
from pathlib import Path

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_PREFIX = "tokenizer"
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
# Written into every shard's header: Hugging Face loaders refuse files without it.
SAFETENSORS_METADATA = {"format": "pt"}

# Encoder tensors live beside the decoder's in the same shards; the decoder loaders skip them
# and `muse.multimodal.engine_inputs.load_media_encoders` reads them.
ENCODER_PREFIXES = ("vision_tower.", "audio_tower.")

_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


class CheckpointError(ValueError):
    """A checkpoint folder is missing, incomplete, or does not fit the model it is loaded into."""


def shard_file_name(index: int, count: int) -> str:
    """File name of shard `index` (1-based) out of `count`."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def is_weights_file(name: str) -> bool:
    """Whether a file name belongs to the weights (single file, shard, or index)."""
    return name in (SINGLE_WEIGHTS_FILE, INDEX_FILE) or bool(_SHARD_FILE.match(name))


def is_encoder_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the vision or audio encoder, not the decoder."""
    return name.startswith(ENCODER_PREFIXES)


def format_names(names: list[str], limit: int = 5, separator: str = ", ") -> str:
    """The first `limit` names, then how many more, so huge lists stay readable."""
    shown = separator.join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")
