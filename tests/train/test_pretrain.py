"""`muse train pretrain` on a CPU: a loadable checkpoint, a log, exact resumption, budgets."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from muse.checkpoint import load_config, load_reference_model
from muse.checkpoint.grow import grow_checkpoint
from muse.cli import main
from muse.init_checkpoint import init_random_checkpoint
from muse.presets import get_preset
from muse.train import memory, pretrain
from muse.train.data.conversations import TEXT_TASKS
from muse.train.data.python_source import PythonCorpus, SourceFile
from muse.train.options import STATE_FILE
from muse.train.schedule import learning_rate
from tests.train.helpers import NoiseSpeechPool


@pytest.fixture(autouse=True)
def small_corpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A few generated files instead of the machine's whole standard library."""
    folder = tmp_path / "source"
    folder.mkdir()
    files = []
    for index in range(20):
        path = folder / f"module_{index}.py"
        path.write_text("".join(f"def f_{index}_{n}(x):\n    return x + {n}\n\n"
                                for n in range(40)))
        files.append(SourceFile(f"test/module_{index}.py", path))

    def discover(cls, split: str, include_packages: bool = True):
        corpus = PythonCorpus(files, split)
        return corpus, corpus.manifest([])

    monkeypatch.setattr(PythonCorpus, "discover", classmethod(discover))


@pytest.fixture(autouse=True)
def noise_speech(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny preset has an audio encoder: its clips come from a stand-in pool."""
    monkeypatch.setattr(pretrain, "load_or_build_speech_pool",
                        lambda config, *args: NoiseSpeechPool())


def _train(out: Path, *flags: str) -> None:
    # Warmup longer than the run: the learning rate then does not depend on the run's
    # length, so a resumed run can be compared with an uninterrupted one.
    main(["train", "pretrain", "--preset", "muse-spark-tiny", "--out", str(out),
          "--batch-size", "2", "--seq-len", "64", "--warmup-steps", "50", "--log-every", "1",
          "--seed", "3", *flags])


def _log_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]


def test_three_steps_write_a_loadable_checkpoint_and_a_log(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _train(out, "--steps", "3")
    model = load_reference_model(out)
    assert model.config.hidden_size == 64
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 7]
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss"] > 0 and r["lr"] > 0 and r["tokens_per_s"] > 0 for r in records)
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 3 and summary["data_seed"] == 3
    assert summary["tokens_seen"] == 3 * 2 * 64
    assert "token_share_of_batch_0" in json.loads((out / "data_manifest.json").read_text())
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (out / "loss.png").is_file() == has_matplotlib


def test_task_weights_reach_the_data_and_the_manifest(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _train(out, "--steps", "1", "--task-weights", "unseen_tools=0.5, image=0")
    weights = json.loads((out / "data_manifest.json").read_text())["task_weights"]
    assert weights["unseen_tools"] == 0.5 and weights["image"] == 0.0
    assert weights["arithmetic"] == TEXT_TASKS[0].weight  # a task not named keeps its default
    with pytest.raises(SystemExit):
        _train(tmp_path / "bad", "--steps", "1", "--task-weights", "image")


def test_resuming_continues_exactly_where_the_run_stopped(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(straight, "--steps", "5")
    _train(resumed, "--steps", "3")
    _train(resumed, "--steps", "5", "--resume")
    assert _log_steps(resumed) == [1, 2, 3, 4, 5]
    expected = torch.load(straight / STATE_FILE, weights_only=False)
    got = torch.load(resumed / STATE_FILE, weights_only=False)
    assert got["step"] == 5
    for name, tensor in expected["model"].items():
        torch.testing.assert_close(got["model"][name], tensor, rtol=0, atol=0)


def test_a_run_from_a_grown_checkpoint_keeps_its_depth_when_resumed(tmp_path: Path) -> None:
    source = init_random_checkpoint(get_preset("muse-spark-tiny"), tmp_path / "source", seed=5)
    grow_checkpoint(source, tmp_path / "grown", [1, 4])  # 6 layers -> 8
    out = tmp_path / "run"
    _train(out, "--steps", "1", "--init-from", str(tmp_path / "grown"))
    _train(out, "--steps", "2", "--resume")
    state = torch.load(out / STATE_FILE, weights_only=False)
    assert state["step"] == 2
    assert load_config(out).text_config.num_hidden_layers == 8
    assert "model.layers.7.self_attn.o_proj.weight" in state["model"]
    # The new layers' zeroed outputs moved: the stage trains them.
    assert not state["model"]["model.layers.2.self_attn.o_proj.weight"].eq(0).all()


def test_resume_needs_a_saved_state(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        _train(tmp_path / "empty", "--steps", "2", "--resume")


def test_a_time_budget_stops_the_run_and_saves(tmp_path: Path) -> None:
    out = tmp_path / "budget"
    _train(out, "--time-budget-minutes", "0.1")
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["elapsed_s"] < 6.0 + 5.0
    assert (out / STATE_FILE).is_file()
    load_reference_model(out)


def test_schedule_steps_fix_the_schedule_of_a_run_split_over_commands(tmp_path: Path) -> None:
    """With --schedule-steps a time budget only stops the part; the cosine keeps its length,
    and a resumed part continues the same schedule."""
    out = tmp_path / "split"
    _train(out, "--steps", "2", "--time-budget-minutes", "5", "--schedule-steps", "60",
           "--warmup-steps", "1")
    assert torch.load(out / STATE_FILE, weights_only=False)["total_steps"] == 60
    main(["train", "pretrain", "--preset", "muse-spark-tiny", "--out", str(out), "--resume",
          "--steps", "3", "--time-budget-minutes", "5"])
    state = torch.load(out / STATE_FILE, weights_only=False)
    assert (state["step"], state["total_steps"]) == (3, 60)
    last = json.loads((out / "train_log.jsonl").read_text().splitlines()[-1])
    assert last["lr"] == pytest.approx(learning_rate(2, 2e-3, 1, 60, 0.1))


def test_the_default_preset_fits_the_shipping_limit() -> None:
    from muse.info import audio_parameters, text_parameters, vision_parameters
    from muse.presets import get_preset

    config = get_preset("muse-spark-default")
    text = config.text_config
    total = text_parameters(text).total \
        + vision_parameters(config.vision_config, text.hidden_size) \
        + audio_parameters(config.audio_config, text.hidden_size)
    # The checkpoint, encoders included, stays within 64 MB of bf16 weights, and within
    # what keeps the whole repository (code and docs ~9 MB, the drafter ~5 MB) under 64 MiB.
    assert total * 2 <= 48_000_000
    assert set(text.layer_types) == {"sliding_attention", "full_attention"}
    assert text.moe_latent_size and text.expert_norm and text.qk_norm
    assert text.num_key_value_heads < text.num_attention_heads
    model = pretrain.build_model(config, seed=0)
    assert sum(p.numel() for p in model.parameters()) == total


def test_media_conversations_train_the_encoders(tmp_path: Path) -> None:
    out = tmp_path / "media"
    _train(out, "--steps", "2", "--seq-len", "512", "--batch-size", "4")
    names = set(safe_open(out / "model.safetensors", "pt").keys())
    assert any(name.startswith("vision_tower.") for name in names)
    assert any(name.startswith("audio_tower.") for name in names)
    assert (out / "processor_config.json").is_file()
    state = torch.load(out / STATE_FILE, weights_only=False)["model"]
    first = pretrain.build_model(get_preset("muse-spark-tiny"), seed=3).state_dict()
    for tower in ("vision_tower.", "audio_tower."):
        moved = [name for name, tensor in state.items()
                 if name.startswith(tower) and not torch.equal(tensor, first[name])]
        assert moved, f"no {tower} weight was trained"
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert any(r.get("loss_image") or r.get("loss_video") or r.get("loss_audio")
               for r in records)


def test_init_from_starts_a_new_run_from_saved_weights(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    _train(first, "--steps", "2")
    # Another seed: a fresh start would have entirely different weights.
    _train(second, "--steps", "1", "--seed", "4", "--init-from", str(first))
    saved = load_reference_model(first).state_dict()
    started = torch.load(second / STATE_FILE, weights_only=False)
    assert started["step"] == 1
    for name, tensor in saved.items():
        assert (started["model"][name] - tensor).abs().max() < 1e-3, name
    with pytest.raises(SystemExit):
        _train(second, "--steps", "2", "--resume", "--init-from", str(first))


def test_sliding_window_changes_the_saved_model_and_is_kept_on_resume(tmp_path: Path) -> None:
    out = tmp_path / "run"
    preset_window = get_preset("muse-spark-tiny").text_config.sliding_window
    _train(out, "--steps", "1", "--sliding-window", str(preset_window * 2))
    saved = json.loads((out / "config.json").read_text())["text_config"]
    assert saved["sliding_window"] == preset_window * 2
    # A resumed run keeps the window it started with, whatever the command says.
    _train(out, "--steps", "2", "--resume")
    saved = json.loads((out / "config.json").read_text())["text_config"]
    assert saved["sliding_window"] == preset_window * 2
    with pytest.raises(SystemExit):
        _train(tmp_path / "bad", "--steps", "1", "--sliding-window", "0")


def test_the_batch_is_chosen_from_free_memory_and_logged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Free memory for two of the tiny model's 1024-token sequences at once.
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 5_000_000_000)
    caplog.set_level(logging.INFO, logger="muse.train")
    out = tmp_path / "auto"
    main(["train", "pretrain", "--preset", "muse-spark-tiny", "--out", str(out),
          "--batch-size", "4", "--steps", "1", "--device", "cpu"])
    args = json.loads((out / "train_summary.json").read_text())["args"]
    assert (args["batch_size"], args["micro_batch_size"], args["seq_len"]) == (4, 2, 1024)
    assert "4 x 1024 tokens per step in 2 micro-batch(es) of 2" in caplog.text
    load_reference_model(out)


def test_a_non_finite_gradient_skips_the_update(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    original = pretrain.accumulate_gradients
    calls = []

    def poisoned(model, *args, **kwargs):
        out = original(model, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            next(model.parameters()).grad.view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(pretrain, "accumulate_gradients", poisoned)
    out = tmp_path / "nan"
    _train(out, "--steps", "3")
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 3 and summary["skipped_steps"] == 1
    state = torch.load(out / STATE_FILE, weights_only=False)["model"]
    assert all(torch.isfinite(tensor).all() for tensor in state.values())


def test_encoders_learn_at_their_own_rate() -> None:
    from muse.train.options import PretrainArgs

    model = pretrain.build_model(get_preset("muse-spark-tiny"), seed=0)
    args = PretrainArgs(out="unused", steps=1, encoder_lr_scale=3.0)
    optimizer = pretrain.build_optimizer(model, args, torch.device("cpu"))
    scale_of = {id(p): group["lr_scale"] for group in optimizer.param_groups
                for p in group["params"]}
    for name, param in model.named_parameters():
        assert scale_of[id(param)] == (3.0 if name.startswith(("vision_tower.", "audio_tower."))
                                       else 1.0), name
    assert len(scale_of) == len(list(model.parameters()))


def test_compiled_layers_train_as_the_eager_ones(tmp_path: Path) -> None:
    """`--compile` gives the eager run's losses (float32 on the CPU: the fused kernels sum in
    other orders, so within float noise, not bit for bit), and its checkpoint keeps the
    parameter names (it loads into the reference model)."""
    if not any(shutil.which(compiler) for compiler in ("g++", "c++", "clang++")):
        pytest.skip("torch.compile on a CPU builds C++ kernels: no C++ compiler here")
    _train(tmp_path / "eager", "--steps", "2")
    _train(tmp_path / "compiled", "--steps", "2", "--compile")
    losses = [[json.loads(line)["loss"] for line in (tmp_path / name / "train_log.jsonl")
               .read_text().splitlines()] for name in ("eager", "compiled")]
    assert len(losses[0]) == 2
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    load_reference_model(tmp_path / "compiled")


def test_emphasized_tokens_count_verdict_loss_weight_times() -> None:
    """`--verdict-loss-weight W`: the gradients are those of the trained tokens' loss with
    each emphasized token counted W times, divided by the count of trained tokens as before
    (so W = 1, or a batch without emphasis, trains as it always did)."""
    from muse.train.router_balance import RouterLoadBalance

    config = get_preset("muse-spark-tiny")
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.text_config.vocab_size, (2, 25), generator=generator)
    sources = torch.randint(0, 3, (2, 24), generator=generator)
    emphasis = torch.rand(2, 24, generator=generator) < 0.3
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "sources": sources,
             "emphasis": emphasis}

    def gradients(weight: float, with_emphasis: bool = True) -> list[torch.Tensor]:
        model = pretrain.build_model(config, seed=0)
        balance = RouterLoadBalance(model, config.text_config.num_experts_per_tok)
        given = batch if with_emphasis else {k: v for k, v in batch.items() if k != "emphasis"}
        pretrain.accumulate_gradients(model, balance, given, 1, 0.0, torch.device("cpu"),
                                      weight)
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    model = pretrain.build_model(config, seed=0)
    logits = model(batch["input_ids"]).logits
    per_token = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), reduction="none")
    trained = (sources > 0).float().reshape(-1)
    counted = trained * (1 + 3.0 * emphasis.float().reshape(-1))
    ((per_token * counted).sum() / trained.sum()).backward()
    expected = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(expected) == len(gradients(4.0))
    for got, want in zip(gradients(4.0), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    plain = gradients(1.0, with_emphasis=False)
    assert any(not torch.allclose(a, b) for a, b in zip(gradients(4.0), plain))
    for got, want in zip(gradients(1.0), plain):
        torch.testing.assert_close(got, want)
