"""The trainer side of a GRPO step: the policy (the reference decoder with a LoRA adapter,
FSDP2-sharded under torchrun) scores the trajectories and takes the optimizer step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from muse.rl import policy as policy_lib
from muse.rl.grpo import group_advantages, policy_loss, token_logprobs
from muse.rl.policy import SequenceBatch
from muse.rl.rollout import Trajectory
from muse.rl.trainer_options import GRPOTrainArgs
from muse.rl.world import World, all_reduce_values, resolve_dtype

LOSS_STATS = ("loss", "clip_fraction", "ratio_mean", "tis_weight_mean", "mismatch_kl",
              "mismatch_abs", "kl")


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
        (most,) = all_reduce_values([float(len(chunks))], self.world, dist.ReduceOp.MAX)
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
        (global_tokens,) = all_reduce_values([local_tokens], self.world)
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
        summed = all_reduce_values([sums[name] for name in LOSS_STATS], self.world)
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
