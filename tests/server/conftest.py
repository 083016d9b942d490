"""Live `muse serve` processes for the server tests.

Each configuration is started once, as a real subprocess on 127.0.0.1 with a free port, and
shared by the tests that need it: starting a server costs seconds, a request milliseconds.
The engine core runs in its own process (the default), as it does in production.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.live_server import MAX_MODEL_LEN, PARSER_FLAGS, LiveServer, start_server, stop_server


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("muse-serve-logs")


@pytest.fixture(scope="session")
def server(server_logs: Path) -> Iterator[LiveServer]:
    """The shared server: reasoning and tool-call parsers, auto tool choice."""
    live = start_server(server_logs, *PARSER_FLAGS, "--max-model-len", str(MAX_MODEL_LEN))
    yield live
    stop_server(live)


@pytest.fixture(scope="session")
def guarded_server(server_logs: Path) -> Iterator[LiveServer]:
    """A server with an API key and a one-request waiting queue (one running sequence)."""
    live = start_server(server_logs, "--max-queued-requests", "1", "--max-num-seqs", "1",
                        api_key="sk-muse-test-key")
    yield live
    stop_server(live)


@pytest.fixture
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with server.client() as live_client:
        yield live_client
