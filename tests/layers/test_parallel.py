"""Layers across real ranks: two gloo processes, each building its shard of every layer from
the same full (seeded) weights and checking that its output equals the unsharded computation.
Each spawn checks many layers, as process start-ups dominate the time."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from muse.distributed.config import ParallelConfig
from muse.distributed.launch import spawn_workers
from muse.distributed.parallel_state import get_ep_group, get_tp_group
from muse.kernels.moe import fused_experts_torch
from muse.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from muse.layers.fused_moe import FusedMoE, per_expert_target
from muse.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from muse.reference.layers import LatentMoE, route
from tests.layers.common import SHARDED_TOLERANCE, make_latent_moe, plain_linear, randn

NUM_EXPERTS, TOP_K, HIDDEN, LATENT, INTER = 8, 2, 24, 16, 12


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, **SHARDED_TOLERANCE)


def load(param, loaded, shard_id=None, **kwargs) -> None:
    param.weight_loader(param, loaded, shard_id, **kwargs)


def _check_linear_layers(rank: int) -> None:
    x = randn(5, 24, seed=1)
    column_ref = plain_linear(24, 40, True, seed=2)
    mine = slice(rank * 20, (rank + 1) * 20)
    for gather in (False, True):
        column = ColumnParallelLinear(24, 40, bias=True, gather_output=gather)
        load(column.weight, column_ref.weight)
        load(column.bias, column_ref.bias)
        close(column(x), column_ref(x) if gather else column_ref(x)[:, mine])

    replicated = ReplicatedLinear(24, 40, bias=True)
    load(replicated.weight, column_ref.weight)
    load(replicated.bias, column_ref.bias)
    close(replicated(x), column_ref(x))

    gate, up = plain_linear(24, 16, False, seed=4), plain_linear(24, 16, False, seed=6)
    merged = MergedColumnParallelLinear(24, [16, 16])
    load(merged.weight, gate.weight, 0)
    load(merged.weight, up.weight, 1)
    half = slice(rank * 8, (rank + 1) * 8)
    close(merged(x), torch.cat([gate(x)[:, half], up(x)[:, half]], -1))

    # An MLP the Megatron way: column then row, one all-reduce, bias added once.
    hidden = F.silu(column_ref(x))
    row_ref = plain_linear(40, 24, True, seed=8)
    row = RowParallelLinear(40, 24, bias=True)
    load(row.weight, row_ref.weight)
    load(row.bias, row_ref.bias)
    close(row(hidden[:, mine]), row_ref(hidden))


def _check_qkv_with_replicated_kv_head(rank: int) -> None:
    """4 query heads, 1 kv head, TP=2: both ranks hold the kv head."""
    head_dim = 8
    q_ref = plain_linear(32, 4 * head_dim, True, seed=10)
    k_ref = plain_linear(32, head_dim, True, seed=12)
    v_ref = plain_linear(32, head_dim, True, seed=14)
    qkv = QKVParallelLinear(32, head_dim, 4, 1, bias=True)
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.num_kv_head_replicas) == (2, 1, 2)
    for shard_id, reference in (("q", q_ref), ("k", k_ref), ("v", v_ref)):
        load(qkv.weight, reference.weight, shard_id)
        load(qkv.bias, reference.bias, shard_id)
    x = randn(5, 32, seed=16)
    q, k, v = qkv.split(qkv(x))
    close(q, q_ref(x).view(5, 4, head_dim)[:, 2 * rank:2 * rank + 2])
    close(k, k_ref(x).view(5, 1, head_dim))
    close(v, v_ref(x).view(5, 1, head_dim))


def _check_embedding_and_lm_head(rank: int) -> None:
    vocab, dim = 100, 16  # 64 rows per rank after padding: rank 1 holds 36 real rows
    table = randn(vocab, dim, seed=20)
    embedding = VocabParallelEmbedding(vocab, dim)
    assert (embedding.num_embeddings_per_partition, embedding.vocab_start_index) == (64, 64 * rank)
    load(embedding.weight, table)
    ids = torch.tensor([[0, 63, 64, 99], [5, 70, 1, 98]])
    close(embedding(ids), F.embedding(ids, table))

    hidden = randn(3, dim, seed=21)
    head = ParallelLMHead(vocab, dim)
    load(head.weight, randn(vocab, dim, seed=22))
    logits = head(hidden)
    assert logits.shape == (3, vocab)
    close(logits, hidden @ randn(vocab, dim, seed=22).t())
    tied = ParallelLMHead(vocab, dim).tie_weights(embedding)
    assert tied.weight is embedding.weight
    close(tied(hidden), hidden @ table.t())


def _moe_inputs(reference: LatentMoE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                torch.Tensor]:
    """Latent tokens, routing, and the unsharded experts' output."""
    x = randn(13, HIDDEN, seed=31)
    weights, ids = route(reference.gate(x), reference.config)
    latent = reference.pooler(x)
    experts = reference.experts
    expected = fused_experts_torch(latent, weights, ids, experts.gate_up_proj, experts.down_proj,
                                   experts.norm_weight, experts.eps)
    return latent, weights, ids, expected


def _load_moe(layer: FusedMoE, reference: LatentMoE, per_expert: bool) -> None:
    experts = reference.experts
    load(layer.norm_weight, experts.norm_weight)
    if not per_expert:
        load(layer.gate_up_proj, experts.gate_up_proj)
        load(layer.down_proj, experts.down_proj)
        return
    for e in range(NUM_EXPERTS):
        gate, up = experts.gate_up_proj[e].split(INTER)
        for name, tensor in ((f"{e}.gate_proj.weight", gate), (f"{e}.up_proj.weight", up),
                             (f"{e}.down_proj.weight", experts.down_proj[e])):
            param_name, expert_id, shard_id = per_expert_target(name)
            load(getattr(layer, param_name), tensor, shard_id, expert_id=expert_id)


def _check_moe(rank: int, local_experts: int, intermediate: int) -> None:
    reference = make_latent_moe(NUM_EXPERTS, TOP_K, HIDDEN, LATENT, INTER, norm=True, seed=30)
    latent, weights, ids, expected = _moe_inputs(reference)
    for per_expert in (False, True):
        layer = FusedMoE(NUM_EXPERTS, LATENT, INTER, eps=reference.experts.eps)
        assert layer.gate_up_proj.shape == (local_experts, 2 * intermediate, LATENT)
        _load_moe(layer, reference, per_expert)
        close(layer(latent, weights, ids), expected)


@torch.no_grad()
def tp_worker(rank: int) -> int:
    torch.set_num_threads(1)
    group = get_tp_group()
    assert (group.world_size, group.rank_in_group) == (2, rank)
    _check_linear_layers(rank)
    _check_qkv_with_replicated_kv_head(rank)
    _check_embedding_and_lm_head(rank)
    _check_moe(rank, local_experts=NUM_EXPERTS, intermediate=INTER // 2)
    return rank


@torch.no_grad()
def ep_worker(rank: int) -> int:
    torch.set_num_threads(1)
    group = get_ep_group()
    assert (group.world_size, group.rank_in_group) == (2, rank)
    _check_moe(rank, local_experts=NUM_EXPERTS // 2, intermediate=INTER)
    _check_linear_layers(rank)  # the dense layers stay tensor parallel
    return rank


def test_tensor_parallel_2() -> None:
    assert spawn_workers(tp_worker, ParallelConfig(tensor_parallel_size=2),
                         backend="gloo") == [0, 1]


def test_expert_parallel_2_with_tensor_parallel_2() -> None:
    config = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True)
    assert config.expert_parallel_size == 2
    assert spawn_workers(ep_worker, config, backend="gloo") == [0, 1]
