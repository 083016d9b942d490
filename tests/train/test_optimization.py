"""The learning-rate schedule and the router load-balancing loss."""

from __future__ import annotations

import pytest
import torch

from muse.presets import get_preset
from muse.reference.model import MuseForCausalLM
from muse.train.router_balance import RouterLoadBalance
from muse.train.schedule import learning_rate


def test_warmup_then_cosine_to_the_floor() -> None:
    rates = [learning_rate(step, 1e-3, 10, 110, 0.1) for step in range(130)]
    assert rates[0] == pytest.approx(1e-4)
    assert rates[9] == pytest.approx(1e-3)
    assert rates[60] == pytest.approx(0.55e-3)
    assert rates[110] == pytest.approx(1e-4) and rates[129] == pytest.approx(1e-4)
    decay = rates[9:111]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


@torch.no_grad()
def test_balance_loss_is_one_when_even_and_grows_when_concentrated() -> None:
    text = get_preset("muse-spark-tiny").text_config
    model = MuseForCausalLM(text)
    model.init_weights(0)
    balance = RouterLoadBalance(model, top_k=text.num_experts_per_tok)
    assert balance.loss() is None
    model(torch.randint(0, text.vocab_size, (2, 16)))
    assert len(balance.logits) == text.num_hidden_layers
    # Small random router weights route almost evenly.
    assert 0.9 < float(balance.loss()) < 1.2
    assert balance.logits == []
    concentrated = torch.zeros(64, text.num_experts)
    concentrated[:, 0] = 10.0
    balance.logits = [concentrated]
    assert float(balance.loss()) > 3.0
    balance.remove()
    model(torch.randint(0, text.vocab_size, (2, 16)))
    assert balance.loss() is None


@pytest.mark.parametrize(("top_k", "norm"), [(2, True), (3, False)])
def test_all_experts_at_once_gives_the_loops_sums_and_gradients(top_k: int, norm: bool) -> None:
    """`Experts.all_experts_forward` (training of few experts) against the per-expert loop:
    the same outputs and gradients (weights, inputs and routing weights) in float32, with
    experts that no token chose."""
    from muse.config import TextConfig
    from muse.reference.layers import Experts

    config = TextConfig(hidden_size=32, num_experts=6, num_experts_per_tok=top_k,
                        moe_intermediate_size=24, moe_latent_size=16, expert_norm=norm)
    experts = Experts(config)
    gen = torch.Generator().manual_seed(top_k)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3 + (1.0 if param.dim() == 2
                                                                         else 0.0))
    x = torch.randn(9, 16, generator=gen)
    ids = torch.stack([torch.randperm(4, generator=gen)[:top_k] for _ in range(9)])  # 4, 5 idle
    weights = torch.rand(9, top_k, generator=gen)
    results = []
    for at_once in (False, True):
        experts.all_experts_at_once = at_once
        experts.zero_grad()
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = experts(xi, ids, wi)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out, xi.grad, wi.grad] + [p.grad for p in experts.parameters()])
    for loop, at_once in zip(*results):
        torch.testing.assert_close(at_once, loop, rtol=1e-5, atol=1e-5)
    assert results[1][3][4:].abs().sum() == 0  # idle experts get no gradient


def test_the_trainer_runs_few_experts_at_once() -> None:
    from muse.reference.layers import Experts
    from muse.train.pretrain import build_model

    model = build_model(get_preset("muse-spark-tiny"), seed=0)
    modules = [m for m in model.modules() if isinstance(m, Experts)]
    assert modules and all(m.all_experts_at_once for m in modules)
