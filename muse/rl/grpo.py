"""GRPO loss math: group-relative advantages, the clipped policy loss and token log-probs.

Plain torch on tensors the trainer has already gathered, so the math is tested apart from
the engine that produces rollouts and the model that produces log-probs.

Shapes: B sequences of T tokens; `mask` [B, T] is 1 on tokens the model sampled and that
count (0 on prompt, padding and tool/environment text, which the policy never emitted).
"""

from __future__ import annotations

import torch

# verl clamps the k3 estimator to this range so one token with a huge log-ratio cannot
# dominate the loss.
KL_CLAMP = 10.0


def group_advantages(rewards: torch.Tensor, scale_by_std: bool = True, eps: float = 1e-6
                     ) -> torch.Tensor:
    """Advantages [num_groups, G] of rewards [num_groups, G] (one row per prompt).

    Each reward minus its group's mean, divided by (the group's std + eps) unless
    `scale_by_std` is False (Dr.GRPO, which drops the division because it up-weights groups
    whose rewards barely differ). The std is the unbiased one (Bessel's correction,
    `torch.std`'s default), as verl's `compute_grpo_outcome_advantage` uses.

    Groups of one sample get 0: with no other sample there is no baseline to compare with
    (verl instead passes such a reward through unchanged). Groups whose rewards are all equal
    get 0 as well, since reward minus mean is 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale_by_std:
        return centered
    return centered / (rewards.std(dim=1, keepdim=True) + eps)


def keep_informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """bool [num_groups]: False where every reward of the group is equal.

    Such a group has zero advantage everywhere and adds no gradient, only tokens to the
    loss's denominator; DAPO's dynamic sampling drops it and samples more prompts instead.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    return ~(rewards == rewards[:, :1]).all(dim=1)


def pass_at_k(rewards: list[list[float]]) -> dict[str, float]:
    """Of K samples per task: eval_pass_at_k, the share of tasks with a fully right sample
    (reward 1), and eval_sample_mean, the mean reward. GRPO learns only from groups with a
    right sample, so pass@K bounds the greedy accuracy its sharpening can reach."""
    samples = [reward for group in rewards for reward in group]
    return {"eval_pass_at_k": sum(max(group) >= 1.0 for group in rewards) / len(rewards),
            "eval_sample_mean": sum(samples) / len(samples)}


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of `values` over tokens where mask != 0, weighted by mask; 0.0 on an empty mask."""
    weights = mask.to(values.dtype)
    total = weights.sum()
    if total.item() == 0:
        return 0.0
    return (torch.where(mask != 0, values * weights, 0.0).sum() / total).item()


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.28,
                rollout_logprobs: torch.Tensor | None = None, tis_cap: float = 2.0,
                ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """The PPO clipped objective with clip-higher, as a token mean over the whole batch.

    logprobs [B, T] (with grad), old_logprobs [B, T] (the trainer's log-probs before this
    update), advantages [B] (one per sequence, the same for all its tokens), mask [B, T].

    Per token: -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A) with
    ratio = exp(logprobs - old_logprobs). A wider upper clip (DAPO) lets unlikely tokens of
    good answers grow faster, which keeps the policy's entropy from collapsing.

    rollout_logprobs: the engine's log-probs of the same tokens. The engine and the trainer
    compute different numbers for the same weights (kernels, precision, batching), so the
    samples come from a slightly different policy; the policy term of each token is weighted
    by the truncated importance weight min(exp(old - rollout), tis_cap), detached.

    ref_logprobs with kl_coef > 0: adds kl_coef * k3(ref, logprobs) per token, where
    k3 = exp(ref - logp) - (ref - logp) - 1 clamped to [-10, 10] (verl's "low_var_kl"), an
    unbiased, never negative estimate of KL(policy || reference) on the sampled tokens.

    Aggregation: sum(loss * mask) / sum(mask) over every token of the batch, so each token
    weighs the same whatever its sequence's length. An all-zero mask gives a zero loss that
    still has a grad_fn when logprobs requires grad, so every rank can call backward.

    Stats (python floats, masked means): clip_fraction (tokens whose clipped term is the
    active one, so they get no gradient), ratio_mean, tis_weight_mean (1.0 without
    rollout_logprobs), kl (when the KL term is used), and with rollout_logprobs the
    train/rollout mismatch: mismatch_kl = mean(exp(r) - r - 1) with
    r = rollout_logprobs - old_logprobs (k3 estimate of KL(old || rollout)) and
    mismatch_abs = mean(|old_logprobs - rollout_logprobs|).
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for name, tensor in (("old_logprobs", old_logprobs), ("mask", mask),
                         ("rollout_logprobs", rollout_logprobs), ("ref_logprobs", ref_logprobs)):
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} must have the shape of logprobs {tuple(logprobs.shape)}, "
                             f"got {tuple(tensor.shape)}")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B] = [{logprobs.shape[0]}], "
                         f"got shape {tuple(advantages.shape)}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the reference policy's log-probs); "
                         "pass them or set kl_coef=0")
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    # Masked tokens (padding, tool text) may hold anything, NaN included; cutting them off
    # here keeps both the loss and the gradient of the counted tokens free of them.
    logprobs = torch.where(mask != 0, logprobs.to(dtype), 0.0)
    old_logprobs = old_logprobs.detach().to(dtype)
    advantage = advantages.detach().to(dtype)[:, None]

    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantage * ratio
    clipped = -advantage * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(unclipped, clipped)

    if rollout_logprobs is not None:
        tis_weight = torch.clamp(torch.exp(old_logprobs - rollout_logprobs.detach().to(dtype)),
                                 max=tis_cap)
        per_token = per_token * tis_weight
    else:
        tis_weight = torch.ones_like(old_logprobs)

    kl = None
    if kl_coef > 0 and ref_logprobs is not None:
        log_ratio = ref_logprobs.detach().to(dtype) - logprobs
        kl = torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -KL_CLAMP, KL_CLAMP)
        per_token = per_token + kl_coef * kl

    weights = mask.to(dtype)
    # `where`, not a product: a masked token's loss may be NaN or inf (from its old or rollout
    # log-probs), and 0 * NaN is NaN.
    total = torch.where(mask != 0, per_token * weights, 0.0).sum()
    count = weights.sum()
    loss = total / count if count.item() != 0 else total

    with torch.no_grad():
        stats = {"clip_fraction": _masked_mean((clipped > unclipped).to(dtype), mask),
                 "ratio_mean": _masked_mean(ratio, mask),
                 "tis_weight_mean": _masked_mean(tis_weight, mask)}
        if kl is not None:
            stats["kl"] = _masked_mean(kl, mask)
        if rollout_logprobs is not None:
            rollout_minus_old = rollout_logprobs.to(dtype) - old_logprobs
            stats["mismatch_kl"] = _masked_mean(
                torch.exp(rollout_minus_old) - rollout_minus_old - 1, mask)
            stats["mismatch_abs"] = _masked_mean(rollout_minus_old.abs(), mask)
    return loss, stats


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
                   ) -> torch.Tensor:
    """float32 [B, T]: log softmax(logits / temperature) at `tokens`.

    logits [B, T, V] are the ones that predict tokens[:, t]. The sampler draws from the
    temperature-scaled distribution, so the trainer must score tokens under the same
    temperature or the importance ratios compare different distributions.

    The float32 copy is made one sequence at a time, so only one [T, V] float32 block exists
    at once without grad (with grad, autograd keeps each block for the backward pass).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score sampled tokens, got {temperature}")
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(f"logits must be [B, T, V] and tokens [B, T], got "
                         f"{tuple(logits.shape)} and {tuple(tokens.shape)}")
    rows = []
    for row_logits, row_tokens in zip(logits, tokens):
        scaled = row_logits.float() / temperature
        picked = scaled.gather(-1, row_tokens.long()[:, None]).squeeze(-1)
        rows.append(picked - torch.logsumexp(scaled, dim=-1))
    if not rows:
        return logits.new_zeros(tokens.shape, dtype=torch.float32)
    return torch.stack(rows)
