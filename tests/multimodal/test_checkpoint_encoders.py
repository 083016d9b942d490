"""Encoder weights in checkpoints: `muse init` writes a preset's encoders (the values the
engine draws for the preset) and its processor_config.json; a checkpoint folder takes media
as the preset does; decoder loaders skip encoder tensors; missing encoder tensors fail by
name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from muse import LLM
from muse.chat_format import IMAGE_ID
from muse.checkpoint import CheckpointError, load_reference_model
from muse.checkpoint.layout import SAFETENSORS_METADATA
from muse.cli import main as cli_main
from muse.init_checkpoint import init_random_checkpoint
from muse.multimodal.engine_inputs import build_media_encoders, load_media_encoders
from muse.multimodal.processor import PROCESSOR_CONFIG_FILE, ProcessorConfig
from muse.presets import get_preset
from tests.conftest import DEVICE
from tests.engine.helpers import tiny_llm
from tests.multimodal.test_engine_media import clip, greedy, image, media_prompt

PRESET = "muse-spark-tiny"
INIT_STD = 0.1  # tiny_llm's: wide enough greedy gaps


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny preset's seed-0 weights in float32, as `tiny_llm()` draws them."""
    directory = tmp_path_factory.mktemp("tiny")
    return init_random_checkpoint(get_preset(PRESET), directory, seed=0, dtype="float32",
                                  std=INIT_STD)


def checkpoint_llm(directory: Path, **engine_args) -> LLM:
    engine_args.setdefault("kv_cache_memory_bytes", 32 * 2**20)
    return LLM(str(directory), device=DEVICE, dtype="float32", **engine_args)


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def test_init_writes_the_presets_encoders_and_processor_config(checkpoint):
    tensors = weights(checkpoint)
    encoders = build_media_encoders(get_preset(PRESET), 0, torch.float32, "cpu")
    expected = encoders.state_dict()
    assert {n for n in tensors if n.startswith(("vision_tower.", "audio_tower."))} \
        == set(expected)
    for name, value in expected.items():
        assert torch.equal(tensors[name], value), name
    assert ProcessorConfig.load(checkpoint) == ProcessorConfig()
    assert (checkpoint / PROCESSOR_CONFIG_FILE).is_file()


def test_cli_init_writes_encoders(tmp_path):
    out = tmp_path / "cli"
    cli_main(["init", str(out), "--preset", PRESET, "--dtype", "bfloat16"])
    tensors = weights(out)
    assert tensors["vision_tower.patch_embed.weight"].dtype == torch.bfloat16
    assert any(name.startswith("audio_tower.") for name in tensors)
    assert (out / PROCESSOR_CONFIG_FILE).is_file()


def test_decoder_loaders_skip_encoder_tensors(checkpoint):
    model = load_reference_model(checkpoint)  # strict: would refuse unknown names
    assert not any(name.startswith("vision_tower.") for name in model.state_dict())


def test_checkpoint_media_equals_the_preset(checkpoint):
    ids = media_prompt(1)
    data = {"image": [image(0)], "audio": [clip(5)]}
    request = [{"prompt_token_ids": ids, "multi_modal_data": data}]
    (preset,) = tiny_llm().generate(request, greedy(), use_tqdm=False)
    llm = checkpoint_llm(checkpoint)
    (loaded,) = llm.generate(request, greedy(), use_tqdm=False)
    assert loaded.prompt_token_ids == preset.prompt_token_ids
    assert loaded.outputs[0].token_ids == preset.outputs[0].token_ids
    # The loaded encoders hold the checkpoint's tensors exactly.
    stored = weights(checkpoint)
    for name, value in llm.engine.encoders.state_dict().items():
        assert torch.equal(value.cpu(), stored[name]), name


def test_processor_config_is_read_from_the_checkpoint(checkpoint, tmp_path):
    directory = tmp_path / "small_images"
    shutil.copytree(checkpoint, directory)
    # Images at most 56 x 56: 4 image tokens instead of 16.
    ProcessorConfig(max_pixels=56 * 56).save(directory)
    llm = checkpoint_llm(directory)
    ids = media_prompt(1)
    (out,) = llm.generate([{"prompt_token_ids": ids, "multi_modal_data":
                            {"image": [image(0)], "audio": [clip(5)]}}], greedy(),
                          use_tqdm=False)
    assert out.prompt_token_ids.count(IMAGE_ID) == 4


def without(directory: Path, destination: Path, drop: str) -> Path:
    """A copy of a one-file checkpoint without the tensor `drop`."""
    shutil.copytree(directory, destination)
    tensors = weights(directory)
    del tensors[drop]
    save_file(tensors, destination / "model.safetensors", metadata=SAFETENSORS_METADATA)
    return destination


def test_a_missing_encoder_tensor_is_named(checkpoint, tmp_path):
    name = "audio_tower.projector.weight"
    broken = without(checkpoint, tmp_path / "broken", name)
    with pytest.raises(CheckpointError, match=rf"audio_config.*missing: {name}"):
        load_media_encoders(get_preset(PRESET), broken, torch.float32, "cpu")
    with pytest.raises(CheckpointError, match=name):
        checkpoint_llm(broken)


def test_encoders_of_a_config_without_them_are_ignored(checkpoint, tmp_path):
    directory = tmp_path / "text_only"
    shutil.copytree(checkpoint, directory)
    config = json.loads((directory / "config.json").read_text())
    config.pop("vision_config")
    config.pop("audio_config")
    (directory / "config.json").write_text(json.dumps(config))
    llm = checkpoint_llm(directory)
    assert llm.engine.encoders is None
    (out,) = llm.generate([media_prompt(1)[:5]], greedy(), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == greedy().max_tokens
