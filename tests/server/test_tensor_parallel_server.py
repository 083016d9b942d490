"""`muse serve --tensor-parallel-size 2` on CPU: the OpenAI API as usual, and a worker that dies
takes the server down loudly (a log line naming the rank, a non-zero exit; requests in flight
get 503s, as tests/server/test_engine_death.py shows for any engine death)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live_server import MODEL, LiveServer, start_server, stop_server
from tests.server.helpers import child_pids, engine_core_pid

EXIT_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def tp_server(server_logs: Path) -> Iterator[LiveServer]:
    live = start_server(server_logs, "--tensor-parallel-size", "2", "--reasoning-parser",
                        "muse", "--max-model-len", "512")
    yield live
    stop_server(live)


def test_the_openai_api_works_over_two_ranks(tp_server):
    with tp_server.client() as client:
        assert [m.id for m in client.models.list().data] == [MODEL]
        whole = client.completions.create(model=MODEL, prompt="hello", max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})
        streamed = "".join(
            chunk.choices[0].text for chunk in client.completions.create(
                model=MODEL, prompt="hello", max_tokens=6, temperature=0, stream=True,
                extra_body={"ignore_eos": True}) if chunk.choices)
        assert whole.usage.completion_tokens == 6 and streamed == whole.choices[0].text
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=2,
            extra_body={"ignore_eos": True})
        assert [c.finish_reason for c in chat.choices] == ["length", "length"]


def test_a_dead_worker_stops_the_server(tp_server):
    engine = engine_core_pid(tp_server.process.pid)
    workers = [pid for pid in child_pids(engine)
               if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(workers) == 1, workers  # rank 1; rank 0 is the engine process itself
    os.kill(workers[0], signal.SIGKILL)
    # Noticed while idle: no request is needed for the server to go down.
    assert tp_server.process.wait(timeout=EXIT_WITHIN_S) == 1
    log = tp_server.log_path.read_text(errors="replace")
    assert "worker rank 1 exited" in log and "exiting with status 1" in log
