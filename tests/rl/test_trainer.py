"""`muse train grpo` on the tiny preset (CPU, float32).

The task is one the random tiny model can learn in a few steps: its reply should start with
the token that is its second most likely first token (about a quarter of the samples at
init_std 0.5), so held-out greedy accuracy goes from 0 to 1 as that token overtakes the
first. The runs are repeated exactly under a seed, FSDP2 over two gloo processes trains the
adapter one process trains, and the engine serves exactly the adapter the trainer holds.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from muse.engine.sampling_params import SamplingParams  # noqa: E402
from muse.lora import LoRARequest  # noqa: E402
from muse.rl import policy as policy_lib  # noqa: E402
from muse.rl.policy_trainer import PolicyTrainer  # noqa: E402
from muse.rl.rollout_worker import ADAPTER_NAME, RolloutWorker  # noqa: E402
from muse.rl.trainer import GRPOLoop, train_grpo  # noqa: E402
from muse.rl.world import World  # noqa: E402
from muse.rl.trainer_options import ADAPTER_DIR, METRICS_FILE, GRPOTrainArgs  # noqa: E402

MODEL = "muse-spark-tiny"
INIT_STD = 0.5
PROMPT = [{"role": "user", "content": "Say something."}]
TIMING = ("rollout_s", "train_s", "sync_s", "seconds")
# FSDP2 sums gradients in another order than one process: float32 rounding, which Adam's
# first steps (update ~ lr * g / |g|) magnify for elements whose gradient is nearly zero.
FSDP_TOLERANCE = 1e-5


def target_reward(completion: str, task: dict) -> float:
    """1.0 when the reply starts with the task's target text."""
    return float(completion.startswith(task["target"]))


@pytest.fixture(scope="module")
def tasks_file(tmp_path_factory) -> Path:
    """A one-task file whose target is the base model's most likely first token after the
    greedy one (whose text does not start with it)."""
    from muse.tokenizer import BASE_TOKENIZER_DIR, MuseTokenizer

    tokenizer = MuseTokenizer.from_pretrained(BASE_TOKENIZER_DIR)
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    base = policy_lib.load_base_model(MODEL, torch.float32, torch.device("cpu"), 0, INIT_STD)
    with torch.no_grad():
        ranked = base(input_ids=torch.tensor([prompt])).logits[0, -1].argsort(descending=True)
    greedy = tokenizer.decode([int(ranked[0])], skip_special_tokens=False)
    target = next(text for text in (tokenizer.decode([int(i)], skip_special_tokens=False)
                                    for i in ranked[1:])
                  if text.strip() and not greedy.startswith(text))
    path = tmp_path_factory.mktemp("grpo_tasks") / "tasks.jsonl"
    path.write_text(json.dumps({"messages": PROMPT, "target": target}) + "\n")
    return path


def run_args(tasks_file: Path, output: Path, **overrides) -> GRPOTrainArgs:
    settings = dict(model=MODEL, init_std=INIT_STD, tasks_file=str(tasks_file),
                    eval_tasks_file=str(tasks_file), reward="tests.rl.test_trainer:target_reward",
                    steps=4, prompts_per_step=2, group_size=8, max_tokens=2, lr=3e-3,
                    lora_rank=8, lora_alpha=16, eval_every=1, output=str(output), device="cpu",
                    seed=0)
    return GRPOTrainArgs(**{**settings, **overrides})


def metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / METRICS_FILE).read_text().splitlines()]


def adapter(output: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(output / ADAPTER_DIR / "adapter_model.safetensors"))


def without_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in record.items() if k not in TIMING} for record in records]


def test_grpo_raises_the_reward_and_repeats_exactly(tasks_file, tmp_path) -> None:
    first = train_grpo(run_args(tasks_file, tmp_path / "first"))
    records = metrics(first)
    assert records[0]["step"] == 0 and records[0]["eval_accuracy"] == 0.0
    steps = records[1:]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert steps[0]["reward_mean"] < 0.6
    assert steps[-1]["reward_mean"] >= 0.9
    assert steps[-1]["eval_accuracy"] == 1.0
    for record in steps:
        assert record["lora_version"] == record["step"]
        for name in ("clip_fraction", "tis_weight_mean", "mismatch_kl", "mismatch_abs",
                     "tokens", "loss", "grad_norm"):
            assert name in record, name
        # The engine and the trainer score the same tokens alike (float32 on one CPU).
        assert record["mismatch_abs"] < 1e-4
        assert record["tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)

    second = train_grpo(run_args(tasks_file, tmp_path / "second"))
    assert without_timing(metrics(second)) == without_timing(records)
    one, other = adapter(first), adapter(second)
    assert one.keys() == other.keys()
    assert all(torch.equal(one[name], other[name]) for name in one)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fsdp_args(tasks_file: Path, output: Path) -> GRPOTrainArgs:
    """Three groups over two processes, micro-batches of one group: one process runs a
    micro-batch more than the other (the other runs an empty one for FSDP's collectives)."""
    return run_args(tasks_file, output, steps=2, lr=1e-3, eval_every=0, prompts_per_step=3,
                    micro_batch_size=8)


def _fsdp_rank(rank: int, world_size: int, port: int, tasks_file: str, output: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        train_grpo(fsdp_args(Path(tasks_file), Path(output)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_fsdp2_over_two_processes_trains_the_one_process_adapter(tasks_file, tmp_path) -> None:
    import torch.multiprocessing as mp

    sharded = tmp_path / "sharded"
    mp.spawn(_fsdp_rank, args=(2, _free_port(), str(tasks_file), str(sharded)), nprocs=2)
    single = train_grpo(fsdp_args(tasks_file, tmp_path / "single"))
    assert [r.get("reward_mean") for r in metrics(sharded)] == \
        [r.get("reward_mean") for r in metrics(single)]
    expected, got = adapter(single), adapter(sharded)
    assert expected.keys() == got.keys()
    difference = max((expected[name] - got[name]).abs().max().item() for name in expected)
    assert difference < FSDP_TOLERANCE
    # The adapter did move (B starts at zero), so the comparison can fail.
    assert max(t.abs().max().item() for name, t in expected.items() if "lora_B" in name) > 1e-4


def test_the_engine_serves_the_adapter_the_trainer_holds(tasks_file, tmp_path) -> None:
    args = run_args(tasks_file, tmp_path, steps=1)
    args.validate()
    world = World(0, 1, torch.device("cpu"))
    trainer = PolicyTrainer(args, world)
    rollouts = RolloutWorker(args, world.device)
    loop = GRPOLoop(args, trainer, rollouts, world)
    loop.sync()
    groups, _, _ = loop.collect(step=1)
    assert {t.lora_version for group in groups for t in group} == {1}
    trainer.train(groups)
    loop.sync()
    groups, _, _ = loop.collect(step=2)
    assert {t.lora_version for group in groups for t in group} == {2}

    prompt = rollouts.llm.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True,
                                                        tokenize=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    served = rollouts.llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False,
                                   lora_request=LoRARequest(ADAPTER_NAME, 2))[0]
    assert served.lora_version == 2
    completion = served.outputs[0]
    assert completion.token_ids == policy_lib.greedy_tokens(trainer.model, prompt, 6)

    with torch.no_grad():
        ids = torch.tensor([prompt + completion.token_ids[:-1]])
        logits = trainer.model(input_ids=ids).logits[0, len(prompt) - 1:]
        trained = torch.log_softmax(logits, -1).gather(
            -1, torch.tensor(completion.token_ids)[:, None])[:, 0]
    engine = torch.tensor([entry.logprob for entry in completion.logprobs])
    assert (trained - engine).abs().max().item() < 1e-4
    base = rollouts.llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
    if base.outputs[0].token_ids == completion.token_ids:
        base_logprobs = torch.tensor([entry.logprob for entry in base.outputs[0].logprobs])
        assert (base_logprobs - engine).abs().max().item() > 1e-2


def test_cli_help_and_a_run_whose_adapter_the_engine_loads(tasks_file, tmp_path,
                                                           capsys) -> None:
    from muse import LLM
    from muse.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "grpo", "--help"])
    assert exit_info.value.code == 0
    assert "--group-size" in capsys.readouterr().out

    output = tmp_path / "cli"
    main(["train", "grpo", "--model", MODEL, "--init-std", str(INIT_STD),
          "--tasks-file", str(tasks_file), "--reward", "tests.rl.test_trainer:target_reward",
          "--steps", "1", "--prompts-per-step", "1", "--group-size", "4", "--max-tokens", "2",
          "--lora-rank", "4", "--lora-alpha", "8", "--lr", "3e-3", "--device", "cpu",
          "--output", str(output)])
    assert f"adapter written to {output / ADAPTER_DIR}" in capsys.readouterr().out
    assert [r["step"] for r in metrics(output)] == [0, 1]
    folder = output / ADAPTER_DIR
    assert (folder / "adapter_config.json").is_file()
    assert (folder / "adapter_model.safetensors").is_file()
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["target_parameters"]

    llm = LLM(MODEL, device="cpu", dtype="float32", init_std=INIT_STD, seed=0,
              enable_lora=True, max_lora_rank=4)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0),
                       lora_request=LoRARequest("grpo", 1, str(folder)), use_tqdm=False)[0]
    assert out.lora_name == "grpo" and len(out.outputs[0].token_ids) == 3


def test_mini_batches_kl_temperature_and_dynamic_sampling(tasks_file, tmp_path) -> None:
    """The other loss settings run and keep their promises: below temperature 1 the engine's
    raw log-probs still agree with the trainer's (mismatch ~0, TIS weights ~1); a second
    mini-batch is scored against log-probs from before the first update; the KL term is
    logged; dynamic sampling trains only on groups whose rewards differ; --eval-pass-at is
    measured before the first and after the last step."""
    output = train_grpo(run_args(tasks_file, tmp_path, steps=2, temperature=0.7,
                                 mini_batches=2, micro_batch_size=3, kl_coef=0.01,
                                 dynamic_sampling=True, max_resample_rounds=2, eval_every=0,
                                 eval_pass_at=4))
    records = metrics(output)
    for record in (records[0], records[-1]):
        assert 0.0 <= record["eval_sample_mean"] <= record["eval_pass_at_k"] <= 1.0
    assert all("eval_pass_at_k" not in record for record in records[1:-1])
    steps = records[1:]
    for record in steps:
        assert record["groups"] <= 2 and record["rollout_rounds"] <= 3
        if record["groups"] == 0:  # no group with differing rewards: no update
            assert "loss" not in record and record["rollout_rounds"] == 3
            continue
        assert record["mismatch_abs"] < 1e-4
        assert record["tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert record["kl"] >= 0.0
    assert steps[0]["groups"] == 2 and steps[0]["ratio_mean"] != 1.0


def test_a_quantized_base_is_trained_on_the_weights_the_engine_runs(tmp_path) -> None:
    """The trainer's base of an NVFP4 checkpoint is its dequantized weights: it scores the
    engine's tokens as the engine does, and unlike the unquantized source."""
    from muse import LLM
    from muse.init_checkpoint import init_random_checkpoint
    from muse.presets import get_preset
    from muse.quantization.quantize import quantize_checkpoint

    source, quantized = tmp_path / "source", tmp_path / "nvfp4"
    init_random_checkpoint(get_preset(MODEL), source, seed=0, dtype="float32", std=INIT_STD)
    quantize_checkpoint(source, quantized, "nvfp4-w4a16", progress=False)
    assert policy_lib.is_quantized(quantized) and not policy_lib.is_quantized(source)

    prompt = [1, 4, 82, 1633, 5483, 45, 7, 230, 5]
    llm = LLM(str(quantized), device="cpu", dtype="float32")
    completion = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=1.0, seed=0, max_tokens=6, logprobs=0, ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    engine = torch.tensor([entry.logprob for entry in completion.logprobs])
    ids = torch.tensor([prompt + completion.token_ids[:-1]])
    targets = torch.tensor(completion.token_ids)[:, None]
    scores = {}
    for name, folder in (("dequantized", quantized), ("source", source)):
        base = policy_lib.load_base_model(str(folder), torch.float32, torch.device("cpu"))
        with torch.no_grad():
            logits = base(input_ids=ids).logits[0, len(prompt) - 1:]
        scores[name] = torch.log_softmax(logits, -1).gather(-1, targets)[:, 0]
    assert (scores["dequantized"] - engine).abs().max().item() < 1e-4
    assert (scores["source"] - engine).abs().max().item() > 1e-3


def test_bad_options_name_the_flag(tmp_path) -> None:
    with pytest.raises(ValueError, match="--group-size"):
        GRPOTrainArgs(group_size=1, output=str(tmp_path)).validate()
    with pytest.raises(ValueError, match="--lora-targets"):
        GRPOTrainArgs(lora_targets="q_proj,lm_head", output=str(tmp_path)).validate()
    with pytest.raises(ValueError, match="not both"):
        GRPOTrainArgs(task="addition", tasks_file="x.jsonl").validate()


def test_ray_actors_run_the_same_loop(tasks_file, tmp_path) -> None:
    ray = pytest.importorskip("ray")
    colocated = train_grpo(run_args(tasks_file, tmp_path / "colocated", steps=2,
                                    eval_every=0))
    # In-process (`address="local"`), so `ray.shutdown()` ends exactly its processes.
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = train_grpo(run_args(tasks_file, tmp_path / "ray", steps=2, eval_every=0,
                                     ray=True))
    finally:
        if started:
            ray.shutdown()
    assert [r.get("reward_mean") for r in metrics(remote)] == \
        [r.get("reward_mean") for r in metrics(colocated)]
    expected, got = adapter(colocated), adapter(remote)
    assert all(torch.allclose(expected[name], got[name], atol=1e-6) for name in expected)


def test_pass_at_k_counts_the_tasks_with_a_fully_right_sample(tasks_file, tmp_path) -> None:
    """eval_pass_at_k counts a held-out task once when any of its K samples has reward 1 (a
    partial reward does not count); eval_sample_mean averages every sample. The samples are
    drawn K to a task at the training temperature."""
    from types import SimpleNamespace

    class Rollouts:
        def rollout(self, tasks, group_size, seed, temperature):
            self.asked = (len(tasks), group_size, temperature)
            rewards = [[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.5], [1.0, 1.0, 1.0, 1.0]]
            return [[SimpleNamespace(reward=r) for r in group] for group in rewards]

    args = run_args(tasks_file, tmp_path, eval_pass_at=4, temperature=0.9)
    rollouts = Rollouts()
    loop = GRPOLoop(args, trainer=None, rollouts=rollouts, world=World(0, 1, torch.device("cpu")))
    assert loop.headroom() == {"eval_pass_at_k": pytest.approx(2 / 3),
                               "eval_sample_mean": pytest.approx(6.5 / 12)}
    assert rollouts.asked == (len(loop.held_out), 4, 0.9)
    off = GRPOLoop(run_args(tasks_file, tmp_path), trainer=None, rollouts=rollouts,
                   world=World(0, 1, torch.device("cpu")))
    assert off.headroom() == {}
