"""`muse train grpo`: GRPO on a LoRA adapter, with the muse engine rolling out.

One step:

1. roll out `prompts_per_step` tasks, G samples each, with the engine serving the current
   adapter version (every trajectory records the version it ran with; a trajectory of any
   other version is an error); with dynamic sampling, groups whose rewards are all equal are
   dropped and more prompts rolled out, up to `max_resample_rounds` more rounds;
2. group-relative advantages (GRPO, or Dr.GRPO without the std division);
3. the trainer scores every trajectory token with the policy (the reference decoder and the
   adapter) at the sampling temperature: before the update, without grad, these are the old
   log-probs; the PPO clipped loss with clip-higher, truncated importance sampling against
   the engine's log-probs and an optional low_var_kl term against the base (the adapter
   disabled) is averaged over every mask-1 token of the batch;
4. one AdamW step (or `mini_batches` of them), then the adapter's new weights go to the
   engine in memory as the next version (`LoRARequest(name, version, config=, tensors=)`).

Rollouts and training share the process (the engine is colocated), or run as two Ray actors
with `ray=True` (muse.rl.ray_actors); the loop is the same.

Under torchrun (world size > 1) every process runs its own engine with the same seeds, so
all draw the same trajectories, and trains its share of the groups on an FSDP2-sharded
policy; the loss is divided by the global number of mask-1 tokens and gradients are summed,
so N processes compute the gradient one process would. Only rank 0 writes files.

The engine returns log-probs of the raw distribution (temperature 1); the trainer's raw
log-probs of the same tokens give the train/rollout mismatch, which is carried over to the
temperature-scaled log-probs the loss uses (the same numbers at temperature 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from muse.engine.sampling_params import SamplingParams
from muse.lora.request import LoRARequest
from muse.rl import policy as policy_lib
from muse.rl.grpo import group_advantages, keep_informative_groups, policy_loss, token_logprobs
from muse.rl.policy import SequenceBatch
from muse.rl.rewards import load_reward
from muse.rl.rollout import Trajectory, rollout
from muse.rl.plot import PLOT_FILE, plot_grpo
from muse.rl.tasks import load_tasks
from muse.rl.trainer_options import (ADAPTER_DIR, METRICS_FILE, SUMMARY_FILE,
                                     GRPOTrainArgs)

logger = logging.getLogger("muse.rl")
ADAPTER_NAME = "policy"
LOSS_STATS = ("loss", "clip_fraction", "ratio_mean", "tis_weight_mean", "mismatch_kl",
              "mismatch_abs", "kl")


# ---- processes ----------------------------------------------------------------------------
@dataclass(frozen=True)
class World:
    """This process's place among the training processes (one, or torchrun's)."""

    rank: int
    size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def agree(self, flag: bool) -> bool:
        """Whether any process says so (every process then takes the same branch: a time
        limit read from each one's clock must not split the world)."""
        if self.size == 1:
            return flag
        value = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())


def resolve_device(name: str) -> torch.device:
    """`name`, with auto / cuda meaning this process's GPU (LOCAL_RANK under torchrun)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(name)


def init_world(device_name: str) -> World:
    """Join torchrun's world when it has more than one process (gloo on a CPU, nccl on
    GPUs); a world already initialised by the caller is used as it is."""
    device = resolve_device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), device)
    return World(0, 1, device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _all_reduce(values: list[float], world: World, op: Any = None) -> list[float]:
    """`values` summed (or reduced by `op`) over the processes."""
    if world.size == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op)
    return tensor.tolist()


# ---- tasks --------------------------------------------------------------------------------
def _read_tasks_file(path: str) -> list[dict[str, Any]]:
    tasks = []
    with open(path) as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error})") from None
            if not isinstance(task, dict) or not isinstance(task.get("messages"), list):
                raise ValueError(f"{path}:{number}: a task is a JSON object with \"messages\" "
                                 f"(a list of chat messages)")
            tasks.append(task)
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


class TaskStream:
    """The training tasks of each step and round, the same in every process for a seed, and
    the held-out tasks of the evaluations."""

    def __init__(self, args: GRPOTrainArgs) -> None:
        self.args = args
        self.file_tasks = _read_tasks_file(args.tasks_file) if args.tasks_file else None
        self.order: list[int] = []
        self.epoch = 0
        if args.reward is not None:
            load_reward(args.reward)  # a bad spec fails now, not after the first rollout

    def _with_reward(self, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.args.reward is not None:
            return [{**task, "reward": self.args.reward} for task in tasks]
        unscored = [index for index, task in enumerate(tasks) if not task.get("reward")]
        if unscored:
            raise ValueError(f"task {unscored[0]} has no \"reward\": give --reward")
        return tasks

    def draw(self, n: int, step: int, round_index: int) -> list[dict[str, Any]]:
        if self.file_tasks is None:
            seed = (self.args.seed * 1_000_003 + step) * 101 + round_index
            return self._with_reward(load_tasks(self.args.task, n, seed=seed, split="train"))
        drawn = []
        while len(drawn) < n:
            if not self.order:
                self.order = list(range(len(self.file_tasks)))
                random.Random(f"grpo-tasks/{self.args.seed}/{self.epoch}").shuffle(self.order)
                self.epoch += 1
            drawn.append(self.file_tasks[self.order.pop(0)])
        return self._with_reward(drawn)

    def held_out(self) -> list[dict[str, Any]] | None:
        if self.file_tasks is not None:
            if self.args.eval_tasks_file is None:
                return None
            return self._with_reward(_read_tasks_file(self.args.eval_tasks_file)
                                     [:self.args.eval_tasks])
        return self._with_reward(load_tasks(self.args.task, self.args.eval_tasks,
                                            seed=self.args.seed, split="test"))


# ---- the rollout engine ---------------------------------------------------------------------
class RolloutWorker:
    """The muse engine with the adapter versions the trainer hands over."""

    def __init__(self, args: GRPOTrainArgs, device: torch.device) -> None:
        from muse.llm import LLM

        self.args = args
        engine_args: dict[str, Any] = {}
        if device.type == "cuda":
            engine_args["gpu_memory_utilization"] = args.gpu_memory_utilization
        self.llm = LLM(args.model, device=str(device), dtype=str(resolve_dtype(
            args.dtype, device)).removeprefix("torch."), seed=args.seed, init_std=args.init_std,
            enable_lora=True, max_loras=1, max_lora_rank=args.lora_rank, **engine_args)
        self.version = 0

    def sync(self, config: dict[str, Any], tensors: dict[str, torch.Tensor], version: int
             ) -> None:
        """Serve `tensors` as the adapter's `version` from the next request on."""
        self.llm.add_lora(LoRARequest(ADAPTER_NAME, version, config=config, tensors=tensors))
        self.version = version

    def rollout(self, tasks: list[dict[str, Any]], group_size: int, seed: int,
                temperature: float) -> list[list[Trajectory]]:
        """`group_size` trajectories per task with the current adapter version (checked)."""
        params = SamplingParams(temperature=temperature, max_tokens=self.args.max_tokens,
                                seed=seed, logprobs=0)
        groups = rollout(self.llm, tasks, params, group_size=group_size,
                         lora_request=LoRARequest(ADAPTER_NAME, self.version),
                         max_turns=self.args.max_turns,
                         max_total_tokens=self.args.max_total_tokens)
        stale = [t.lora_version for group in groups for t in group
                 if t.lora_version != self.version]
        if stale:
            raise RuntimeError(f"a rollout ran with adapter version {stale[0]!r}; the trainer "
                               f"handed over version {self.version}")
        return groups


# ---- the trainer --------------------------------------------------------------------------
@dataclass
class _Scored:
    """One process's sequences of a mini-batch with their advantages, and the old log-probs
    (temperature-scaled and raw) once computed."""

    trajectories: list[Trajectory]
    advantages: list[float]
    old: list[torch.Tensor] | None = None
    old_raw: list[torch.Tensor] | None = None


def _rows(values: torch.Tensor, batch: SequenceBatch) -> list[torch.Tensor]:
    """Each sequence's values over its own (unpadded) positions."""
    lengths = batch.attention_mask.sum(dim=1).tolist()
    return [row[:length].clone() for row, length in zip(values, lengths)]


def _padded(rows: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    for index, row in enumerate(rows):
        out[index, :len(row)] = row
    return out


class PolicyTrainer:
    """The policy (FSDP2-sharded under torchrun), its optimiser and the GRPO update."""

    def __init__(self, args: GRPOTrainArgs, world: World) -> None:
        self.args = args
        self.world = world
        dtype = resolve_dtype(args.dtype, world.device)
        base = policy_lib.load_base_model(args.model, dtype, world.device, args.seed,
                                          args.init_std)
        config = policy_lib.lora_config(args.targets, args.lora_rank, args.lora_alpha,
                                        base.config.is_moe)
        self.model = policy_lib.build_policy(base, config, args.seed, base_model=args.model)
        if world.size > 1:
            policy_lib.shard_policy(self.model)
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=args.lr,
                                           weight_decay=args.weight_decay)

    def adapter(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """(adapter_config.json contents, PEFT state dict): every rank must call it."""
        return (policy_lib.adapter_config(self.model),
                policy_lib.adapter_tensors(self.model))

    def save(self, directory: str | Path) -> None:
        """The adapter in the PEFT layout; every rank must call it, rank 0 writes."""
        state = policy_lib.full_adapter_state(self.model)
        if self.world.is_main:
            policy_lib.save_adapter(self.model, directory, state)

    # -- one batch ---------------------------------------------------------------------------
    def train(self, groups: list[list[Trajectory]]) -> dict[str, float]:
        """The update on a batch of groups (the same batch in every process): advantages, old
        log-probs, then `mini_batches` optimizer steps. Returns the step's statistics."""
        rewards = torch.tensor([[t.reward for t in group] for group in groups],
                               dtype=torch.float32)
        advantages = group_advantages(rewards, scale_by_std=self.args.scale_by_std)
        count = min(self.args.mini_batches, len(groups))
        bounds = [round(i * len(groups) / count) for i in range(count + 1)]
        shares = []
        for first, last in zip(bounds, bounds[1:]):
            mine = range(first + self.world.rank, last, self.world.size)
            shares.append(_Scored([t for g in mine for t in groups[g]],
                                  [float(a) for g in mine for a in advantages[g]]))
        if count > 1:
            for share in shares:
                self._old_logprobs(share)
        totals: dict[str, float] = {}
        for share in shares:
            for name, value in self._update(share).items():
                # Token counts add up over the mini-batches; the other figures are means.
                totals[name] = totals.get(name, 0.0) + (value if name == "tokens"
                                                        else value / count)
        return totals

    def _micro_batches(self, share: _Scored) -> list[tuple[list[int], SequenceBatch]]:
        """(sequence indices, batch) of each micro-batch of this process's share. Every
        process runs as many (FSDP's collectives run in each forward and backward): one
        with fewer sequences adds batches of a single masked-out token."""
        count = len(share.trajectories)
        size = self.args.micro_batch_size or max(count, 1)
        chunks = [list(range(start, min(start + size, count)))
                  for start in range(0, count, size)]
        (most,) = _all_reduce([float(len(chunks))], self.world, dist.ReduceOp.MAX)
        chunks += [[] for _ in range(max(int(most), 1) - len(chunks))]
        return [(chunk, policy_lib.sequence_batch([share.trajectories[i] for i in chunk],
                                                  self.world.device)
                 if chunk else policy_lib.empty_batch(self.world.device))
                for chunk in chunks]

    @torch.no_grad()
    def _old_logprobs(self, share: _Scored) -> None:
        share.old, share.old_raw = [], []
        for chunk, batch in self._micro_batches(share):
            logits = policy_lib.batch_logits(self.model, batch)
            if not chunk:
                continue
            scaled = token_logprobs(logits, batch.targets, self.args.temperature)
            share.old += _rows(scaled, batch)
            share.old_raw += _rows(self._raw(logits, batch, scaled), batch)

    def _raw(self, logits: torch.Tensor, batch: SequenceBatch,
             scaled: torch.Tensor) -> torch.Tensor:
        if self.args.temperature == 1.0:
            return scaled.detach()
        return token_logprobs(logits.detach(), batch.targets, 1.0)

    def _update(self, share: _Scored) -> dict[str, float]:
        """One optimizer step on this process's share of a mini-batch."""
        args = self.args
        local_tokens = float(sum(sum(t.loss_mask) for t in share.trajectories))
        (global_tokens,) = _all_reduce([local_tokens], self.world)
        self.optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(LOSS_STATS, 0.0)
        for chunk, batch in self._micro_batches(share):
            advantages = torch.tensor([share.advantages[i] for i in chunk] or [0.0],
                                      device=self.world.device)
            logits = policy_lib.batch_logits(self.model, batch)
            logprobs = token_logprobs(logits, batch.targets, args.temperature)
            if share.old is None:
                old, old_raw = logprobs.detach(), self._raw(logits, batch, logprobs)
            else:
                old = _padded([share.old[i] for i in chunk], logprobs)
                old_raw = _padded([share.old_raw[i] for i in chunk], logprobs)
            rollout_logprobs = batch.rollout_logprobs if args.temperature == 1.0 \
                else old - (old_raw - batch.rollout_logprobs)
            ref_logprobs = self._reference_logprobs(batch) if args.kl_coef > 0 else None
            loss, stats = policy_loss(
                logprobs, old, advantages, batch.loss_mask, clip_low=args.clip_low,
                clip_high=args.clip_high, rollout_logprobs=rollout_logprobs,
                tis_cap=args.tis_cap, ref_logprobs=ref_logprobs, kl_coef=args.kl_coef)
            tokens = batch.num_tokens
            scale = tokens / global_tokens if global_tokens else 0.0
            (loss * scale).backward()
            stats["loss"] = loss.item()
            for name in LOSS_STATS:
                sums[name] += stats.get(name, 0.0) * tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters, args.grad_clip)
        if global_tokens:
            self.optimizer.step()
        summed = _all_reduce([sums[name] for name in LOSS_STATS], self.world)
        result = {name: value / global_tokens if global_tokens else 0.0
                  for name, value in zip(LOSS_STATS, summed)}
        if args.kl_coef == 0:
            del result["kl"]
        result["grad_norm"] = float(_full_tensor(grad_norm))
        result["tokens"] = global_tokens
        return result

    @torch.no_grad()
    def _reference_logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        with self.model.disable_adapter():
            logits = policy_lib.batch_logits(self.model, batch)
        return token_logprobs(logits, batch.targets, self.args.temperature)


def _full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# ---- the loop -------------------------------------------------------------------------------
class Trainer(Protocol):
    def adapter(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]: ...
    def train(self, groups: list[list[Trajectory]]) -> dict[str, float]: ...
    def save(self, directory: str | Path) -> None: ...


class Rollouts(Protocol):
    def sync(self, config: dict[str, Any], tensors: dict[str, torch.Tensor],
             version: int) -> None: ...
    def rollout(self, tasks: list[dict[str, Any]], group_size: int, seed: int,
                temperature: float) -> list[list[Trajectory]]: ...


def sampling_seed(seed: int, step: int, round_index: int) -> int:
    return ((seed * 1_000_003 + step) * 101 + round_index) % 2**31


class GRPOLoop:
    """The steps of a run: rollouts from `rollouts`, updates by `trainer` (objects in this
    process, or handles of Ray actors), metrics and the adapter in `args.output`."""

    def __init__(self, args: GRPOTrainArgs, trainer: Trainer, rollouts: Rollouts,
                 world: World) -> None:
        self.args = args
        self.trainer = trainer
        self.rollouts = rollouts
        self.world = world
        self.tasks = TaskStream(args)
        self.held_out = self.tasks.held_out()
        self.version = 0
        self.output = Path(args.output)

    def sync(self) -> float:
        began = time.monotonic()
        config, tensors = self.trainer.adapter()
        self.version += 1
        self.rollouts.sync(config, tensors, self.version)
        return time.monotonic() - began

    def evaluate(self) -> float | None:
        """Held-out accuracy: the mean reward of greedy replies to the held-out tasks."""
        if not self.held_out:
            return None
        groups = self.rollouts.rollout(self.held_out, 1, self.args.seed, 0.0)
        return sum(group[0].reward for group in groups) / len(groups)

    def collect(self, step: int) -> tuple[list[list[Trajectory]], list[Trajectory], int]:
        """(the groups to train on, every trajectory sampled, rounds rolled out)."""
        args = self.args
        rounds = 1 + (args.max_resample_rounds if args.dynamic_sampling else 0)
        kept: list[list[Trajectory]] = []
        sampled: list[Trajectory] = []
        for round_index in range(rounds):
            tasks = self.tasks.draw(args.prompts_per_step, step, round_index)
            groups = self.rollouts.rollout(tasks, args.group_size,
                                           sampling_seed(args.seed, step, round_index),
                                           args.temperature)
            sampled += [t for group in groups for t in group]
            if not args.dynamic_sampling:
                return groups, sampled, 1
            rewards = torch.tensor([[t.reward for t in group] for group in groups])
            kept += [g for g, keep in zip(groups, keep_informative_groups(rewards).tolist())
                     if keep]
            if len(kept) >= args.prompts_per_step:
                return kept[:args.prompts_per_step], sampled, round_index + 1
        return kept, sampled, rounds

    def run(self) -> Path:
        """Every step, then the adapter; returns the output folder.

        metrics.jsonl has a line for step 0 (held-out accuracy before training) and one per
        step: reward_mean (over every trajectory sampled in the step), groups (trained on),
        groups_sampled, rollout_rounds, the loss's token means (loss, clip_fraction,
        ratio_mean, tis_weight_mean, mismatch_kl, mismatch_abs, and kl with --kl-coef),
        grad_norm, tokens (mask-1 tokens trained), response_tokens (sampled and environment
        tokens), lora_version (the adapter the rollouts ran with), eval_accuracy (null when
        not evaluated) and seconds (rollout_s, train_s, sync_s and the whole step)."""
        args = self.args
        started = time.monotonic()
        if self.world.is_main:
            self.output.mkdir(parents=True, exist_ok=True)
        self.sync()
        records: list[dict[str, Any]] = []
        accuracy = self.evaluate()
        records.append({"step": 0, "eval_accuracy": accuracy, "lora_version": self.version})
        self._write(records[-1], mode="w")
        for step in range(1, args.steps + 1):
            began = time.monotonic()
            groups, sampled, rounds = self.collect(step)
            rollout_seconds = time.monotonic() - began
            trained = time.monotonic()
            stats = self.trainer.train(groups) if groups else {}
            train_seconds = time.monotonic() - trained
            version = self.version
            sync_seconds = self.sync()
            out_of_time = args.max_minutes is not None \
                and time.monotonic() - started > 60 * args.max_minutes
            last = step == args.steps or self.world.agree(out_of_time)
            evaluate = last or (args.eval_every and step % args.eval_every == 0)
            accuracy = self.evaluate() if evaluate else None
            rewards = [t.reward for t in sampled]
            record = {
                "step": step,
                "reward_mean": sum(rewards) / len(rewards),
                "groups": len(groups),
                "groups_sampled": len(sampled) // args.group_size,
                "rollout_rounds": rounds,
                **stats,
                "response_tokens": sum(len(t.response_ids) for t in sampled),
                "lora_version": version,
                "eval_accuracy": accuracy,
                "rollout_s": round(rollout_seconds, 3),
                "train_s": round(train_seconds, 3),
                "sync_s": round(sync_seconds, 3),
                "seconds": round(time.monotonic() - began, 3),
            }
            records.append(record)
            self._write(record)
            logger.info("step %d reward %.3f%s clip %.3f tis %.3f mismatch_kl %.2e %.1f s",
                        step, record["reward_mean"],
                        "" if accuracy is None else f" held-out {accuracy:.3f}",
                        stats.get("clip_fraction", 0.0), stats.get("tis_weight_mean", 1.0),
                        stats.get("mismatch_kl", 0.0), record["seconds"])
            if last:
                break
        self.trainer.save(self.output / ADAPTER_DIR)
        if self.world.is_main:
            summary = {"args": dataclasses.asdict(args), "world_size": self.world.size,
                       "steps": records[-1]["step"], "first": records[0], "last": records[-1],
                       "seconds": round(time.monotonic() - started, 1)}
            (self.output / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
            plot_grpo(self.output / METRICS_FILE, self.output / PLOT_FILE)
        return self.output

    def _write(self, record: dict[str, Any], mode: str = "a") -> None:
        if self.world.is_main:
            with (self.output / METRICS_FILE).open(mode) as metrics:
                metrics.write(json.dumps(record) + "\n")


def train_grpo(args: GRPOTrainArgs) -> Path:
    """The whole run; returns the output folder (metrics.jsonl, adapter/, a summary)."""
    args.validate()
    if args.ray:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("--ray runs one trainer actor; training over several processes "
                             "is torchrun's (FSDP2): use one or the other")
        from muse.rl.ray_actors import train_with_ray

        return train_with_ray(args)
    world = init_world(args.device)
    trainer = PolicyTrainer(args, world)
    rollouts = RolloutWorker(args, world.device)
    return GRPOLoop(args, trainer, rollouts, world).run()


def run_from_args(args: argparse.Namespace) -> None:
    fields = {f.name for f in dataclasses.fields(GRPOTrainArgs)}
    out = train_grpo(GRPOTrainArgs(**{k: v for k, v in vars(args).items() if k in fields}))
    if not dist.is_initialized() or dist.get_rank() == 0:
        lines = (out / METRICS_FILE).read_text().splitlines()
        last = json.loads(lines[-1])
        accuracy = last.get("eval_accuracy")
        figure = f"; held-out accuracy {accuracy:.3f}" if accuracy is not None else ""
        print(f"adapter written to {out / ADAPTER_DIR}{figure}")
