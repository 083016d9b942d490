"""`muse grow`: new decoder layers that leave the model's function unchanged, and training
from the grown checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import muse.checkpoint.grow as grow
from muse import LLM, SamplingParams
from muse.checkpoint import load_config, load_weights
from muse.checkpoint.grow import GROW_RECORD, grow_checkpoint, plan_growth
from muse.config import FULL, SLIDING, MuseSparkConfig, with_overrides
from muse.init_checkpoint import init_random_checkpoint
from muse.presets import get_preset
from muse.reference.model import MuseForCausalLM
from muse.train.pretrain import build_model, load_initial_weights, training_config

TINY = get_preset("muse-spark-tiny")  # latent MoE with a shared expert, and encoders
VARIANTS = {
    "latent_moe_shared_expert": {},
    "plain_moe": {"moe_latent_size": None, "num_shared_experts": 0},
    "dense": {"num_experts": 0},
}
TOKENS = torch.arange(100, 140).reshape(2, 20)


def logits_of(directory: Path, config: MuseSparkConfig) -> torch.Tensor:
    model = MuseForCausalLM(config.text_config)
    load_weights(model, directory, dtype=torch.float32, strict=False)
    with torch.no_grad():
        return model.eval()(TOKENS).logits


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("grow")
    directory = init_random_checkpoint(TINY, root / "source", seed=5, dtype="float32")
    (directory / "drafter").mkdir()
    (directory / "drafter" / "config.json").write_text("{}")
    return directory


def test_plan_inserts_after_the_named_layers_with_their_kinds() -> None:
    kinds = [SLIDING, SLIDING, FULL, SLIDING]
    plan = plan_growth(kinds, [2, 0])
    assert plan.sources == (0, 0, 1, 2, 2, 3)
    assert plan.new == (False, True, False, False, True, False)
    assert plan.layer_types == (SLIDING, SLIDING, SLIDING, FULL, FULL, SLIDING)
    # Kinds given in the order of --insert-after; a repeated index inserts two layers.
    plan = plan_growth(kinds, [3, 1, 1], [FULL, SLIDING, FULL])
    assert plan.sources == (0, 1, 1, 1, 2, 3, 3)
    assert plan.layer_types == (SLIDING, SLIDING, SLIDING, FULL, FULL, SLIDING, FULL)


@pytest.mark.parametrize("insert_after, kinds, message", [
    ([], None, "nothing to grow"),
    ([4], None, "layers 0-3"),
    ([-1], None, "layers 0-3"),
    ([0, 1], [FULL], "2 new layers"),
    ([0], ["global"], "not one of"),
])
def test_plan_refuses_what_it_cannot_do(insert_after, kinds, message) -> None:
    with pytest.raises(ValueError, match=message):
        plan_growth([SLIDING] * 3 + [FULL], insert_after, kinds)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_grown_model_computes_exactly_what_its_source_did(variant, tmp_path) -> None:
    config = with_overrides(TINY, VARIANTS[variant])
    source = init_random_checkpoint(config, tmp_path / "source", seed=6, dtype="float32")
    grow_checkpoint(source, tmp_path / "grown", [0, 3, 5], [FULL, SLIDING, FULL])
    grown_config = load_config(tmp_path / "grown")
    assert grown_config.text_config.num_hidden_layers == 9
    assert grown_config.text_config.layer_types[1] == FULL
    assert torch.equal(logits_of(tmp_path / "grown", grown_config), logits_of(source, config))


def test_new_layers_copy_the_layer_before_with_zeroed_residual_outputs(source, tmp_path) -> None:
    grow_checkpoint(source, tmp_path / "grown", [1])
    before, after = (load_file(str(d / "model.safetensors")) for d in (source, tmp_path / "grown"))
    zeroed = {"self_attn.o_proj.weight", "mlp.unpooler.weight",
              "mlp.shared_expert.down_proj.weight"}
    for name, tensor in after.items():
        if not name.startswith("model.layers."):
            assert torch.equal(tensor, before[name]), name
            continue
        index, suffix = name.split(".", 3)[2:]
        old = {0: 0, 1: 1, 2: 1}.get(int(index), int(index) - 1)
        expected = before[f"model.layers.{old}.{suffix}"]
        if index == "2" and suffix in zeroed:
            assert not expected.eq(0).all() and tensor.eq(0).all(), name
        else:
            assert torch.equal(tensor, expected), name
    assert len(after) == len(before) + sum(1 for n in before if n.startswith("model.layers.1."))


def test_a_residual_output_left_in_place_changes_the_logits(source, tmp_path, monkeypatch
                                                            ) -> None:
    """The negative control of the equality above: a copy that keeps its outputs adds the
    copied layer's work twice."""
    monkeypatch.setattr(grow, "writes_residual", lambda suffix, has_unpooler: False)
    grow_checkpoint(source, tmp_path / "grown", [1])
    grown = load_config(tmp_path / "grown")
    assert not torch.allclose(logits_of(tmp_path / "grown", grown), logits_of(source, TINY))


def test_the_engine_serves_the_grown_model_token_for_token(source, tmp_path) -> None:
    grow_checkpoint(source, tmp_path / "grown", [2, 5])
    prompts = [{"prompt_token_ids": list(range(60 + 7 * i, 90 + 7 * i))} for i in range(3)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    expected = LLM(str(source), device="cpu").generate(prompts, greedy)
    got = LLM(str(tmp_path / "grown"), device="cpu").generate(prompts, greedy)
    for mine, theirs in zip(got, expected):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert mine.outputs[0].cumulative_logprob == pytest.approx(
            theirs.outputs[0].cumulative_logprob, abs=1e-5)


def test_training_starts_from_the_grown_checkpoint(source, tmp_path) -> None:
    grow_checkpoint(source, tmp_path / "grown", [0])
    config = training_config("muse-spark-tiny", tmp_path / "grown")
    assert config.text_config.layer_types[:2] == [SLIDING, SLIDING]
    assert config.vision_config == TINY.vision_config  # the preset's encoders stay
    model = build_model(config, seed=0)
    load_initial_weights(model, str(tmp_path / "grown"))  # every tensor fits
    assert torch.equal(model.model.layers[1].self_attn.o_proj.weight,
                       torch.zeros_like(model.model.layers[1].self_attn.o_proj.weight))
    with pytest.raises(ValueError, match="does not fit"):
        load_initial_weights(build_model(TINY, seed=0), str(tmp_path / "grown"))


def test_cli_writes_the_record_and_leaves_the_drafter_out(source, tmp_path) -> None:
    out = tmp_path / "grown"
    result = subprocess.run([sys.executable, "-m", "muse.cli", "grow", str(source), "--output",
                             str(out), "--insert-after", "3", "--layer-types", "full_attention"],
                            check=True, capture_output=True, text=True)
    assert "7 decoder layers, 1 new: 4" in result.stdout
    record = json.loads((out / GROW_RECORD).read_text())
    assert [layer["source_layer"] for layer in record["layers"]] == [0, 1, 2, 3, 3, 4, 5]
    assert [layer["new"] for layer in record["layers"]].count(True) == 1
    assert not (out / "drafter").exists()  # a drafter reads chosen layers: train it again
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()
    with pytest.raises(ValueError, match="another folder"):
        grow_checkpoint(source, source, [0])
