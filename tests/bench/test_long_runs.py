"""What makes a long `muse bench serve` run livable: each level's results are saved as soon
as it finishes, Ctrl-C keeps them, and a log gets a progress line every few seconds."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from muse.cli import main
from tests.conftest import REPO_ROOT

# Single requests of a few tokens: levels cost the server little.
RANDOM = ["--workload", "random", "--input-tokens", "16:32", "--output-tokens", "4:4"]


def wait_for(path: Path, process: subprocess.Popen, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if process.poll() is not None:
            raise AssertionError(f"the benchmark exited early:\n{process.communicate()}")
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"no {path.name} after {timeout_s:.0f} s")


def test_ctrl_c_keeps_the_levels_that_finished(muse_server: str, tmp_path: Path) -> None:
    # Level 1 sends its two requests at once; level 2's second request arrives after
    # minutes (a Poisson rate of one per 10,000 s), so the interrupt lands inside it.
    command = [sys.executable, "-m", "muse.cli", "bench", "serve", "--base-url", muse_server,
               *RANDOM, "--num-requests", "2", "--request-rate", "inf,0.0001",
               "--output-dir", str(tmp_path), "--run-id", "cut"]
    # SIGINT's default disposition for the child, as in a terminal: a suite run as a
    # background job ignores SIGINT, and an ignored signal is inherited (the run would then
    # rightly ignore the Ctrl-C and wait for its second level).
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    path = tmp_path / "random-cut.json"
    first = wait_for(path, process)
    assert first["status"] == "running" and first["levels_finished"] == 1
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "Traceback" not in err and "interrupted: 1 of 2 levels" in err
    results = json.loads(path.read_text())
    assert results["status"] == "interrupted"
    assert (results["levels_finished"], results["levels_planned"]) == (1, 2)
    (summary,) = results["summaries"]
    assert summary["completed"] == 2 and len(results["requests"]) == 2
    assert all(r["level"] == 0 and r["error"] is None for r in results["requests"])
    assert f"results: {path}" in out and (tmp_path / "random-cut.png").exists()


def test_a_log_gets_progress_lines(muse_server: str, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no bar
    caplog.set_level(logging.INFO, logger="muse.bench")
    # Three requests arriving over about two seconds.
    main(["bench", "serve", "--base-url", muse_server, *RANDOM, "--num-requests", "3",
          "--request-rate", "1", "--progress-interval", "0.3", "--output-dir", str(tmp_path),
          "--run-id", "lines"])
    lines = [r.getMessage() for r in caplog.records
             if re.fullmatch(r"\[rate 1/s\] \d/3 requests, \d+ s, [\d.]+ output tokens/s",
                             r.getMessage())]
    assert len(lines) >= 3, caplog.text
    assert json.loads((tmp_path / "random-lines.json").read_text())["status"] == "complete"
    assert "rate 1/s:" not in sys.stderr.getvalue()  # no bar either


def test_no_progress_means_no_lines(muse_server: str, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    caplog.set_level(logging.INFO, logger="muse.bench")
    main(["bench", "serve", "--base-url", muse_server, *RANDOM, "--num-requests", "2",
          "--request-rate", "2", "--progress-interval", "0.1", "--no-progress",
          "--output-dir", str(tmp_path), "--run-id", "quiet"])
    assert "output tokens/s" not in caplog.text
