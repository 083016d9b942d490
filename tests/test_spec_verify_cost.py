"""benchmarks/spec_verify_cost.py runs end to end on the tiny preset on the CPU."""

from __future__ import annotations

import json

import pytest

from benchmarks import spec_verify_cost


def test_spec_verify_cost_json(tmp_path):
    out = tmp_path / "verify.json"
    record = spec_verify_cost.main([
        "--shape", "muse-spark-tiny", "--device", "cpu", "--dtype", "float32",
        "--batch-sizes", "1,3", "--num-draft-tokens", "2,3", "--context", "40",
        "--acceptance-lengths", "2,3.5,4", "--draft-ms", "0.5", "--repeats", "2",
        "--warmup", "1", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "spec_verify_cost"
    assert "date" in record["environment"] and "git_commit" in record["environment"]
    assert "speedup(L) = L * T_decode" in record["notes"]["speedup"]
    assert not record["engine"]["decode_graphs"]  # CPU: eager only
    assert [row["batch_size"] for row in record["rows"]] == [1, 3]
    for row in record["rows"]:
        assert "error" not in row, row
        assert row["context_min"] >= 40
        decode = row["decode"]
        assert decode["tokens"] == row["batch_size"] and decode["graph_ms"] is None
        assert decode["eager_ms"] > 0 and decode["baseline_ms"] == decode["eager_ms"]
        assert len(decode["eager_runs_ms"]) == 2 and decode["roofline_ms"] > 0
        assert [v["k"] for v in row["verify"]] == [2, 3]
        for verify in row["verify"]:
            k = verify["k"]
            assert verify["tokens"] == row["batch_size"] * (1 + k)
            assert verify["ms"] > 0
            assert verify["ratio_to_decode"] == pytest.approx(
                verify["ms"] / decode["eager_ms"])
            # An MoE verify step reads more experts than a decode step.
            assert verify["roofline_ratio"] > 1
            # Each request's first verify row is the decode step's query.
            assert verify["first_rows_max_abs_diff"] < 1e-3
            assert verify["first_rows_argmax_agree"] == 1.0
            step = verify["ms"] + 0.5
            assert verify["break_even_L"] == pytest.approx(step / decode["eager_ms"])
            for text, length in (("2", 2.0), ("3.5", 3.5), ("4", 4.0)):
                if length <= k + 1:
                    assert verify["speedup"][text] == pytest.approx(
                        length * decode["eager_ms"] / step)
                else:  # more tokens than a verify step can emit: no projection
                    assert verify["speedup"][text] is None


def test_spec_verify_cost_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        spec_verify_cost.parse_args(["--num-draft-tokens", "0"])
    with pytest.raises(SystemExit):
        spec_verify_cost.parse_args(["--acceptance-lengths", "0.5"])
