"""`scripts/multigpu_h200.sh` as a dry run on the CPU: two gloo ranks of the tiny preset, each
part writing the JSON the GPU run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DRY_RUN = {"PYTHON": sys.executable, "DEVICE": "cpu", "MODEL": "muse-spark-tiny", "NUM_GPUS": "2",
           "CONTEXT": "24", "DECODE_TOKENS": "4", "REQUESTS": "4", "LENS": "8:24",
           "CHECK_PROMPTS": "3", "CHECK_TOKENS": "6", "PROFILE_MODES": "eager", "PROFILE_BATCHES": "1",
           "PARALLEL_CHECK_ARGS": "--layouts tp2,pp2,tp8 --init-std 0.1",
           "COLLECTIVES_ARGS": "--tokens 1,4 --repeats 2",
           "LATENCY_ARGS": "--dtype float32", "THROUGHPUT_ARGS": "--dtype float32",
           "REAL_SIZE_ARGS": "--preset muse-spark-tiny --dtype float32 --batches 1 --context 16 "
                             "--prefill 16 --decode-steps 2 --kv-cache-memory-bytes 33554432"}


def run_part(out: Path, part: str, **env: str) -> str:
    result = subprocess.run(["bash", "scripts/multigpu_h200.sh", str(out), part], cwd=REPO_ROOT,
                            env={**os.environ, **DRY_RUN, **env}, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_correctness_part(tmp_path):
    run_part(tmp_path, "correctness")
    results = json.loads((tmp_path / "parallel-check-muse-spark-tiny.json").read_text())["results"]
    assert results["tp2"]["equal"] and results["pp2"]["equal"]
    assert results["tp2"]["compared_tokens"] > 0


def test_collectives_and_scaling_parts(tmp_path):
    run_part(tmp_path, "collectives")
    collectives = json.loads((tmp_path / "collectives-muse-spark-tiny.json").read_text())
    assert set(collectives["results"]) == {"2"}
    # Layouts of more ranks than NUM_GPUS are left out.
    printed = run_part(tmp_path, "scaling", LAYOUTS="tp2 tp4")
    assert "tp2: muse" in printed and "tp4" not in printed
    for layout, gpus in (("one", 1), ("tp2", 2)):
        latency = json.loads((tmp_path / f"latency-muse-spark-tiny-{layout}.json").read_text())
        assert latency["gpus"] == gpus
        assert "error" not in latency["results"]["muse"]["rows"][0]
        profile = tmp_path / f"profile-muse-spark-tiny-{layout}-b1.json"
        assert json.loads(profile.read_text())["runs"][0]["kernels"]
    throughput = json.loads((tmp_path / "throughput-muse-spark-tiny-tp2.json").read_text())
    assert throughput["gpus"] == 2


def test_real_size_part(tmp_path):
    run_part(tmp_path, "real-size")
    for suffix in ("", "-nvfp4-w4a16"):
        record = json.loads((tmp_path / f"real-size-tp2xep{suffix}.json").read_text())
        assert record["gpus"] == 2 and record["parallel"]["enable_expert_parallel"]
        assert record["quantization"] == (suffix[1:] or None)
