"""The products that read a block's input, computed together for one-row steps: the latent
MoE's router, pooler and shared expert in one stacked weight."""

from __future__ import annotations

import pytest
import torch

from muse.kernels.backends import select_backends
from muse.model.moe import EngineMoE
from muse.presets import get_preset
from tests.layers.common import randn

CPU = torch.device("cpu")


def _fill(module: torch.nn.Module, seed: int) -> None:
    """Random weights of order one per output (norm gains near one)."""
    with torch.no_grad():
        for i, (name, param) in enumerate(module.named_parameters()):
            values = randn(*param.shape, seed=seed + i) / param.shape[-1] ** 0.5
            param.copy_(values + 1 if "norm" in name else values)


def _tiny_moe(dtype: torch.dtype = torch.float32) -> EngineMoE:
    config = get_preset("muse-spark-tiny").text_config
    assert config.moe_latent_size and config.num_shared_experts  # every input product
    moe = EngineMoE(config, select_backends(CPU, "torch", "torch").moe, dtype, "mlp")
    _fill(moe, seed=0)
    return moe


def test_router_pooler_and_shared_expert_share_one_weight() -> None:
    moe = _tiny_moe()
    stacked = moe.stacked_input_weight()
    layers = [moe.gate, moe.pooler, moe.shared_expert.gate_up_proj]
    assert stacked is not None
    assert stacked.shape[0] == sum(layer.weight.shape[0] for layer in layers)
    start = 0
    for layer in layers:  # views: what the loader writes into a layer lands in the stack
        rows = layer.weight.shape[0]
        assert layer.weight.data_ptr() == stacked[start].data_ptr()
        assert torch.equal(stacked[start:start + rows], layer.weight)
        start += rows


def test_one_row_through_the_stacked_weight_equals_each_product(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A row alone (one product over the stack) gives what it gives inside a batch (each
    layer's own product)."""
    moe = _tiny_moe()
    x = randn(3, moe.config.hidden_size, seed=9)
    together = moe(x)
    for i in range(3):
        alone = moe(x[i:i + 1])
        torch.testing.assert_close(alone, together[i:i + 1], rtol=1e-5, atol=1e-5)
    # A negative control: the one-row path does read the stack (another stack, another
    # output), the batched one does not.
    stack = moe.stacked_input_weight()
    monkeypatch.setattr(moe, "stacked_input_weight", lambda: stack * 1.5)
    assert not torch.allclose(moe(x[:1]), together[:1])
    torch.testing.assert_close(moe(x), together, rtol=0, atol=0)


def test_an_adapted_layer_keeps_its_own_product() -> None:
    """With adapters attached (after loading) the stacked product is not taken: the adapter's
    delta is added by the layer's own forward."""
    moe = _tiny_moe()
    moe.pooler.lora = object()  # any attached adapter slots
    assert moe.stacked_input_weight() is None
    moe.pooler.lora = None
    assert moe.stacked_input_weight() is not None
