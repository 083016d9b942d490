"""The multi-GPU measurement scripts end to end, as CPU dry runs on the tiny preset:
scripts/pd_disagg_h200.sh (prefill / decode instances behind `muse router`, then one TP=2
instance) and scripts/context_parallel_h200.sh (TP=2, then PCP=2). Their ranks talk over
gloo, so neither needs a GPU; each writes a JSON summary and stops every process it
started, also when a step fails."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist


REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT_TIMEOUT_S = 240

pytestmark = [
    pytest.mark.skipif(shutil.which("bash") is None or shutil.which("setsid") is None,
                       reason="the scripts need bash and setsid"),
    # DEVICE=cpu keeps every rank off the GPU; several ranks on the CPU need gloo.
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                       reason="TP / PCP on the CPU need torch.distributed's gloo backend"),
]

# The tiny preset and the smallest sizes: each run takes under a minute on 2 cores. Replies
# of 8 tokens give each request several inter-token gaps.
TINY = {"MODEL": "muse-spark-tiny", "DEVICE": "cpu", "MAX_LEN": "512"}
PD_SIZES = {
    "PREFIX_GROUPS": "1", "PREFIX_REQUESTS": "2", "PREFIX_INPUT_TOKENS": "64",
    "PREFIX_TOKENS": "48", "PREFIX_OUTPUT_TOKENS": "8", "PREFIX_CONCURRENCY": "1,2",
    "AGENTIC_SESSIONS": "2", "AGENTIC_CONCURRENCY": "1,2", "AGENTIC_SYSTEM_TOKENS": "64",
    "AGENTIC_USER_TOKENS": "16:32", "AGENTIC_TURNS": "2:2", "AGENTIC_TOOL_TOKENS": "16:32",
    "AGENTIC_OUTPUT_TOKENS": "8:8", "AGENTIC_THINK_TIME": "0:0",
}
CP_SIZES = {
    "NUM_GPUS": "2", "NUM_GROUPS": "1", "REQUESTS_PER_GROUP": "2", "INPUT_TOKENS": "64",
    "PREFIX_TOKENS": "48", "OUTPUT_TOKENS": "8", "CONCURRENCY": "1,2",
}
LEVELS = {"1", "2"}


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports."""
    for _ in range(100):
        base = random.randrange(20000, 60000 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no free ports")


def run_script(script: str, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", **TINY, **env}
    # A session of its own: on a timeout the script and its benchmark get SIGTERM together,
    # and the script's trap stops the servers.
    process = subprocess.Popen(["bash", f"scripts/{script}", str(out)], cwd=REPO_ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        stdout, _ = process.communicate(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)
        stdout, _ = process.communicate(timeout=120)
        pytest.fail(f"{script} took over {SCRIPT_TIMEOUT_S} s:\n{stdout[-4000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout)


def assert_all_stopped(out: Path, ports: list[int]) -> None:
    """No server process of the run is left, and nothing listens on its ports."""
    for log in out.glob("server-*.log"):
        for pid in re.findall(r"Started server process \[(\d+)\]", log.read_text()):
            with pytest.raises(ProcessLookupError):
                os.kill(int(pid), 0)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            assert sock.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still open"


def printed_json(stdout: str) -> dict:
    return json.loads(stdout[stdout.rindex('\n{\n  "') + 1:])


def assert_latencies(level: dict, *figures: str) -> None:
    for figure in figures:
        p50, p90 = level[f"{figure}_p50_ms"], level[f"{figure}_p90_ms"]
        assert p90 >= p50 > 0, (figure, level)


# The NixlConnector's pulls are tested in tests/engine/test_nixl_connector.py; the script
# passes CONNECTOR through as it passes MuseConnector.
@pytest.mark.parametrize("connector", ["MuseConnector"])
def test_pd_disagg_dry_run(tmp_path: Path, connector: str) -> None:
    port, kv_port = free_ports(3), free_ports(1)
    result = run_script("pd_disagg_h200.sh", tmp_path, {
        **PD_SIZES, "CONNECTOR": connector, "PORT": str(port), "KV_PORT": str(kv_port)})
    assert result.returncode == 0, result.stdout[-4000:]
    summary = json.loads((tmp_path / "pd_disagg.json").read_text())
    assert printed_json(result.stdout) == summary
    assert summary["model"] == "muse-spark-tiny" and summary["connector"] == connector
    assert set(summary["setups"]) == {"pd", "tp2"}
    assert summary["failed_kv_pulls"] == 0  # the decode instance pulled every prompt
    for workload in ("shared-prefix", "agentic"):
        row = summary[workload]
        assert set(row) == {"pd", "tp2", "pd_vs_tp2"}
        for setup in ("pd", "tp2"):
            assert set(row[setup]) == LEVELS
            for level in row[setup].values():
                assert_latencies(level, "ttft", "itl")
                assert level["completed"] > 0 and level["failed"] == 0
        assert set(row["pd_vs_tp2"]) == LEVELS
        for change in row["pd_vs_tp2"].values():
            assert set(change) == {"ttft_p50_ms_change", "ttft_p90_ms_change",
                                   "itl_p50_ms_change", "itl_p90_ms_change"}
            assert all(value > -1 for value in change.values())
    # Both setups replayed the traces written from the prefill instance.
    for workload in ("shared-prefix", "agentic"):
        trace = str(tmp_path / f"{workload}-trace-trace.jsonl")
        for setup in ("pd", "tp2"):
            config = json.loads((tmp_path / f"{workload}-{setup}.json").read_text())["config"]
            assert config["trace"] == trace
    assert_all_stopped(tmp_path, [port, port + 1, port + 2, kv_port])


def test_pd_disagg_stops_its_servers_when_a_step_fails(tmp_path: Path) -> None:
    # An agentic trace that cannot be generated: the script fails with its three processes up.
    port, kv_port = free_ports(3), free_ports(1)
    result = run_script("pd_disagg_h200.sh", tmp_path, {
        **PD_SIZES, "AGENTIC_TURNS": "5:2", "PORT": str(port), "KV_PORT": str(kv_port)})
    assert result.returncode != 0
    assert (tmp_path / "server-router.log").exists()
    assert not (tmp_path / "pd_disagg.json").exists()
    assert_all_stopped(tmp_path, [port, port + 1, port + 2, kv_port])


def test_context_parallel_dry_run(tmp_path: Path) -> None:
    port = free_ports(1)
    result = run_script("context_parallel_h200.sh", tmp_path, {**CP_SIZES, "PORT": str(port)})
    assert result.returncode == 0, result.stdout[-4000:]
    summary = json.loads((tmp_path / "context_parallel.json").read_text())
    assert printed_json(result.stdout) == summary
    assert summary["num_gpus"] == 2
    # On two ranks CP_SIZE=2 leaves TP=1: PCP=2 against TP=2.
    assert summary["layouts"] == {
        "tp": "--tensor-parallel-size 2",
        "cp": "--tensor-parallel-size 1 --prefill-context-parallel-size 2"}
    assert summary["workload"]["input_tokens"] == 64
    for name in ("tp", "cp"):
        assert set(summary["p50_ttft_ms"][name]) == set(summary["p90_ttft_ms"][name]) == LEVELS
        for level in LEVELS:
            p50, p90 = summary["p50_ttft_ms"][name][level], summary["p90_ttft_ms"][name][level]
            assert p90 >= p50 > 0
    assert set(summary["p90_ttft_change"]) == LEVELS
    for level, change in summary["p90_ttft_change"].items():
        p90 = summary["p90_ttft_ms"]
        assert change == pytest.approx(p90["cp"][level] / p90["tp"][level] - 1)
    assert summary["announced"]["p90_ttft_change"] == [-0.28, -0.42]
    assert summary["failed"] == {"tp": 0, "cp": 0}
    # The cp server replayed the tp server's trace.
    config = json.loads((tmp_path / "shared-prefix-cp.json").read_text())["config"]
    assert config["trace"] == str(tmp_path / "shared-prefix-tp-trace.jsonl")
    assert_all_stopped(tmp_path, [port])
