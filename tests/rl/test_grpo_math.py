"""GRPO math against hand-computed values and a naive per-token loop in float64."""

from __future__ import annotations

import math

import pytest
import torch

from muse.rl.grpo import group_advantages, keep_informative_groups, policy_loss, token_logprobs


def test_advantages_match_hand_computed_values() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    advantages = group_advantages(rewards)
    # Group 2: mean 0.25, unbiased std sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5.
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [-0.25, -0.25, -0.25, 0.75], [0.0] * 4])
    expected[0] /= math.sqrt(1 / 3) + 1e-6  # unbiased std of [1, 0, 0, 1] is sqrt(1/3)
    expected[1] /= 0.5 + 1e-6
    torch.testing.assert_close(advantages, expected)


def test_advantages_use_the_unbiased_std() -> None:
    rewards = torch.tensor([[0.0, 1.0]])
    # Biased std would be 0.5 (advantages +-1); unbiased is sqrt(0.5) (advantages +-0.7071).
    torch.testing.assert_close(group_advantages(rewards, eps=0.0),
                               torch.tensor([[-1 / math.sqrt(2), 1 / math.sqrt(2)]]))


def test_dr_grpo_only_subtracts_the_mean() -> None:
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]])
    torch.testing.assert_close(group_advantages(rewards, scale_by_std=False),
                               torch.tensor([[-0.25, -0.25, -0.25, 0.75], [-3.0, -1.0, 1.0, 3.0]]))


def test_groups_of_one_and_equal_rewards_get_zero_advantage() -> None:
    singles = torch.tensor([[3.0], [-1.0]])
    assert torch.equal(group_advantages(singles), torch.zeros(2, 1))
    assert torch.equal(group_advantages(singles, scale_by_std=False), torch.zeros(2, 1))
    equal = torch.full((3, 5), 0.7)
    assert torch.equal(group_advantages(equal), torch.zeros(3, 5))


def test_advantages_reject_a_flat_reward_vector() -> None:
    with pytest.raises(ValueError, match="num_groups, G"):
        group_advantages(torch.tensor([1.0, 0.0]))


def test_keep_informative_groups_drops_groups_of_equal_rewards() -> None:
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.4]])
    assert keep_informative_groups(rewards).tolist() == [False, True, False, True]
    assert keep_informative_groups(torch.tensor([[1.0], [0.0]])).tolist() == [False, False]


def naive_loss(logprobs, old, advantages, mask, clip_low, clip_high, rollout=None, tis_cap=2.0,
               ref=None, kl_coef=0.0) -> float:
    """The loss written out token by token in python floats."""
    total = count = 0.0
    for b in range(len(logprobs)):
        for t in range(len(logprobs[b])):
            if not mask[b][t]:
                continue
            ratio = math.exp(logprobs[b][t] - old[b][t])
            clipped = min(max(ratio, 1 - clip_low), 1 + clip_high)
            loss = -min(ratio * advantages[b], clipped * advantages[b])
            if rollout is not None:
                loss *= min(math.exp(old[b][t] - rollout[b][t]), tis_cap)
            if kl_coef:
                log_ratio = ref[b][t] - logprobs[b][t]
                loss += kl_coef * min(max(math.exp(log_ratio) - log_ratio - 1, -10), 10)
            total += loss * mask[b][t]
            count += mask[b][t]
    return total / count


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_policy_loss_matches_a_naive_loop(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    shape = (4, 9)

    def noise(scale: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float64) * scale

    old = -torch.rand(shape, generator=generator, dtype=torch.float64) * 3
    logprobs = old + noise(0.3)  # ratios spread over both clip bounds
    rollout = old + noise(0.5)
    ref = old + noise(0.4)
    advantages = torch.randn(4, generator=generator, dtype=torch.float64)
    mask = (torch.rand(shape, generator=generator) < 0.7).double()
    for kwargs in ({}, {"rollout_logprobs": rollout},
                   {"rollout_logprobs": rollout, "ref_logprobs": ref, "kl_coef": 0.05},
                   {"clip_low": 0.1, "clip_high": 0.5, "tis_cap": 1.5, "rollout_logprobs": rollout}):
        loss, _ = policy_loss(logprobs, old, advantages, mask, **kwargs)
        expected = naive_loss(
            logprobs.tolist(), old.tolist(), advantages.tolist(), mask.tolist(),
            kwargs.get("clip_low", 0.2), kwargs.get("clip_high", 0.28),
            rollout.tolist() if "rollout_logprobs" in kwargs else None,
            kwargs.get("tis_cap", 2.0), ref.tolist(), kwargs.get("kl_coef", 0.0))
        assert loss.dtype == torch.float64
        assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def _one_token_each(ratios: list[float], advantages: list[float]):
    logprobs = torch.tensor([[math.log(r)] for r in ratios], dtype=torch.float64,
                            requires_grad=True)
    old = torch.zeros(len(ratios), 1, dtype=torch.float64)
    return logprobs, old, torch.tensor(advantages, dtype=torch.float64), torch.ones_like(old)


def test_clip_higher_is_asymmetric() -> None:
    # ratio 1.25, A > 0: inside the upper bound 1.28 (a symmetric 0.2 clip would cut it);
    # ratio 1.3, A > 0: clipped at 1.28; ratio 0.75, A < 0: clipped at 0.8;
    # ratio 0.75, A > 0 and ratio 1.3, A < 0: the unclipped (pessimistic) term is active.
    ratios = [1.25, 1.3, 0.75, 0.75, 1.3]
    advantages = [1.0, 1.0, -1.0, 1.0, -1.0]
    logprobs, old, advantage, mask = _one_token_each(ratios, advantages)
    per_token = []
    for index in range(len(ratios)):
        single = torch.zeros_like(mask)
        single[index] = 1
        loss, stats = policy_loss(logprobs, old, advantage, single)
        (grad,) = torch.autograd.grad(loss, logprobs)
        per_token.append((loss.item(), grad[index, 0].item(), stats["clip_fraction"]))
    assert per_token[0] == pytest.approx((-1.25, -1.25, 0.0))
    assert per_token[1] == pytest.approx((-1.28, 0.0, 1.0))
    assert per_token[2] == pytest.approx((0.8, 0.0, 1.0))
    assert per_token[3] == pytest.approx((-0.75, -0.75, 0.0))
    assert per_token[4] == pytest.approx((1.3, 1.3, 0.0))
    _, stats = policy_loss(logprobs, old, advantage, mask)
    assert stats["clip_fraction"] == pytest.approx(2 / 5)
    assert stats["ratio_mean"] == pytest.approx(sum(ratios) / 5)
    # With a symmetric clip the 1.25 token is clipped as well.
    _, symmetric = policy_loss(logprobs, old, advantage, mask, clip_high=0.2)
    assert symmetric["clip_fraction"] == pytest.approx(3 / 5)


def test_truncated_importance_weights_are_capped_and_detached() -> None:
    logprobs, old, advantage, mask = _one_token_each([1.0, 1.0], [1.0, 1.0])
    # old - rollout: log 5 (weight capped at 2) and log 1.5 (weight 1.5).
    rollout = torch.tensor([[-math.log(5)], [-math.log(1.5)]], dtype=torch.float64,
                           requires_grad=True)
    loss, stats = policy_loss(logprobs, old, advantage, mask, rollout_logprobs=rollout)
    assert loss.item() == pytest.approx(-(2.0 + 1.5) / 2)
    assert stats["tis_weight_mean"] == pytest.approx(1.75)
    logprob_grad, rollout_grad = torch.autograd.grad(loss, [logprobs, rollout], allow_unused=True)
    assert logprob_grad[:, 0].tolist() == pytest.approx([-1.0, -0.75])
    assert rollout_grad is None
    _, capped = policy_loss(logprobs, old, advantage, mask, rollout_logprobs=rollout, tis_cap=1.2)
    assert capped["tis_weight_mean"] == pytest.approx(1.2)


def test_masked_tool_tokens_change_nothing() -> None:
    generator = torch.Generator().manual_seed(3)
    old = -torch.rand(2, 6, generator=generator, dtype=torch.float64)
    logprobs = (old + 0.1 * torch.randn(2, 6, generator=generator, dtype=torch.float64))
    mask = torch.tensor([[0, 1, 1, 0, 0, 1], [0, 0, 1, 1, 1, 0]], dtype=torch.float64)
    advantages = torch.tensor([0.7, -1.2], dtype=torch.float64)
    rollout = old + 0.05

    def loss_and_grad(values: torch.Tensor, old_values: torch.Tensor):
        values = values.clone().requires_grad_(True)
        loss, stats = policy_loss(values, old_values, advantages, mask, rollout_logprobs=rollout)
        (grad,) = torch.autograd.grad(loss, values)
        return loss.item(), grad, stats

    before, grad, stats = loss_and_grad(logprobs, old)
    changed, changed_old = logprobs.clone(), old.clone()
    changed[0, 3] = -40.0  # a tool-result token the policy never emitted
    changed[1, 0] = float("nan")  # padding may hold anything
    changed_old[1, 5] = float("nan")
    after, grad_after, stats_after = loss_and_grad(changed, changed_old)
    assert after == before
    assert stats_after == stats
    assert torch.equal(grad_after[mask != 0], grad[mask != 0])
    assert torch.all(grad_after[mask == 0] == 0)


def test_gradient_of_one_token_is_the_analytic_one() -> None:
    logprobs = torch.tensor([[-1.0, -0.5, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.1, -0.5, -2.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.3, -0.5, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-0.8, -0.5, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    advantage = torch.tensor([0.6], dtype=torch.float64)
    loss, stats = policy_loss(logprobs, old, advantage, mask, rollout_logprobs=rollout,
                              ref_logprobs=ref, kl_coef=0.1)
    (grad,) = torch.autograd.grad(loss, logprobs)
    ratio = math.exp(0.1)  # 1.105: inside [0.8, 1.28]
    weight = math.exp(0.2)  # old - rollout, under the cap
    log_ratio = -0.8 - (-1.0)
    # d/dlogp of -A * ratio * w is -A * ratio * w; of k3(ref - logp) it is 1 - exp(ref - logp).
    expected = -0.6 * ratio * weight + 0.1 * (1 - math.exp(log_ratio))
    assert grad[0, 0].item() == pytest.approx(expected, rel=1e-12)
    assert grad[0, 1:].tolist() == [0.0, 0.0]
    assert stats["kl"] == pytest.approx(math.exp(log_ratio) - log_ratio - 1)


def test_mismatch_stats() -> None:
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    logprobs = old.clone()
    advantage = torch.tensor([1.0])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    _, same = policy_loss(logprobs, old, advantage, mask, rollout_logprobs=old.clone())
    assert same["mismatch_kl"] == 0.0 and same["mismatch_abs"] == 0.0
    assert same["tis_weight_mean"] == 1.0
    rollout = torch.tensor([[-1.2, -1.9, -9.0]])
    _, stats = policy_loss(logprobs, old, advantage, mask, rollout_logprobs=rollout)
    k3 = [math.exp(r) - r - 1 for r in (-0.2, 0.1)]
    assert stats["mismatch_kl"] == pytest.approx(sum(k3) / 2, rel=1e-5)
    assert stats["mismatch_abs"] == pytest.approx(0.15, rel=1e-5)
    _, without = policy_loss(logprobs, old, advantage, mask)
    assert "mismatch_kl" not in without and "kl" not in without
    assert without["tis_weight_mean"] == 1.0


def test_an_empty_mask_gives_a_zero_loss_that_backpropagates() -> None:
    logprobs = torch.randn(2, 3, requires_grad=True)
    loss, stats = policy_loss(logprobs, logprobs.detach() + 0.1, torch.ones(2),
                              torch.zeros(2, 3))
    assert loss.item() == 0.0
    assert loss.grad_fn is not None
    loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros(2, 3))
    assert stats["clip_fraction"] == 0.0


def test_kl_coefficient_without_reference_is_an_error() -> None:
    logprobs = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, logprobs, torch.ones(1), torch.ones(1, 2), kl_coef=0.001)


def test_token_logprobs_match_log_softmax_gather() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=generator)
    tokens = torch.randint(0, 11, (3, 5), generator=generator)
    for temperature in (1.0, 0.7):
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(
            -1, tokens[..., None]).squeeze(-1)
        torch.testing.assert_close(token_logprobs(logits, tokens, temperature), expected)
    half = token_logprobs(logits.bfloat16(), tokens)
    assert half.dtype == torch.float32
    torch.testing.assert_close(
        half, torch.log_softmax(logits.bfloat16().float(), -1).gather(-1, tokens[..., None])[..., 0])


def test_token_logprobs_carry_the_gradient() -> None:
    logits = torch.randn(2, 3, 4, requires_grad=True)
    tokens = torch.tensor([[0, 1, 2], [3, 3, 0]])
    token_logprobs(logits, tokens).sum().backward()
    probabilities = torch.softmax(logits.detach(), -1)
    expected = torch.nn.functional.one_hot(tokens, 4).float() - probabilities
    torch.testing.assert_close(logits.grad, expected)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, tokens, temperature=0.0)
