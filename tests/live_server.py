"""Starting and stopping real `muse serve` processes for tests (server and benchmark).

Each server is a subprocess on 127.0.0.1 with a free port; the engine core runs in its own
process (the default), as it does in production.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from tests.conftest import REPO_ROOT
MODEL = "muse-spark-tiny"
# The shared server's context: prompts and max_tokens beyond it must be refused.
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = 180.0
SHUTDOWN_TIMEOUT_S = 30.0
# Generous per-request limit: a request that hangs fails the test instead of blocking it.
REQUEST_TIMEOUT_S = 120.0
PARSER_FLAGS = ("--reasoning-parser", "muse", "--tool-call-parser", "muse",
                "--enable-auto-tool-choice")


@dataclass
class LiveServer:
    process: subprocess.Popen
    base_url: str
    log_path: Path
    api_key: str | None = None

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def client(self, api_key: str | None = None, timeout: float = REQUEST_TIMEOUT_S
               ) -> openai.OpenAI:
        # No retries: a 5xx or 429 must reach the test, not be retried away.
        return openai.OpenAI(base_url=self.v1, api_key=api_key or self.api_key or "unused",
                             max_retries=0, timeout=timeout)

    def async_client(self, api_key: str | None = None, timeout: float = REQUEST_TIMEOUT_S
                     ) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.v1,
                                  api_key=api_key or self.api_key or "unused",
                                  max_retries=0, timeout=timeout)

    def http(self, timeout: float = REQUEST_TIMEOUT_S) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return "<no log>"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(log_dir: Path, *flags: str, api_key: str | None = None,
                 env: dict[str, str] | None = None, model: str | None = MODEL,
                 command_name: str = "serve") -> LiveServer:
    """Start `muse serve` on `model` with `flags` (and `env` added to the environment) and
    wait until /health answers 200. `model=None` leaves it to the environment (or, with
    `command_name` "router", there is none)."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    command = [sys.executable, "-m", "muse.cli", command_name, *([model] if model else []),
               "--host", "127.0.0.1", "--port", str(port), *flags]
    if api_key is not None:
        command += ["--api-key", api_key]
    # One math thread: on a small shared CPU, spinning OpenMP threads of several processes
    # (server, engine core, tests) slow each other down by an order of magnitude.
    env = {"OMP_NUM_THREADS": "1", **os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           **(env or {})}
    with open(log_path, "wb") as log:
        # A session of its own, so teardown can reach the engine process too if need be.
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    server = LiveServer(process, f"http://127.0.0.1:{port}", log_path, api_key)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"muse {command_name} exited with {process.returncode} while "
                               f"starting:\n"
                               f"{server.log_tail()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"muse {command_name} did not become healthy in "
                       f"{STARTUP_TIMEOUT_S:.0f} s:\n"
                       f"{server.log_tail()}")


def stop_server(server: LiveServer) -> None:
    process = server.process
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=SHUTDOWN_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            pass
    # A server that crashed or hung: end its session (itself and the engine core it started).
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
