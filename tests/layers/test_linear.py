"""Linear layers: at world size 1 each equals the plain torch layer with the checkpoint's full
weights loaded through its weight loaders; for larger TP sizes (ranks simulated in one
process, see `FakeGroup`) each rank holds and reads exactly its slice. The collectives at
TP=2 run in `test_parallel.py`."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from torch import nn

from muse.config import TextConfig
from muse.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from muse.layers.quantization import UnquantizedLinearMethod, process_weights_after_loading
from muse.reference.layers import AttentionProjections
from tests.layers.common import (
    SHARDED_TOLERANCE,
    RecordingSlice,
    as_tp_rank,
    plain_linear,
    randn,
    write_safetensors,
)

EXACT = {"rtol": 0.0, "atol": 0.0}
LINEAR = "muse.layers.linear"


def load(param: nn.Parameter, loaded, shard_id=None) -> None:
    param.weight_loader(param, loaded, shard_id)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("make", [
    lambda i, o, b: ReplicatedLinear(i, o, bias=b),
    lambda i, o, b: ColumnParallelLinear(i, o, bias=b),
    lambda i, o, b: ColumnParallelLinear(i, o, bias=b, gather_output=True),
    lambda i, o, b: RowParallelLinear(i, o, bias=b),
    lambda i, o, b: RowParallelLinear(i, o, bias=b, reduce_results=False),
], ids=["replicated", "column", "column_gather", "row", "row_no_reduce"])
def test_equals_nn_linear(make, bias: bool) -> None:
    reference = plain_linear(24, 40, bias, seed=0)
    layer = make(24, 40, bias)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    assert layer.weight.shape == (40, 24) and not layer.weight.requires_grad
    load(layer.weight, reference.weight)
    if bias:
        load(layer.bias, reference.bias)
    process_weights_after_loading(layer)
    x = randn(5, 24, seed=2)
    torch.testing.assert_close(layer(x), reference(x), **EXACT)


@pytest.mark.parametrize("sizes", [[32, 32], [16, 48]], ids=["gate_up", "uneven"])
def test_merged_column_loads_each_part(sizes: list[int]) -> None:
    parts = [plain_linear(24, size, False, seed=10 + i) for i, size in enumerate(sizes)]
    layer = MergedColumnParallelLinear(24, sizes)
    assert layer.weight.shape == (sum(sizes), 24)
    # Loaded in reverse order: a part's place must not depend on what was loaded before.
    for shard_id in reversed(range(len(sizes))):
        load(layer.weight, parts[shard_id].weight, shard_id)
    x = randn(5, 24, seed=2)
    torch.testing.assert_close(layer(x), torch.cat([part(x) for part in parts], -1), **EXACT)

    fused = MergedColumnParallelLinear(24, sizes)
    load(fused.weight, torch.cat([part.weight for part in parts]))  # a fused checkpoint
    torch.testing.assert_close(fused.weight, layer.weight, **EXACT)


def attention_config(heads: int, kv_heads: int, bias: bool) -> TextConfig:
    return TextConfig(hidden_size=32, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=8, attention_bias=bias, qk_norm=False)


def reference_projections(config: TextConfig, seed: int) -> AttentionProjections:
    projections = AttentionProjections(config, 0)
    with torch.no_grad():
        for i, param in enumerate(projections.parameters()):
            param.copy_(randn(*param.shape, seed=seed + i))
    return projections


def load_qkv(layer: QKVParallelLinear, reference: AttentionProjections) -> None:
    for shard_id in ("q", "k", "v"):
        projection = getattr(reference, f"{shard_id}_proj")
        load(layer.weight, projection.weight, shard_id)
        if projection.bias is not None:
            load(layer.bias, projection.bias, shard_id)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_qkv_equals_reference_projections(bias: bool) -> None:
    config = attention_config(heads=4, kv_heads=2, bias=bias)
    reference = reference_projections(config, seed=20)
    layer = QKVParallelLinear(32, 8, 4, 2, bias=bias)
    assert layer.weight.shape == ((4 + 2 + 2) * 8, 32)
    assert (layer.bias is not None) == bias
    load_qkv(layer, reference)
    x = randn(3, 5, 32, seed=3)
    for got, expected in zip(layer.split(layer(x)), reference.project(x)):
        torch.testing.assert_close(got, expected, **EXACT)


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [
    (8, 2, 4),   # more ranks than kv heads: each kv head on 2 ranks
    (4, 1, 2),   # one kv head for every rank
    (8, 4, 2),   # kv heads split too
    (4, 4, 4),   # one of each per rank
])
def test_qkv_ranks_hold_their_heads(monkeypatch: pytest.MonkeyPatch, heads: int,
                                    kv_heads: int, tp: int) -> None:
    config = attention_config(heads=heads, kv_heads=kv_heads, bias=True)
    reference = reference_projections(config, seed=30)
    x = randn(5, 32, seed=4)
    q_full, k_full, v_full = reference.project(x)
    group = heads // kv_heads
    for rank in range(tp):
        as_tp_rank(monkeypatch, LINEAR, tp, rank)
        layer = QKVParallelLinear(32, 8, heads, kv_heads, bias=True)
        assert layer.num_heads == heads // tp
        assert layer.num_kv_heads == max(1, kv_heads // tp)
        load_qkv(layer, reference)
        q, k, v = layer.split(layer(x))
        q_heads = list(range(rank * heads // tp, (rank + 1) * heads // tp))
        kv_heads_here = sorted({h // group for h in q_heads})  # the kv heads they attend with
        torch.testing.assert_close(q, q_full[:, q_heads], **SHARDED_TOLERANCE)
        torch.testing.assert_close(k, k_full[:, kv_heads_here], **SHARDED_TOLERANCE)
        torch.testing.assert_close(v, v_full[:, kv_heads_here], **SHARDED_TOLERANCE)


def test_column_and_row_shards_recombine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per rank: column outputs are the rank's slice of the full output; row partial sums
    (without the all-reduce) add up to the full output, the bias counted once."""
    tp = 2
    column_ref = plain_linear(24, 40, True, seed=40)
    row_ref = plain_linear(40, 24, True, seed=42)
    merged_parts = [plain_linear(24, 16, False, seed=44 + i) for i in range(2)]
    x = randn(5, 24, seed=5)
    hidden = column_ref(x)
    row_sum = torch.zeros(5, 24)
    for rank in range(tp):
        as_tp_rank(monkeypatch, LINEAR, tp, rank)
        column = ColumnParallelLinear(24, 40, bias=True)
        load(column.weight, column_ref.weight)
        load(column.bias, column_ref.bias)
        mine = slice(rank * 20, (rank + 1) * 20)
        torch.testing.assert_close(column(x), hidden[:, mine], **SHARDED_TOLERANCE)

        row = RowParallelLinear(40, 24, bias=True, reduce_results=False)
        assert row.weight.shape == (24, 20) and row.bias.shape == (24,)
        load(row.weight, row_ref.weight)
        load(row.bias, row_ref.bias)
        row_sum += row(hidden[:, mine])

        merged = MergedColumnParallelLinear(24, [16, 16])
        for shard_id, part in enumerate(merged_parts):
            load(merged.weight, part.weight, shard_id)
        half = slice(rank * 8, (rank + 1) * 8)
        expected = torch.cat([part(x)[:, half] for part in merged_parts], -1)
        torch.testing.assert_close(merged(x), expected, **SHARDED_TOLERANCE)
    torch.testing.assert_close(row_sum, row_ref(hidden), **SHARDED_TOLERANCE)


def test_loaders_read_only_their_slice(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Given safetensors slices, a rank reads its own rows / columns and nothing more."""
    tensors = {"column": randn(40, 24, seed=50), "row": randn(24, 40, seed=51),
               "gate": randn(16, 24, seed=52), "up": randn(16, 24, seed=53),
               "q": randn(64, 32, seed=54), "k": randn(16, 32, seed=55),
               "v": randn(16, 32, seed=56)}
    path = write_safetensors(tmp_path / "model.safetensors", tensors)
    tp, rank = 4, 3
    as_tp_rank(monkeypatch, LINEAR, tp, rank)
    with safe_open(str(path), framework="pt") as checkpoint:
        def slice_of(name: str) -> RecordingSlice:
            return RecordingSlice(checkpoint.get_slice(name))

        column = ColumnParallelLinear(24, 40)
        source = slice_of("column")
        load(column.weight, source)
        torch.testing.assert_close(column.weight, tensors["column"][30:40], **EXACT)
        assert source.elements_read == 10 * 24

        row = RowParallelLinear(40, 24)
        source = slice_of("row")
        load(row.weight, source)
        torch.testing.assert_close(row.weight, tensors["row"][:, 30:40], **EXACT)
        assert source.elements_read == 24 * 10

        merged = MergedColumnParallelLinear(24, [16, 16])
        for shard_id, name in enumerate(("gate", "up")):
            source = slice_of(name)
            load(merged.weight, source, shard_id)
            assert source.elements_read == 4 * 24
        expected = torch.cat([tensors["gate"][12:16], tensors["up"][12:16]])
        torch.testing.assert_close(merged.weight, expected, **EXACT)

        # 8 query heads, 2 kv heads of 8 on 4 ranks: rank 3 holds q heads 6-7 and kv head 1.
        qkv = QKVParallelLinear(32, 8, 8, 2)
        for name in ("q", "k", "v"):
            source = slice_of(name)
            load(qkv.weight, source, name)
            assert source.elements_read == (16 if name == "q" else 8) * 32
        expected = torch.cat([tensors["q"][48:64], tensors["k"][8:16], tensors["v"][8:16]])
        torch.testing.assert_close(qkv.weight, expected, **EXACT)


def test_real_safetensors_slices_load(tmp_path) -> None:
    """The `get_slice` objects themselves (no wrapper) work as loader inputs."""
    reference = plain_linear(24, 40, True, seed=60)
    path = write_safetensors(tmp_path / "model.safetensors",
                             {"weight": reference.weight.detach(),
                              "bias": reference.bias.detach()})
    layer = ColumnParallelLinear(24, 40, bias=True)
    with safe_open(str(path), framework="pt") as checkpoint:
        load(layer.weight, checkpoint.get_slice("weight"))
        load(layer.bias, checkpoint.get_slice("bias"))
    x = randn(3, 24, seed=6)
    torch.testing.assert_close(layer(x), reference(x), **EXACT)


def test_errors_name_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    as_tp_rank(monkeypatch, LINEAR, 4, 0)
    with pytest.raises(ValueError, match=r"output size \(30\) must be divisible .* \(4\)"):
        ColumnParallelLinear(8, 30)
    with pytest.raises(ValueError, match=r"input size \(30\) must be divisible"):
        RowParallelLinear(30, 8)
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be divisible"):
        QKVParallelLinear(8, 4, 6, 2)
    with pytest.raises(ValueError, match=r"tensor parallel size \(4\) must be divisible by "
                                         r"num_kv_heads \(3\)"):
        QKVParallelLinear(8, 4, 12, 3)
    merged = MergedColumnParallelLinear(8, [8, 8], prefix="mlp.gate_up_proj")
    with pytest.raises(ValueError, match=r"shard_id .* must be one of \[0, 1\], got 'gate'"):
        load(merged.weight, torch.zeros(8, 8), "gate")
    with pytest.raises(ValueError, match=r"mlp\.gate_up_proj\.weight: the checkpoint gives "
                                         r"shape \(2, 7\) where .* \(2, 8\)"):
        load(merged.weight, torch.zeros(8, 7), 0)
    column = ColumnParallelLinear(8, 8)
    with pytest.raises(ValueError, match="not fused: shard_id must be None"):
        load(column.weight, torch.zeros(8, 8), 0)
