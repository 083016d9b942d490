"""The router's GEMV and the routing in one launch (`router_gemv_triton`): the same weights and
ids, bit for bit, as the two kernels it replaces (`dense_gemv`, then `route_topk_triton`), close
to the twin `route_topk_torch(F.linear(x, w))`; its arrival counter is left at zero for the
next call; and the MoE layer takes it only for a plain router weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from muse.kernels.gemv_triton import GemvTiles, dense_gemv, split_counters  # noqa: E402
from muse.kernels.router_gemv_triton import gate_route_topk_triton  # noqa: E402
from muse.kernels.routing import route_topk_torch  # noqa: E402
from muse.kernels.routing_triton import route_topk_triton  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402

# (experts, hidden, top_k, scoring, normalize): an odd expert count (the last program holds one
# row), a hidden width past one 2048-input step, sigmoid scoring.
CASES = [
    (8, 64, 2, "softmax", True),
    (21, 48, 4, "softmax", False),
    (16, 2100, 8, "sigmoid", True),
    (64, 256, 1, "softmax", True),
]


def _operands(experts: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    weight = (torch.randn(experts, hidden, generator=gen) * hidden ** -0.5).to(DEVICE,
                                                                                torch.bfloat16)
    return x, weight


@pytest.mark.parametrize("case", CASES, ids=lambda c: "E{}_H{}_k{}_{}_{}".format(*c))
def test_one_launch_routes_as_the_two_kernels(case) -> None:
    experts, hidden, top_k, scoring, normalize = case
    x, weight = _operands(experts, hidden, seed=experts + hidden)
    # The fused kernel's tiles: two rows a program, K walked by one program (never split).
    block_k = max(16, min(2048, triton.next_power_of_2(hidden)))
    logits = dense_gemv(x[0], weight, tiles=GemvTiles(2, block_k, 4))
    want_weights, want_ids = route_topk_triton(logits[None], top_k, scoring, normalize)
    for _ in range(2):  # the second call finds the arrival counter back at zero
        weights, ids = gate_route_topk_triton(x, weight, top_k, scoring, normalize)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    assert int(split_counters(x.device, 1)[0]) == 0
    twin_weights, twin_ids = route_topk_torch(F.linear(x, weight), top_k, scoring, normalize)
    assert torch.equal(ids, twin_ids)
    torch.testing.assert_close(weights, twin_weights, rtol=1e-2, atol=1e-3)


def test_refuses_more_than_one_row() -> None:
    x, weight = _operands(8, 32, seed=1)
    with pytest.raises(ValueError, match="one row"):
        gate_route_topk_triton(torch.cat([x, x]), weight, 2, "softmax", True)


def test_the_moe_layer_routes_in_the_fused_kernel_only_for_a_plain_router(monkeypatch) -> None:
    """`EngineMoE._route`: the backend's one-launch router for a plain weight where the
    kernel takes the row, the router layer and routing otherwise."""
    import dataclasses

    from muse.config import TextConfig
    from muse.kernels.backends import MOE_BACKENDS
    from muse.model import moe as moe_module

    config = TextConfig(hidden_size=24, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=16, moe_latent_size=8)
    calls: list[str] = []

    def fused(x, weight, top_k, scoring, normalize):
        calls.append("fused")
        assert weight is layer.gate.weight and top_k == 2
        return torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.long)

    backend = dataclasses.replace(MOE_BACKENDS["torch"](), gate_route_topk=fused)
    layer = moe_module.EngineMoE(config, backend, torch.float32, "mlp")
    x = torch.randn(1, 24)
    monkeypatch.setattr(moe_module, "takes_fused_router", lambda x, weight: True)
    assert layer._route(x)[0].sum() == 2 and calls == ["fused"]
    layer.gate.lora = object()  # an adapter on the router: its delta must be added
    monkeypatch.setattr(layer.gate, "forward", lambda x: torch.zeros(1, 8))
    weights, ids = layer._route(x)
    assert calls == ["fused"] and ids.shape == (1, 2)
    monkeypatch.setattr(moe_module, "takes_fused_router", lambda x, weight: False)
    layer.gate.lora = None
    layer._route(x)
    assert calls == ["fused"]
