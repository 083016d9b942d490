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
