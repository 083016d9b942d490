"""A live `muse serve` of the tiny preset (random weights), shared by the benchmark tests.

Started once per session as a real subprocess with prefix caching on (the default), as users
run it; the benchmark talks to it over HTTP like to any OpenAI-compatible server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def muse_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a running tiny-model server."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("bench-server") / "server.log"
    command = [sys.executable, "-m", "muse.cli", "serve", "muse-spark-tiny", "--host",
               "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        # Its own session, so teardown reaches the engine process it spawns too.
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"muse serve exited while starting:\n"
                                   f"{log_path.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"muse serve did not start in {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        # Whatever of its session is left (a hung server, an orphaned engine core).
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
