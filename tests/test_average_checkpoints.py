"""`muse average`: weighted averages of checkpoints, their records, and refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from muse import LLM, SamplingParams
from muse.checkpoint.average import AVERAGE_RECORD, average_checkpoints, average_weights
from muse.init_checkpoint import init_random_checkpoint
from muse.presets import get_preset

TINY = get_preset("muse-spark-tiny")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(100 + 5 * i, 120 + 5 * i))} for i in range(2)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("average")
    return [init_random_checkpoint(TINY, root / f"seed{seed}", seed=seed, dtype="float32")
            for seed in (3, 4)]


def test_cli_writes_the_weighted_average_and_its_record(sources, tmp_path) -> None:
    out = tmp_path / "soup"
    subprocess.run([sys.executable, "-m", "muse.cli", "average", *map(str, sources),
                    "--output", str(out), "--weights", "3", "1"], check=True,
                   capture_output=True)
    first, second = (load_file(str(s / "model.safetensors")) for s in sources)
    averaged = load_file(str(out / "model.safetensors"))
    assert averaged.keys() == first.keys()
    differs = 0
    for name, tensor in averaged.items():
        expected = 0.75 * first[name] + 0.25 * second[name]
        torch.testing.assert_close(tensor, expected, rtol=1e-6, atol=1e-7)
        differs += not torch.equal(first[name], second[name])
    assert differs > 0  # the two seeds do differ, so the check above can fail
    assert json.loads((out / AVERAGE_RECORD).read_text()) == {
        "sources": [str(s) for s in sources], "weights": [0.75, 0.25]}
    # The first source's other files come along: the folder is a checkpoint to serve.
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (sources[0] / name).read_bytes()


def test_a_checkpoint_averaged_with_itself_generates_the_same(sources, tmp_path) -> None:
    out = tmp_path / "same"
    average_checkpoints([sources[0], sources[0]], out)
    original = load_file(str(sources[0] / "model.safetensors"))
    for name, tensor in load_file(str(out / "model.safetensors")).items():
        assert torch.equal(tensor, original[name])
    expected = LLM(str(sources[0]), device="cpu").generate(PROMPTS, GREEDY)
    got = LLM(str(out), device="cpu").generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_dtypes_are_kept(tmp_path) -> None:
    sources = [init_random_checkpoint(TINY, tmp_path / f"bf16-{seed}", seed=seed,
                                      dtype="bfloat16") for seed in (1, 2)]
    average_checkpoints(sources, tmp_path / "out")
    first, second = (load_file(str(s / "model.safetensors")) for s in sources)
    for name, tensor in load_file(str(tmp_path / "out" / "model.safetensors")).items():
        assert tensor.dtype == torch.bfloat16
        expected = (0.5 * first[name].float() + 0.5 * second[name].float()).bfloat16()
        assert torch.equal(tensor, expected)


def test_weights() -> None:
    assert average_weights(None, 4) == [0.25] * 4
    assert average_weights([1, 3], 2) == [0.25, 0.75]
    with pytest.raises(ValueError, match="2 weights for 3"):
        average_weights([1, 1], 3)
    for bad in ([-1, 2], [0, 0], [float("nan"), 1]):
        with pytest.raises(ValueError, match="--weights"):
            average_weights(bad, 2)


def test_refusals(sources, tmp_path) -> None:
    with pytest.raises(ValueError, match="at least two"):
        average_checkpoints(sources[:1], tmp_path / "one")
    with pytest.raises(ValueError, match="another folder"):
        average_checkpoints(sources, sources[1])
    tensors = load_file(str(sources[1] / "model.safetensors"))
    name = next(name for name, tensor in tensors.items() if tensor.dim() == 2)
    missing = tmp_path / "missing"
    missing.mkdir()
    save_file({k: v for k, v in tensors.items() if k != name}, str(missing / "model.safetensors"))
    with pytest.raises(ValueError, match="different tensors"):
        average_checkpoints([sources[0], missing], tmp_path / "out1")
    reshaped = tmp_path / "reshaped"
    reshaped.mkdir()
    save_file({**tensors, name: tensors[name].reshape(-1).contiguous()},
              str(reshaped / "model.safetensors"))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        average_checkpoints([sources[0], reshaped], tmp_path / "out2")
