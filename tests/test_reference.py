"""Behaviour of the reference decoder that the engine and training rely on."""

import math

import pytest
import torch

from muse.config import SLIDING
from muse.presets import get_preset
from muse.reference.model import MuseForCausalLM


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = MuseForCausalLM(get_preset("muse-spark-tiny").text_config)
    model.init_weights(seed=1, std=0.1)
    return model.eval()


def test_padding_does_not_change_real_tokens(model):
    ids = torch.randint(0, model.config.vocab_size, (3, 50))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding
    mask[2, 41:] = 0  # right padding
    out = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out[1, 7:], model(ids[1:2, 7:]).logits[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[2, :41], model(ids[2:3, :41]).logits[0], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()


def test_causal_and_sliding_window(model):
    window = model.config.sliding_window
    ids = torch.randint(0, model.config.vocab_size, (1, 4 * window))
    base = model(ids).logits
    # Changing a late token never changes earlier logits (causality).
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % model.config.vocab_size
    torch.testing.assert_close(model(changed).logits[0, :-1], base[0, :-1])
    # With every layer sliding, a token further back than the window cannot be seen at all.
    sliding_only = MuseForCausalLM(model.config.__class__(
        **{**model.config.to_dict(), "layer_types": [SLIDING] * model.config.num_hidden_layers,
           "rope_parameters": model.config.rope_parameters}))
    sliding_only.load_state_dict(model.state_dict())
    first = sliding_only(ids).logits
    changed = ids.clone()
    changed[0, 0] = (changed[0, 0] + 1) % model.config.vocab_size
    # Position p sees [p - window + 1, p]; stacked layers reach back layers * (window - 1).
    reach = model.config.num_hidden_layers * (window - 1)
    later = sliding_only(changed).logits
    if reach + 1 < ids.shape[1]:
        torch.testing.assert_close(later[0, reach + 1:], first[0, reach + 1:])
    assert not torch.allclose(later[0, :window], first[0, :window])


def test_hidden_states_of_chosen_layers(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    out = model(ids, hidden_layers=[1, -1])
    assert sorted(out.hidden_states) == [1, model.config.num_hidden_layers - 1]
    last = out.hidden_states[model.config.num_hidden_layers - 1]
    torch.testing.assert_close(model.lm_head(model.model.norm(last)), out.logits)


def test_differentiable(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for n, g in grads.items()
               if "experts" not in n)
    assert grads["model.layers.0.mlp.pooler.weight"].abs().sum() > 0
    assert grads["model.layers.0.mlp.experts.norm_weight"].abs().sum() > 0
    assert math.isfinite(loss.item())
    model.zero_grad()


def test_seeded_init_is_reproducible():
    config = get_preset("muse-spark-tiny").text_config
    a, b = MuseForCausalLM(config), MuseForCausalLM(config)
    a.init_weights(seed=3)
    b.init_weights(seed=3)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
