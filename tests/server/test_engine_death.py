"""When the engine core process dies, the server says so: requests fail, none hang."""

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


@pytest.fixture
def doomed_server(server_logs: Path) -> Iterator[LiveServer]:
    live = start_server(server_logs)
    yield live
    stop_server(live)


@pytest.fixture
def client(doomed_server: LiveServer) -> Iterator[openai.OpenAI]:
    with doomed_server.client(timeout=CLIENT_TIMEOUT_S) as live_client:
        yield live_client


def test_engine_death_fails_requests_instead_of_hanging(doomed_server, client):
    server = doomed_server
    engine_pid = engine_core_pid(server.process.pid)

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                            **LONG)
    chunks = iter(stream)
    next(chunks)
    with ThreadPoolExecutor(1) as pool:
        whole = pool.submit(client.completions.create, model=MODEL, prompt="Keep talking",
                            **LONG)
        wait_until(lambda: metric(read_metrics(server.base_url),
                                  "muse_num_requests_running") == 2, 30,
                   "both requests running")
        os.kill(engine_pid, signal.SIGKILL)

        # The in-flight stream ends with an error event, not a hang or a clean end.
        with pytest.raises(openai.APIError) as stream_failure:
            for _ in chunks:
                pass
        assert not isinstance(stream_failure.value, openai.APIConnectionError)
        assert "engine" in str(stream_failure.value).lower()

        # The in-flight whole request fails with a 500 (its body is checked last).
        with pytest.raises(openai.InternalServerError) as whole_failure:
            whole.result(timeout=2 * CLIENT_TIMEOUT_S)
        assert whole_failure.value.status_code == 500

    def health_status() -> int:
        return httpx.get(f"{server.base_url}/health", timeout=CLIENT_TIMEOUT_S).status_code

    wait_until(lambda: health_status() == 503, 30, "/health reporting the dead engine")
    health = httpx.get(f"{server.base_url}/health", timeout=CLIENT_TIMEOUT_S)
    assert health.json()["reason"]

    for create in (
        lambda: client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4),
        lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=4),
        lambda: client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                               stream=True),
    ):
        with pytest.raises(openai.InternalServerError) as refused:
            create()
        assert refused.value.status_code == 500
        assert refused.value.code == "engine_dead"
        assert refused.value.type == "internal_server_error"

    # Like every other error, the in-flight request's 500 is OpenAI-shaped.
    response = whole_failure.value.response
    assert response.headers["content-type"].startswith("application/json"), response.text
    assert whole_failure.value.code == "engine_dead"
