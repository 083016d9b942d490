"""Checkpoint folders: writing, lazy reading, loading into the reference model, and errors."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import muse.init_checkpoint
from muse.checkpoint import (
    ASSETS_DIR,
    CheckpointError,
    CheckpointReader,
    load_config,
    load_reference_model,
    load_weights,
    save_checkpoint,
)
from muse.checkpoint import reader as reader_module
from muse.config import ConfigError, MuseSparkConfig
from muse.init_checkpoint import init_random_checkpoint
from muse.multimodal.engine_inputs import MediaEncoders
from muse.presets import full_816b, tiny
from muse.reference.model import MuseForCausalLM

SEED = 3
Q_PROJ = "model.layers.2.self_attn.q_proj.weight"


def reference_model(config: MuseSparkConfig, seed: int = SEED,
                    std: float | None = None) -> MuseForCausalLM:
    model = MuseForCausalLM(config.text_config)
    model.init_weights(seed, std)
    return model.eval()


def encoder_tensors(config: MuseSparkConfig) -> dict[str, torch.Tensor]:
    """The encoder tensors `muse init` writes beside the decoder's (`vision_tower.*`, ...)."""
    return MediaEncoders(config).state_dict()


def assert_same_weights(model: torch.nn.Module, expected: torch.nn.Module) -> None:
    state, expected_state = model.state_dict(), expected.state_dict()
    assert state.keys() == expected_state.keys()
    for name, tensor in expected_state.items():
        assert state[name].dtype == tensor.dtype, name
        assert torch.equal(state[name], tensor), name


def token_ids(config: MuseSparkConfig, length: int = 24) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, config.text_config.vocab_size, (2, length), generator=generator)


def edit_weights(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    init_random_checkpoint(tiny(), directory, seed=SEED)
    return directory


@pytest.fixture
def checkpoint_copy(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "checkpoint"))


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("sharded")
    init_random_checkpoint(tiny(), directory, seed=SEED, max_shard_bytes=300_000)
    return directory


def test_init_writes_the_layout(tiny_checkpoint: Path) -> None:
    files = {path.name for path in tiny_checkpoint.iterdir()}
    tokenizer_files = {path.name for path in ASSETS_DIR.glob("tokenizer*")}
    # The tiny preset has encoders: their processor's settings come too.
    assert files == {"config.json", "generation_config.json", "model.safetensors",
                     "processor_config.json"} | tokenizer_files
    assert load_config(tiny_checkpoint) == tiny()
    assert json.loads((tiny_checkpoint / "config.json").read_text())["model_type"] \
        == "muse_spark"
    generation = json.loads((tiny_checkpoint / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": [2, 7], "pad_token_id": 0}


def test_init_then_load_is_bit_exact_and_gives_the_same_logits(tiny_checkpoint: Path) -> None:
    model = load_reference_model(tiny_checkpoint)
    expected = reference_model(tiny())
    assert_same_weights(model, expected)
    ids = token_ids(tiny())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected(ids).logits)


def test_sharded_checkpoint_has_an_index_and_round_trips(sharded_checkpoint: Path) -> None:
    index = json.loads((sharded_checkpoint / "model.safetensors.index.json").read_text())
    shards = sorted(path.name for path in sharded_checkpoint.glob("model-*.safetensors"))
    assert len(shards) > 2
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (sharded_checkpoint / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == shards
    expected = reference_model(tiny())
    stored = {**expected.state_dict(), **encoder_tensors(tiny())}
    assert set(index["weight_map"]) == set(stored)
    assert index["metadata"]["total_size"] == sum(
        tensor.numel() * tensor.element_size() for tensor in stored.values())
    for name, file in index["weight_map"].items():
        with safe_open(sharded_checkpoint / file, framework="pt") as shard:
            assert name in shard.keys()
    assert_same_weights(load_reference_model(sharded_checkpoint), expected)


def test_same_seed_gives_identical_files_and_another_seed_does_not(tmp_path: Path) -> None:
    first, second, other = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for directory, seed, dtype in ((first, 7, torch.bfloat16), (second, 7, "bfloat16"),
                                   (other, 8, torch.bfloat16)):
        init_random_checkpoint(tiny(), directory, seed=seed, dtype=dtype)
    assert (first / "model.safetensors").read_bytes() == \
        (second / "model.safetensors").read_bytes()
    a, c = load_file(first / "model.safetensors"), load_file(other / "model.safetensors")
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"],
                           c["model.layers.0.self_attn.q_proj.weight"])


def test_bfloat16_checkpoint_stores_bfloat16_and_loads_in_any_dtype(tmp_path: Path) -> None:
    init_random_checkpoint(tiny(), tmp_path, seed=SEED, dtype=torch.bfloat16, std=0.5)
    assert load_config(tmp_path).dtype == "bfloat16"
    with safe_open(tmp_path / "model.safetensors", framework="pt") as weights:
        assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"BF16"}
    expected = reference_model(tiny(), std=0.5).to(torch.bfloat16)
    assert_same_weights(load_reference_model(tmp_path, dtype=torch.bfloat16), expected)
    assert_same_weights(load_reference_model(tmp_path), expected.float())


def test_saved_model_loads_into_a_fresh_model_with_identical_logits(tmp_path: Path) -> None:
    config = tiny()
    original = reference_model(config, seed=11)
    save_checkpoint(original.state_dict(), config, tmp_path, sampling={"temperature": 0.7})
    fresh = reference_model(config, seed=12)
    report = load_weights(fresh, tmp_path)
    assert report.missing == [] and report.unexpected == []
    ids = token_ids(config)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, original(ids).logits)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["temperature"] == 0.7


def test_tied_embeddings_store_one_matrix_and_load_tied(tmp_path: Path) -> None:
    base = tiny()
    config = dataclasses.replace(
        base, text_config=dataclasses.replace(base.text_config, tie_word_embeddings=True))
    original = reference_model(config)
    save_checkpoint(original.state_dict(), config, tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as weights:
        names = set(weights.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    model = load_reference_model(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = token_ids(config)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)


def test_missing_tensors_are_named(checkpoint_copy: Path) -> None:
    edit_weights(checkpoint_copy / "model.safetensors", lambda tensors: tensors.pop(Q_PROJ))
    with pytest.raises(CheckpointError, match="1 tensor.*missing") as error:
        load_reference_model(checkpoint_copy)
    assert Q_PROJ in str(error.value)


def test_many_missing_tensors_are_counted(checkpoint_copy: Path) -> None:
    def drop_layer_one(tensors: dict[str, torch.Tensor]) -> None:
        for name in [name for name in tensors if name.startswith("model.layers.1.")]:
            del tensors[name]

    edit_weights(checkpoint_copy / "model.safetensors", drop_layer_one)
    layer_tensors = [name for name in reference_model(tiny()).state_dict()
                     if name.startswith("model.layers.1.")]
    with pytest.raises(CheckpointError) as error:
        load_reference_model(checkpoint_copy)
    message = str(error.value)
    assert f"{len(layer_tensors)} tensor(s) the model needs are missing" in message
    assert f"(and {len(layer_tensors) - 5} more)" in message


def test_unexpected_tensors_are_named_unless_not_strict(checkpoint_copy: Path) -> None:
    extra = "model.layers.0.mlp.surprise.weight"
    edit_weights(checkpoint_copy / "model.safetensors",
                 lambda tensors: tensors.update({extra: torch.ones(3)}))
    with pytest.raises(CheckpointError, match="no place for") as error:
        load_reference_model(checkpoint_copy)
    assert extra in str(error.value)
    model = MuseForCausalLM(tiny().text_config)
    report = load_weights(model, checkpoint_copy, strict=False)
    assert report.unexpected == [extra] and report.missing == []
    assert_same_weights(model, reference_model(tiny()))


def test_mis_shaped_tensor_names_both_shapes_even_when_not_strict(checkpoint_copy: Path) -> None:
    edit_weights(checkpoint_copy / "model.safetensors",
                 lambda tensors: tensors.update({Q_PROJ: torch.zeros(32, 64)}))
    for strict in (True, False):
        with pytest.raises(CheckpointError, match="wrong shape") as error:
            load_weights(MuseForCausalLM(tiny().text_config), checkpoint_copy, strict=strict)
        message = str(error.value)
        assert Q_PROJ in message and "(32, 64)" in message and "(64, 64)" in message


def test_missing_shard_file_is_named(sharded_checkpoint: Path, tmp_path: Path) -> None:
    directory = Path(shutil.copytree(sharded_checkpoint, tmp_path / "sharded"))
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing shard") as error:
        load_reference_model(directory)
    assert shard.name in str(error.value)


def test_missing_weights_are_reported(checkpoint_copy: Path) -> None:
    (checkpoint_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_reference_model(checkpoint_copy)


def test_missing_directory_and_config(checkpoint_copy: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_reference_model(tmp_path / "nowhere")
    (checkpoint_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_reference_model(checkpoint_copy)


def test_bad_config_json(checkpoint_copy: Path) -> None:
    path = checkpoint_copy / "config.json"
    good = json.loads(path.read_text())
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_config(checkpoint_copy)
    path.write_text(json.dumps({**good, "text_config": {**good["text_config"],
                                                        "num_experts_per_tok": 99}}))
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        load_config(checkpoint_copy)
    path.write_text(json.dumps({**good, "model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type.*'llama'"):
        load_config(checkpoint_copy)
    with pytest.raises(ConfigError, match="model_type"):
        load_weights(MuseForCausalLM(tiny().text_config), checkpoint_copy)


class _RecordingHandle:
    """Wraps a safe_open handle and records which tensors' bytes are read."""

    def __init__(self, handle, reads: list[str]) -> None:
        self._handle, self._reads = handle, reads

    def get_tensor(self, name: str) -> torch.Tensor:
        self._reads.append(name)
        return self._handle.get_tensor(name)

    def __getattr__(self, attribute: str):
        return getattr(self._handle, attribute)


def test_reader_maps_shards_and_reads_only_what_is_asked(sharded_checkpoint: Path,
                                                         tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    directory = Path(shutil.copytree(sharded_checkpoint, tmp_path / "sharded"))
    opened: list[str] = []
    reads: list[str] = []

    def recording_safe_open(path, framework, device):
        opened.append(Path(path).name)
        return _RecordingHandle(safe_open(path, framework=framework, device=device), reads)

    monkeypatch.setattr(reader_module, "safe_open", recording_safe_open)
    expected = reference_model(tiny()).state_dict()
    with CheckpointReader(directory) as reader:
        assert opened == [] and set(reader.names()) == set(expected) | set(
            encoder_tensors(tiny()))
        wanted_file = reader.file_of(Q_PROJ)
        # Garbage in every other shard: the reader must never touch those files.
        for shard in directory.glob("model-*.safetensors"):
            if shard.name != wanted_file:
                shard.write_bytes(b"\xff" * 64)
        assert reader.shape(Q_PROJ) == (64, 64)
        assert reads == []
        assert torch.equal(reader.get(Q_PROJ), expected[Q_PROJ])
    assert opened == [wanted_file] and reads == [Q_PROJ]


def test_saving_again_removes_stale_shards(sharded_checkpoint: Path, tmp_path: Path) -> None:
    directory = Path(shutil.copytree(sharded_checkpoint, tmp_path / "sharded"))
    model = reference_model(tiny(), seed=21)
    save_checkpoint(model.state_dict(), tiny(), directory)
    weights = sorted(path.name for path in directory.glob("model*"))
    assert weights == ["model.safetensors"]
    assert_same_weights(load_reference_model(directory), model)


def test_tokenizer_files_are_copied(tmp_path: Path) -> None:
    source = tmp_path / "assets"
    source.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "README.md"):
        (source / name).write_text(name)
    model = reference_model(tiny())
    save_checkpoint(model.state_dict(), tiny(), tmp_path / "out", tokenizer_from=source)
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "tokenizer.json"
    assert (tmp_path / "out" / "tokenizer_config.json").exists()
    assert not (tmp_path / "out" / "README.md").exists()


def test_init_refuses_an_unknown_dtype_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'bfloat17'"):
        init_random_checkpoint(tiny(), tmp_path, dtype="bfloat17")


def test_init_refuses_a_checkpoint_larger_than_the_free_disk(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(muse.init_checkpoint.shutil, "disk_usage",
                        lambda path: usage(2**41, 2**40, 100 * 2**30))
    with pytest.raises(CheckpointError, match="muse-spark-open-816b-a42b needs 1.") as error:
        init_random_checkpoint(full_816b(), tmp_path / "big")
    assert "TiB of disk" in str(error.value) and "100.00 GiB free" in str(error.value)
    assert not (tmp_path / "big").exists()
