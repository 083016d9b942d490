"""When the engine core process dies, the server says so and leaves.

In-flight requests fail at once (an error event, a 503), none hang; then the front end exits
with status 1 and a clear log line, so a supervisor restarts it, and leaves no socket files
behind. With --restart-engine it starts a new engine core instead and serves again.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.live_server import MODEL, LiveServer, start_server, stop_server
from tests.server.helpers import engine_core_pid, metric, read_metrics, wait_until

MESSAGES = [{"role": "user", "content": "Keep talking."}]
# Long enough that the requests are still running when the engine is killed.
LONG = {"max_tokens": 1500, "extra_body": {"ignore_eos": True}}
# A request against a dead engine must fail well within this; a hang fails the test.
CLIENT_TIMEOUT_S = 60.0
# The front end must be gone this long after its engine died.
EXIT_TIMEOUT_S = 30.0


@pytest.fixture
def socket_root(tmp_path: Path) -> Path:
    """The server's TMPDIR, where its engine sockets live: empty again after it exits."""
    root = tmp_path / "tmp"
    root.mkdir()
    return root


def start(server_logs: Path, socket_root: Path, *flags: str) -> LiveServer:
    return start_server(server_logs, *flags, env={"TMPDIR": str(socket_root)})


@pytest.fixture
def doomed_server(server_logs: Path, socket_root: Path) -> Iterator[LiveServer]:
    live = start(server_logs, socket_root)
    yield live
    stop_server(live)


def test_engine_death_fails_requests_then_the_server_exits(doomed_server, socket_root):
    server = doomed_server
    assert _socket_dirs(socket_root), "the engine sockets live under TMPDIR"
    engine_pid = engine_core_pid(server.process.pid)
    with server.client(timeout=CLIENT_TIMEOUT_S) as client:
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                **LONG)
        chunks = iter(stream)
        next(chunks)
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(client.completions.create, model=MODEL,
                                prompt="Keep talking", **LONG)
            wait_until(lambda: metric(read_metrics(server.base_url),
                                      "vllm:num_requests_running") == 2, 30,
                       "both requests running")
            os.kill(engine_pid, signal.SIGKILL)

            # The in-flight stream ends with an error event, not a hang or a clean end.
            with pytest.raises(openai.APIError) as stream_failure:
                for _ in chunks:
                    pass
            assert not isinstance(stream_failure.value, openai.APIConnectionError)
            assert "engine" in str(stream_failure.value).lower()

            # The in-flight whole request fails with an OpenAI-shaped 503.
            with pytest.raises(openai.InternalServerError) as whole_failure:
                whole.result(timeout=2 * CLIENT_TIMEOUT_S)
    assert whole_failure.value.status_code == 503
    assert whole_failure.value.code == "engine_dead"
    response = whole_failure.value.response
    assert response.headers["content-type"].startswith("application/json"), response.text

    exit_code = server.process.wait(timeout=EXIT_TIMEOUT_S)
    assert exit_code == 1
    log = server.log_path.read_text(errors="replace")
    assert "the engine core died" in log and "exiting with status 1" in log
    assert not _socket_dirs(socket_root), "socket files left behind"


def test_restart_engine_serves_again(server_logs, socket_root):
    server = start(server_logs, socket_root, "--restart-engine")
    try:
        first_engine = engine_core_pid(server.process.pid)
        os.kill(first_engine, signal.SIGKILL)
        wait_until(lambda: _health(server) == 503, 30, "/health reporting the dead engine")
        wait_until(lambda: _health(server) == 200, 120, "the engine restarted")
        assert engine_core_pid(server.process.pid) != first_engine
        with server.client(timeout=CLIENT_TIMEOUT_S) as client:
            reply = client.completions.create(model=MODEL, prompt="hi", max_tokens=3,
                                              extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 3
        assert server.process.poll() is None
        assert len(_socket_dirs(socket_root)) == 1, "the old sockets are removed"
    finally:
        stop_server(server)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it: -SIGTERM, not a kill.
    assert server.process.returncode in (0, -signal.SIGTERM)
    assert not _socket_dirs(socket_root), "socket files left behind"


def _socket_dirs(root: Path) -> list[Path]:
    return list(root.glob("muse-*"))


def _health(server: LiveServer) -> int:
    try:
        return httpx.get(f"{server.base_url}/health", timeout=CLIENT_TIMEOUT_S).status_code
    except httpx.TransportError:
        return -1


def test_the_engine_exits_when_the_front_end_is_killed(server_logs, socket_root):
    server = start(server_logs, socket_root)
    engine_pid = engine_core_pid(server.process.pid)
    try:
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=EXIT_TIMEOUT_S)
        wait_until(lambda: not _alive(engine_pid), EXIT_TIMEOUT_S, "the orphaned engine exiting")
    finally:
        stop_server(server)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing
