"""The one-row GEMV of unquantized linear layers (`muse.kernels.gemv_triton.dense_gemv`)
against its twin `F.linear`, and the dispatch `dense_linear` makes. Small sizes: on the CPU the
kernel runs under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from muse.kernels.dense_linear import dense_linear, takes_gemv  # noqa: E402
from muse.kernels.gemv_triton import (GemvTiles, choose_dense_gemv_tiles,  # noqa: E402
                                      dense_gemv, split_counters)
from tests.conftest import DEVICE  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

CASES = [
    # (N, K, tiles): N and K not multiples of the tile; K split over programs; one output
    (37, 200, GemvTiles(16, 64, 4)),
    (50, 192, GemvTiles(16, 32, 2, split_k=3)),
    (1, 48, GemvTiles(16, 16, 1, split_k=3)),
    (70, 256, None),
]


def _operands(out: int, inp: int, dtype: torch.dtype, seed: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(inp, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(out, inp, generator=gen) * inp ** -0.5).to(DEVICE, dtype)
    bias = torch.randn(out, generator=gen).to(DEVICE, dtype)
    return x, weight, bias


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(("out", "inp", "tiles"), CASES)
def test_gemv_matches_f_linear(dtype: torch.dtype, out: int, inp: int,
                               tiles: GemvTiles | None) -> None:
    """Both sum the same products in float32, in different orders, and round once: within a
    few units of the output dtype's last place, relative to the sum of the terms' sizes."""
    x, weight, bias = _operands(out, inp, dtype, seed=out + inp)
    for b in (None, bias):
        kernel = dense_gemv(x, weight, b, tiles=tiles)
        assert kernel.dtype == dtype and kernel.shape == (out,)
        exact = weight.double() @ x.double() + (b.double() if b is not None else 0)
        size = weight.double().abs() @ x.double().abs() + (
            b.double().abs() if b is not None else 0)
        # float32 outputs: the sums' own rounding, a few units over K terms.
        ulp = torch.finfo(dtype).eps * (8 if dtype == torch.float32 else 1)
        assert ((kernel.double() - exact).abs() <= 2 * ulp * size).all()
        twin = F.linear(x[None], weight, b)[0]
        assert ((kernel.double() - twin.double()).abs() <= 4 * ulp * size).all()


def test_one_hot_rows_read_every_weight() -> None:
    """x = e_k: the output is column k of the weight, exactly (nothing else is added)."""
    _, weight, _ = _operands(21, 80, torch.bfloat16, seed=5)
    for tiles in (GemvTiles(16, 16, 1), GemvTiles(16, 16, 1, split_k=5)):
        for k in (0, 1, 37, 79):
            x = torch.zeros(80, dtype=torch.bfloat16, device=DEVICE)
            x[k] = 1.0
            assert torch.equal(dense_gemv(x, weight, tiles=tiles), weight[:, k])


def test_split_gemv_leaves_its_counters_at_zero_and_repeats_exactly() -> None:
    x, weight, _ = _operands(40, 128, torch.bfloat16, seed=3)
    tiles = GemvTiles(16, 16, 2, split_k=8)
    first = dense_gemv(x, weight, tiles=tiles)
    assert not split_counters(first.device, 3).any()
    assert torch.equal(dense_gemv(x, weight, tiles=tiles), first)


def test_strided_rows_and_bad_shapes() -> None:
    x, weight, _ = _operands(24, 64, torch.float16, seed=7)
    wide = torch.zeros(24, 96, dtype=weight.dtype, device=DEVICE)
    wide[:, :64] = weight
    strided_x = torch.stack([x, x]).t()[:, 0]  # stride 2
    assert torch.equal(dense_gemv(strided_x, wide[:, :64]), dense_gemv(x, weight))
    with pytest.raises(ValueError, match="one row"):
        dense_gemv(x[None], weight)
    with pytest.raises(ValueError, match="contiguous"):
        dense_gemv(x, weight.t().contiguous().t())
    with pytest.raises(ValueError, match="split_k"):
        dense_gemv(x, weight, tiles=GemvTiles(16, 16, 1, split_k=3))


def test_choose_tiles_split_only_narrow_and_deep_matrices() -> None:
    assert choose_dense_gemv_tiles(256, 2048) == GemvTiles(2, 2048, 4, 1, 1)  # a router
    assert choose_dense_gemv_tiles(2048, 4096) == GemvTiles(2, 2048, 4, 1, 1)  # o_proj
    # 32 programs of 2 rows over 8 steps of K: split 8 ways.
    assert choose_dense_gemv_tiles(64, 16384).split_k == 8
    assert choose_dense_gemv_tiles(3, 10).block_k == 16


def test_dense_linear_takes_the_gemv_only_for_one_row_of_16_bit_values_on_a_gpu() -> None:
    x, weight, bias = _operands(24, 64, torch.bfloat16, seed=9)
    row = x[None]
    on_gpu = DEVICE == "cuda"
    assert takes_gemv(row, weight) is on_gpu
    assert takes_gemv(row[None], weight) is on_gpu  # [1, 1, in]: still one row
    assert not takes_gemv(torch.stack([x, x]), weight)
    assert not takes_gemv(row.float(), weight.float())
    assert not takes_gemv(row.detach().requires_grad_(), weight)
    want = dense_gemv(x, weight, bias)[None] if on_gpu else F.linear(row, weight, bias)
    assert torch.equal(dense_linear(row, weight, bias), want)
    two = torch.stack([x, x])
    assert torch.equal(dense_linear(two, weight, bias), F.linear(two, weight, bias))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_gemv_replays_in_a_cuda_graph() -> None:
    from tests.kernels.graph_capture import capture

    x, weight, _ = _operands(2048, 1024, torch.bfloat16, seed=11)
    tiles = choose_dense_gemv_tiles(2048, 1024)
    graph, out = capture(lambda: dense_gemv(x, weight, tiles=tiles))
    for _ in range(3):
        x.normal_()
        graph.replay()
        torch.testing.assert_close(out, F.linear(x[None], weight)[0], rtol=2e-2, atol=2e-2)


def test_decode_gemv_benchmark_cases_and_measuring_path(tmp_path, monkeypatch) -> None:
    """benchmarks/decode_gemv.py: the projections it times per shape (the router included),
    and its measuring path at toy sizes with a stand-in timer (every call really runs)."""
    import json

    import benchmarks.decode_gemv as bench
    import benchmarks.w4a16_gemm as timing

    out = tmp_path / "gemv.json"
    record = bench.main(["--dry-run", "--shapes", "muse-spark-15b-a2b,qwen3-0.6b-shape",
                         "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "decode_gemv"
    cases = {(row["shape"], row["name"]): (row["out"], row["in"]) for row in record["cases"]}
    assert cases["muse-spark-15b-a2b", "moe.gate"] == (256, 2048)
    assert cases["muse-spark-15b-a2b", "qkv_proj"] == (5120, 2048)
    assert cases["qwen3-0.6b-shape", "mlp.down_proj"] == (1024, 3072)
    assert len(cases) == 5 + 4

    calls_timed: list[int] = []

    def fake_time_per_call(calls, repeats):
        for call in calls:
            call()
        calls_timed.append(len(calls))
        return (6.0, 3.0, 1.5)[(len(calls_timed) - 1) % 3]  # cuBLAS, the GEMV, from L2

    def fake_sweep_time(calls, repeats):
        for call in calls:
            call()
        return 1.0

    monkeypatch.setattr(bench, "time_per_call", fake_time_per_call)
    monkeypatch.setattr(timing, "time_per_call", fake_sweep_time)  # the sweep's `timed`
    monkeypatch.setattr(bench, "SWEEP", [(16, 32, 1, 1), (8, 64, 2, 2)])
    args = bench.parse_args(["--shapes", "muse-spark-tiny", "--flush-bytes", "1",
                             "--sweep-tiles"])
    rows = [bench.run_case("muse-spark-tiny", case, args, torch.device(DEVICE))
            for case in bench.cases_of("muse-spark-tiny")]
    assert [row["name"] for row in rows][-1] == "moe.gate"
    for row in rows:
        assert row["speedup"] == 2.0 and row["roofline_us"] > 0 and row["gemv_l2_us"] == 1.5
        assert len(row["sweep_us"]) >= 2 and set(row["sweep_us"].values()) == {1.0}
    assert "speedup" in bench.report(rows)


def test_gemv_read_ahead_benchmark_runs_every_kernel_it_times() -> None:
    """benchmarks/gemv_read_ahead.py at toy sizes with a stand-in timer: the read-ahead kernel
    reads the whole weight (its sums are the weight's), the chain ticks, the GEMV runs."""
    import benchmarks.gemv_read_ahead as bench
    from benchmarks.decode_gemv import cases_of

    timed: list[int] = []

    def fake_time(calls, repeats):
        for call in calls:
            call()
        timed.append(len(calls))
        return float(len(timed))

    args = bench.parse_args(["--shapes", "muse-spark-tiny", "--flush-bytes", "1", "--chain", "3",
                             "--read-programs", "2"])
    case = cases_of("muse-spark-tiny")[0]
    row = bench.run_case("muse-spark-tiny", case, args, torch.device(DEVICE), time=fake_time)
    assert (row["cold_us"], row["read_ahead_us"], row["in_l2_us"], row["chain_us"]) == \
        (1.0, 2.0, 3.0, 4.0)
    assert "of the gap closed" in bench.report([row])

    weight = torch.randn(3, 5000, device=DEVICE)
    sink = torch.zeros(2, device=DEVICE)
    bench.read_ahead(weight, sink, programs=2)
    torch.testing.assert_close(sink.sum(), weight.sum(), rtol=1e-4, atol=1e-3)
    counter = torch.zeros(1, device=DEVICE)
    bench.chain(counter, 5)
    assert counter.item() == 5.0
