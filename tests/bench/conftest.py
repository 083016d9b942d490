"""A live `muse serve` of the tiny preset (random weights), shared by the benchmark tests.

Started once per session with prefix caching on (the default), as users run it; the
benchmark talks to it over HTTP like to any OpenAI-compatible server.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.live_server import start_server, stop_server


@pytest.fixture(scope="session")
def muse_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a running tiny-model server."""
    live = start_server(tmp_path_factory.mktemp("bench-server"))
    yield live.base_url
    stop_server(live)
