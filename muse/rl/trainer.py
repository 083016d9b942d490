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
import time
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from muse.rl.grpo import keep_informative_groups, pass_at_k
from muse.rl.plot import PLOT_FILE, plot_grpo
from muse.rl.rollout import Trajectory
from muse.rl.policy_trainer import PolicyTrainer
from muse.rl.rollout_worker import RolloutWorker
from muse.rl.task_stream import TaskStream
from muse.rl.trainer_options import (ADAPTER_DIR, METRICS_FILE, SUMMARY_FILE,
                                     GRPOTrainArgs)
from muse.rl.world import World, init_world

logger = logging.getLogger("muse.rl")


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

    def headroom(self) -> dict[str, float]:
        """With --eval-pass-at K: `pass_at_k` of K replies per held-out task sampled at the
        training temperature (logged), else {}."""
        k = self.args.eval_pass_at
        if not (k and self.held_out):
            return {}
        groups = self.rollouts.rollout(self.held_out, k, self.args.seed + 1,
                                       self.args.temperature)
        measured = pass_at_k([[t.reward for t in group] for group in groups])
        logger.info("held-out pass@%d %.3f, sample mean %.3f", k, measured["eval_pass_at_k"],
                    measured["eval_sample_mean"])
        return measured

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
        not evaluated), with --eval-pass-at eval_pass_at_k and eval_sample_mean (step 0 and
        the last step) and seconds (rollout_s, train_s, sync_s and the whole step)."""
        args = self.args
        started = time.monotonic()
        if self.world.is_main:
            self.output.mkdir(parents=True, exist_ok=True)
        self.sync()
        records: list[dict[str, Any]] = []
        accuracy = self.evaluate()
        records.append({"step": 0, "eval_accuracy": accuracy, **self.headroom(),
                        "lora_version": self.version})
        if accuracy is not None:
            logger.info("step 0 held-out %.3f", accuracy)
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
                **(self.headroom() if last else {}),
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
    joined = not dist.is_initialized()
    world = init_world(args.device)
    trainer = PolicyTrainer(args, world)
    rollouts = RolloutWorker(args, world.device)
    output = GRPOLoop(args, trainer, rollouts, world).run()
    if joined and dist.is_initialized():
        # Leave torchrun's world together: a process that exits with the group alive can
        # abort in the backend's threads at interpreter teardown.
        dist.barrier()
        dist.destroy_process_group()
    return output


def run_from_args(args: argparse.Namespace) -> None:
    fields = {f.name for f in dataclasses.fields(GRPOTrainArgs)}
    out = train_grpo(GRPOTrainArgs(**{k: v for k, v in vars(args).items() if k in fields}))
    if int(os.environ.get("RANK", "0")) == 0:  # torchrun's rank (the world is left by now)
        lines = (out / METRICS_FILE).read_text().splitlines()
        last = json.loads(lines[-1])
        accuracy = last.get("eval_accuracy")
        figure = f"; held-out accuracy {accuracy:.3f}" if accuracy is not None else ""
        print(f"adapter written to {out / ADAPTER_DIR}{figure}")
