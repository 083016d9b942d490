"""The products that read a block's input, computed together for one-row steps: the latent
MoE's router, pooler and shared expert in one stacked weight, and a layer's norm with the
product after it (`norm_linear`, the fused kernel forced on the CPU under the interpreter)."""

from __future__ import annotations

import pytest
import torch

from muse.kernels import norm_linear as norm_linear_module
from muse.kernels.backends import select_backends
from muse.model.decoder import EngineDecoderLayer
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
    stacked = moe.input_weight()
    layers = [moe.gate, moe.pooler, moe.shared_expert.gate_up_proj]
    assert stacked is not None
    assert stacked.shape[0] == sum(layer.weight.shape[0] for layer in layers)
    start = 0
    for layer in layers:  # views: what the loader writes into a layer lands in the stack
        rows = layer.weight.shape[0]
        assert layer.weight.data_ptr() == stacked[start].data_ptr()
        assert torch.equal(stacked[start:start + rows], layer.weight)
        start += rows


def test_one_row_through_the_stacked_weight_equals_each_product() -> None:
    """A row alone (one product over the stack) gives what it gives inside a batch (each
    layer's own product), and a caller's `projected` is used as given."""
    moe = _tiny_moe()
    x = randn(3, moe.config.hidden_size, seed=9)
    together = moe(x)
    for i in range(3):
        alone = moe(x[i:i + 1])
        torch.testing.assert_close(alone, together[i:i + 1], rtol=1e-5, atol=1e-5)
    row = x[:1]
    projected = row @ moe.input_weight().T
    torch.testing.assert_close(moe(row, projected=projected), moe(row), rtol=0, atol=0)
    # A negative control: another projection changes the output.
    assert not torch.allclose(moe(row, projected=projected * 1.5), moe(row))


def test_an_adapted_layer_keeps_its_own_product() -> None:
    """With adapters attached (after loading) the stacked product is not taken: the adapter's
    delta is added by the layer's own forward."""
    moe = _tiny_moe()
    moe.pooler.lora = object()  # any attached adapter slots
    assert moe.input_weight() is None
    moe.pooler.lora = None
    assert moe.input_weight() is not None


@pytest.mark.parametrize("first_layer", [False, True], ids=["residual", "first-layer"])
def test_decoder_layer_norm_with_the_fused_kernel(monkeypatch: pytest.MonkeyPatch,
                                                  first_layer: bool) -> None:
    """The layer's norm and its MoE's input products from the fused kernel (forced on the
    CPU) against the backend's norm then the stacked product: the same residual, the normed
    row and the MoE's output within bf16's rounding."""
    config = get_preset("muse-spark-tiny").text_config
    layer = EngineDecoderLayer(config, 0, select_backends(CPU, "torch", "torch"),
                               torch.bfloat16, "model.layers.0")
    _fill(layer, seed=3)
    x = randn(1, config.hidden_size, seed=4).bfloat16()
    residual = None if first_layer else randn(1, config.hidden_size, seed=5).bfloat16()
    norm = layer.post_attention_layernorm
    h, summed, projected = layer._norm(x, residual, norm, layer.mlp)
    assert projected is not None  # one row, plain products: the twin path took them
    monkeypatch.setattr(norm_linear_module, "NORM_GEMV_ON", True)
    monkeypatch.setattr(norm_linear_module, "takes_gemv", lambda x, weight: True)
    fused_h, fused_sum, fused_projected = layer._norm(x, residual, norm, layer.mlp)
    eps = torch.finfo(torch.bfloat16).eps
    assert (fused_sum - summed).abs().max() <= eps * summed.abs().max()
    assert (fused_h - h).abs().max() <= 2 * eps * h.abs().max()
    torch.testing.assert_close(fused_projected.float(), projected.float(), rtol=0.02,
                               atol=0.02)
    torch.testing.assert_close(layer.mlp(fused_h, projected=fused_projected).float(),
                               layer.mlp(h, projected=projected).float(), rtol=0.03, atol=0.03)
    # Two rows never take a fused product.
    two = x.expand(2, -1).contiguous()
    assert layer._norm(two, None if first_layer else residual.expand(2, -1), norm,
                       layer.mlp)[2] is None
