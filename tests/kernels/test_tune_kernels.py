"""benchmarks/tune_kernels.py end to end at toy sizes, on whatever device the tests use (the
Triton interpreter on CPU), with a stand-in timer that makes the largest tiles "fastest"."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import benchmarks.tune_kernels as tune  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402


@pytest.fixture
def toy(monkeypatch):
    calls = []

    def fake_time_us(fn):
        fn()  # every configuration really runs
        calls.append(fn)
        return 1000.0 / len(calls)  # later candidates look faster: the last one wins

    monkeypatch.setattr(tune, "_time_us", fake_time_us)
    monkeypatch.setattr(tune, "DTYPE", torch.float32 if DEVICE == "cpu" else torch.bfloat16)
    monkeypatch.setattr(tune, "MOES", [("toy", 8, 2, 32, 16)])
    monkeypatch.setattr(tune, "MOE_TOKENS", (64, 1))
    monkeypatch.setattr(tune, "GEMM1_PREFILL", [(16, 16, 4, 2), (32, 16, 4, 2)])
    monkeypatch.setattr(tune, "GEMM2_PREFILL", [(16, 16, 4, 2), (32, 32, 4, 2)])
    monkeypatch.setattr(tune, "GEMM_DECODE", [(16, 16, 4, 2), (32, 16, 4, 2)])
    monkeypatch.setattr(tune, "ATTENTION_HEADS", (4, 2, 32))
    monkeypatch.setattr(tune, "ATTENTION_CHUNK", 48)
    monkeypatch.setattr(tune, "ATTENTION_CACHED", (0, 32))
    monkeypatch.setattr(tune, "ATTENTION_CONFIGS", [(32, 16, 4, 2), (64, 32, 4, 2)])
    return calls


def test_moe_sweep_reports_the_fastest_tiles(toy):
    rows = tune.sweep_moe(torch.device(DEVICE))
    assert [(r["shape"], r["tokens"]) for r in rows] == [("toy", 64), ("toy", 1)]
    prefill, decode = rows
    assert prefill["best_gemm1"] == [32, 16, 4, 2] and prefill["best_gemm2"] == [32, 32, 4, 2]
    assert set(prefill["block_m_us"]) == {"64", "128"} and decode["block_m_us"] == {}
    assert all(t is not None for t in prefill["gemm1_us"].values())


def test_attention_sweep_covers_each_cached_length(toy):
    rows = tune.sweep_attention(torch.device(DEVICE))
    assert [r["cached"] for r in rows] == [0, 32]
    assert all(r["best_config"] == [64, 32, 4, 2] and r["tflops_best"] > 0 for r in rows)
