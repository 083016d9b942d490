"""benchmarks/w4a16_gemm.py: the cases it times for a preset, its dry run, its refusal without
a GPU, and its measuring path end to end at toy sizes (under the Triton interpreter on CPU)
with a stand-in timer."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

import benchmarks.w4a16_gemm as bench  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402


def test_dry_run_lists_the_15b_decode_shapes(tmp_path) -> None:
    out = tmp_path / "w4a16.json"
    record = bench.main(["--dry-run", "--rows", "1,64", "--tokens", "1,8", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "w4a16_gemm"
    assert "git_commit" in record["environment"]
    dense = {(row["name"], row["rows"]): row for row in record["cases"] if row["kind"] == "dense"}
    # 32 query and 4 kv heads of 128 over a hidden size of 2048; the MoE's latent is 1024.
    assert dense["qkv_proj", 1]["shape"] == [5120, 2048]
    assert dense["o_proj", 64]["shape"] == [2048, 4096]
    assert dense["moe.pooler", 1]["shape"] == [1024, 2048]
    assert dense["moe.unpooler", 1]["shape"] == [2048, 1024]
    assert len(dense) == 8
    for row in dense.values():
        sizes = row["weight_bytes"]
        out_features, in_features = row["shape"]
        assert sizes["bf16"] == 2 * out_features * in_features
        # 4 bits a weight plus 8 bits per block of 16 (NVFP4, with a factor per row) or 32.
        assert sizes["mxfp4"] == out_features * in_features * (4 + 8 / 32) / 8
        assert sizes["nvfp4"] == out_features * in_features * (4 + 8 / 16) / 8 + 4 * out_features
    moe = [row for row in record["cases"] if row["kind"] == "moe"]
    assert [row["tokens"] for row in moe] == [1, 8]
    assert moe[0]["shape"] == {"num_experts": 256, "top_k": 8, "latent": 1024, "inter": 640}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_to_time_without_cuda() -> None:
    with pytest.raises(SystemExit, match="needs a GPU"):
        bench.main(["--rows", "1"])


def test_rejects_unknown_formats_and_cases() -> None:
    for argv in (["--formats", "fp8"], ["--cases", "attention"], ["--rows", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)


def test_measures_every_case_at_toy_sizes(monkeypatch) -> None:
    timed: list[int] = []

    def fake_time_per_call(calls, repeats):
        for call in calls:  # every call really runs
            call()
        timed.append(len(calls))
        return 10.0 if len(timed) % 3 == 1 else 4.0  # bf16 first, then the FP4 formats

    monkeypatch.setattr(bench, "time_per_call", fake_time_per_call)
    monkeypatch.setattr(bench, "SWEEP_DECODE", [(16, 32, 1, 2), (32, 64, 2, 2)])
    args = bench.parse_args(["--shape", "muse-spark-tiny", "--rows", "3", "--tokens", "2",
                             "--flush-bytes", "1", "--moe-routings", "2"])
    device = torch.device(DEVICE)
    rows = []
    for kind, case, size in bench.plan(args):
        if kind == "dense":
            rows.append(bench.run_dense(case, size, args.formats, args, device))
        else:
            rows.append(bench.run_moe(case, size, args.formats, args, device))
    # The tiny preset: q/k/v, o, the pooler and unpooler, the shared expert's two; its experts.
    assert [row["name"] for row in rows] == [
        "qkv_proj", "o_proj", "moe.pooler", "moe.unpooler", "shared_expert.gate_up_proj",
        "shared_expert.down_proj", "experts"]
    assert timed == [2] * 3 * len(rows)  # two weight copies or routings per variant
    for row in rows:
        assert row["bf16"]["us"] == 10.0 and row["bf16"]["GBps"] > 0
        for fmt in ("nvfp4", "mxfp4"):
            assert row[fmt]["speedup"] == 2.5
            assert 0 < row[fmt]["bytes"] < row["bf16"]["bytes"]
    assert 2 <= rows[-1]["distinct_experts"] <= 4 and rows[-1]["one_pair_per_block"]
    # The bytes counted are those of the tensors built.
    gen = torch.Generator(device=device).manual_seed(0)
    for fmt in ("nvfp4", "mxfp4"):
        weight = bench.random_fp4(fmt, (3, 64, 96), device, gen)
        tensors = (weight.packed, weight.scales, weight.row_factor)
        assert bench.weight_bytes(fmt, 64, 96, experts=3) == sum(
            t.nbytes for t in tensors if t is not None)
    assert "speedup" in bench.report(rows, args.formats)

    # The tile sweep runs each candidate.
    args = bench.parse_args(["--shape", "muse-spark-tiny", "--rows", "1", "--formats", "mxfp4",
                             "--flush-bytes", "1", "--sweep-tiles"])
    row = bench.run_dense(bench.dense_cases(bench.get_preset(args.shape).text_config)[1], 1,
                          args.formats, args, device)
    assert list(row["mxfp4"]["sweep_us"]) == [
        "[16, 16, 32, 1, 2, 2]", "[16, 16, 32, 1, 2, 1]", "[16, 32, 64, 2, 2, 1]"]
