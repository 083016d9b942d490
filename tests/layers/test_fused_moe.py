"""FusedMoE: at world size 1 it is the reference `LatentMoE`'s expert loop, loaded from the
stacked checkpoint layout or from Qwen3-MoE's per-expert tensors; for TP and EP ranks
(simulated in one process) it holds and reads exactly its part. The collectives at TP=2 and
EP=2 run in `test_parallel.py`."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from muse.distributed.config import ParallelConfig
from muse.kernels.moe import fused_experts_torch
from muse.layers.fused_moe import FusedMoE, per_expert_target
from muse.reference.layers import LatentMoE, route
from tests.layers.common import (
    FakeGroup,
    RecordingSlice,
    make_latent_moe,
    randn,
    write_safetensors,
)

EXACT = {"rtol": 0.0, "atol": 0.0}
# The reference visits experts in another order and accumulates with index_add; float32.
REFERENCE_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
NUM_EXPERTS, TOP_K, HIDDEN, LATENT, INTER = 8, 2, 24, 16, 12
STACKED = ("gate_up_proj", "down_proj", "norm_weight")


def make_reference(norm: bool, seed: int = 0) -> LatentMoE:
    return make_latent_moe(NUM_EXPERTS, TOP_K, HIDDEN, LATENT, INTER, norm, seed)


def load_stacked(layer: FusedMoE, reference: LatentMoE, wrap=lambda tensor: tensor) -> None:
    for name in STACKED:
        param = getattr(layer, name)
        if param is not None:
            param.weight_loader(param, wrap(getattr(reference.experts, name)))


def fused_layer_output(layer: FusedMoE, reference: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """The reference layer with `layer` in place of its expert loop."""
    weights, ids = route(reference.gate(x), reference.config)
    return reference.unpooler(layer(reference.pooler(x), weights, ids))


def use_parallel(monkeypatch: pytest.MonkeyPatch, config: ParallelConfig, rank: int,
                 ep_group: FakeGroup | None = None) -> None:
    """Layers built after this see `config` and sit at TP rank `rank` (and EP rank `rank`)."""
    module = "muse.layers.fused_moe"
    monkeypatch.setattr(f"{module}.get_parallel_config", lambda: config)
    monkeypatch.setattr(f"{module}.get_tp_group",
                        lambda: FakeGroup(config.tensor_parallel_size, rank))
    monkeypatch.setattr(f"{module}.get_ep_group",
                        lambda: ep_group or FakeGroup(config.expert_parallel_size, rank))


@pytest.mark.parametrize("norm", [True, False], ids=["expert_norm", "no_norm"])
def test_equals_reference_latent_moe(norm: bool) -> None:
    reference = make_reference(norm)
    layer = FusedMoE(NUM_EXPERTS, LATENT, INTER, expert_norm=norm,
                     eps=reference.experts.eps)
    assert layer.gate_up_proj.shape == (NUM_EXPERTS, 2 * INTER, LATENT)
    assert layer.down_proj.shape == (NUM_EXPERTS, LATENT, INTER)
    assert (layer.norm_weight is not None) == norm
    load_stacked(layer, reference)
    x = randn(13, HIDDEN, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(fused_layer_output(layer, reference, x), reference(x),
                                   **REFERENCE_TOLERANCE)
        weights, ids = route(reference.gate(x), reference.config)
        latent = reference.pooler(x)
        experts = reference.experts
        twin = fused_experts_torch(latent, weights, ids, experts.gate_up_proj,
                                   experts.down_proj, experts.norm_weight, experts.eps)
        torch.testing.assert_close(layer(latent, weights, ids), twin, **EXACT)


def per_expert_tensors(reference: LatentMoE) -> dict[str, torch.Tensor]:
    """The experts as Hugging Face writes Qwen3-MoE: `{e}.{gate,up,down}_proj.weight`."""
    experts = reference.experts
    tensors = {}
    for e in range(NUM_EXPERTS):
        gate, up = experts.gate_up_proj[e].detach().split(INTER)
        tensors[f"{e}.gate_proj.weight"] = gate
        tensors[f"{e}.up_proj.weight"] = up
        tensors[f"{e}.down_proj.weight"] = experts.down_proj[e].detach()
    return tensors


def load_per_expert(layer: FusedMoE, tensors: dict, wrap=lambda tensor: tensor) -> None:
    for name, tensor in tensors.items():
        param_name, expert_id, shard_id = per_expert_target(name)
        param = getattr(layer, param_name)
        param.weight_loader(param, wrap(tensor), shard_id=shard_id, expert_id=expert_id)


def test_per_expert_checkpoint_names() -> None:
    assert per_expert_target("3.gate_proj.weight") == ("gate_up_proj", 3, "gate")
    assert per_expert_target("17.up_proj.weight") == ("gate_up_proj", 17, "up")
    assert per_expert_target("0.down_proj.weight") == ("down_proj", 0, "down")
    assert per_expert_target("gate_up_proj") is None
    assert per_expert_target("0.gate_proj.bias") is None

    reference = make_reference(norm=False, seed=10)
    layer = FusedMoE(NUM_EXPERTS, LATENT, INTER, expert_norm=False)
    load_per_expert(layer, per_expert_tensors(reference))
    torch.testing.assert_close(layer.gate_up_proj, reference.experts.gate_up_proj, **EXACT)
    torch.testing.assert_close(layer.down_proj, reference.experts.down_proj, **EXACT)


@pytest.mark.parametrize("rank", [0, 1])
def test_tp_rank_holds_its_intermediate_slice(monkeypatch: pytest.MonkeyPatch,
                                              rank: int) -> None:
    reference = make_reference(norm=True, seed=20)
    experts = reference.experts
    use_parallel(monkeypatch, ParallelConfig(tensor_parallel_size=2), rank)
    half = INTER // 2
    mine = slice(rank * half, (rank + 1) * half)
    gate, up = experts.gate_up_proj[:, :INTER], experts.gate_up_proj[:, INTER:]
    expected = {"gate_up_proj": torch.cat([gate[:, mine], up[:, mine]], dim=1),
                "down_proj": experts.down_proj[:, :, mine], "norm_weight": experts.norm_weight}
    for load in (lambda layer: load_stacked(layer, reference),
                 lambda layer: load_per_expert(layer, per_expert_tensors(reference))):
        layer = FusedMoE(NUM_EXPERTS, LATENT, INTER)
        assert layer.gate_up_proj.shape == (NUM_EXPERTS, 2 * half, LATENT)
        layer.norm_weight.data.copy_(experts.norm_weight)  # not in per-expert checkpoints
        load(layer)
        for name, tensor in expected.items():
            torch.testing.assert_close(getattr(layer, name), tensor, **EXACT)


@pytest.mark.parametrize("rank", [0, 1])
def test_ep_rank_holds_whole_experts(monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    reference = make_reference(norm=True, seed=30)
    experts = reference.experts
    use_parallel(monkeypatch, ParallelConfig(tensor_parallel_size=2,
                                             enable_expert_parallel=True), rank)
    local = NUM_EXPERTS // 2
    mine = slice(rank * local, (rank + 1) * local)
    layer = FusedMoE(NUM_EXPERTS, LATENT, INTER)
    assert (layer.tp_size, layer.ep_size, layer.num_local_experts) == (1, 2, local)
    load_stacked(layer, reference)
    for name in STACKED:
        torch.testing.assert_close(getattr(layer, name), getattr(experts, name)[mine], **EXACT)

    # Per expert: the other rank's experts are skipped, this rank's land in their place.
    per_expert = FusedMoE(NUM_EXPERTS, LATENT, INTER)
    per_expert.gate_up_proj.data.fill_(float("nan"))
    per_expert.down_proj.data.fill_(float("nan"))
    load_per_expert(per_expert, per_expert_tensors(reference))
    torch.testing.assert_close(per_expert.gate_up_proj, experts.gate_up_proj[mine], **EXACT)
    torch.testing.assert_close(per_expert.down_proj, experts.down_proj[mine], **EXACT)


class IdentityGroup(FakeGroup):
    """An EP group whose all-reduce returns this rank's share, for summing shares by hand."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_ep_shares_sum_to_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each EP rank's output before the all-reduce holds its experts' pairs only; the sum
    over ranks is the unsharded result, also when a token's experts are all on one rank."""
    reference = make_reference(norm=True, seed=40)
    x = randn(13, HIDDEN, seed=41)
    with torch.no_grad():
        weights, ids = route(reference.gate(x), reference.config)
        latent = reference.pooler(x)
        full = FusedMoE(NUM_EXPERTS, LATENT, INTER)
        load_stacked(full, reference)
        expected = full(latent, weights, ids)
        ep = 4
        config = ParallelConfig(tensor_parallel_size=ep, enable_expert_parallel=True)
        total = torch.zeros_like(expected)
        for rank in range(ep):
            use_parallel(monkeypatch, config, rank, IdentityGroup(ep, rank))
            layer = FusedMoE(NUM_EXPERTS, LATENT, INTER)
            load_stacked(layer, reference)
            share = layer(latent, weights, ids)
            holds = (ids // (NUM_EXPERTS // ep) == rank).any(-1)
            assert (share[~holds] == 0).all()  # tokens with none of this rank's experts
            total += share
    torch.testing.assert_close(total, expected, **REFERENCE_TOLERANCE)


@pytest.mark.parametrize(("config", "rank", "reads"), [
    (ParallelConfig(tensor_parallel_size=2), 1,
     {"gate_up_proj": NUM_EXPERTS * INTER * LATENT, "down_proj": NUM_EXPERTS * LATENT * INTER // 2,
      "norm_weight": NUM_EXPERTS * LATENT}),
    (ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True), 1,
     {"gate_up_proj": NUM_EXPERTS // 2 * 2 * INTER * LATENT,
      "down_proj": NUM_EXPERTS // 2 * LATENT * INTER, "norm_weight": NUM_EXPERTS // 2 * LATENT}),
], ids=["tp2", "ep2"])
def test_reads_only_its_slice(monkeypatch: pytest.MonkeyPatch, tmp_path,
                              config: ParallelConfig, rank: int, reads: dict) -> None:
    reference = make_reference(norm=True, seed=50)
    path = write_safetensors(tmp_path / "experts.safetensors",
                             {name: getattr(reference.experts, name).detach()
                              for name in STACKED})
    use_parallel(monkeypatch, config, rank)
    layer = FusedMoE(NUM_EXPERTS, LATENT, INTER)
    with safe_open(str(path), framework="pt") as checkpoint:
        for name in STACKED:
            source = RecordingSlice(checkpoint.get_slice(name))
            param = getattr(layer, name)
            param.weight_loader(param, source)
            assert source.elements_read == reads[name] == param.numel()


def test_errors_name_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    use_parallel(monkeypatch, ParallelConfig(tensor_parallel_size=2,
                                             prefill_context_parallel_size=2,
                                             enable_expert_parallel=True), 0)
    with pytest.raises(ValueError, match="expert parallelism with prefill context parallelism "
                                         "is not supported"):
        FusedMoE(8, 16, 8)
    use_parallel(monkeypatch, ParallelConfig(tensor_parallel_size=3,
                                             enable_expert_parallel=True), 0)
    with pytest.raises(ValueError, match=r"num_experts \(8\) must be divisible by the expert "
                                         r"parallel size \(3\)"):
        FusedMoE(8, 16, 8)
    use_parallel(monkeypatch, ParallelConfig(tensor_parallel_size=3), 0)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(8\) must be divisible"):
        FusedMoE(8, 16, 8)
    use_parallel(monkeypatch, ParallelConfig(), 0)
    layer = FusedMoE(8, 16, 8, prefix="layers.0.mlp.experts")
    with pytest.raises(ValueError, match=r"shard_id for layers\.0\.mlp\.experts\.down_proj "
                                         r"must be one of \('down',\), got 'gate'"):
        layer.down_proj.weight_loader(layer.down_proj, torch.zeros(16, 8), "gate", 0)
    with pytest.raises(ValueError, match=r"must have 8 experts first"):
        layer.down_proj.weight_loader(layer.down_proj, torch.zeros(4, 16, 8))
    with pytest.raises(ValueError, match=r"expert_id must be in \[0, 8\), got 9"):
        layer.down_proj.weight_loader(layer.down_proj, torch.zeros(16, 8), "down", 9)
