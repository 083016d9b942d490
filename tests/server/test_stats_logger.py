"""While busy the server logs throughput, queue and KV usage every interval; idle, nothing."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from muse.server.messages import EngineStats
from muse.server.metrics import ServerMetrics
from muse.server.serving import ServerOptions
from muse.server.stats_logger import log_stats_while_running


def run_logger_for(client, metrics: ServerMetrics, seconds: float) -> None:
    options = ServerOptions(served_model_name="m", log_stats_interval_s=0.05)

    async def scenario() -> None:
        task = asyncio.create_task(log_stats_while_running(client, metrics, options))
        await asyncio.sleep(seconds)
        task.cancel()

    asyncio.run(scenario())


def test_busy_engine_is_logged(caplog):
    metrics = ServerMetrics("m")
    metrics.generation_tokens.inc(500)
    client = SimpleNamespace(stats=EngineStats(running=3, waiting=2, kv_usage=0.25,
                                               prefix_cache_queries=10, prefix_cache_hits=5))
    with caplog.at_level(logging.INFO, logger="muse.server"):
        run_logger_for(client, metrics, 0.2)
    lines = [r.getMessage() for r in caplog.records if "throughput" in r.getMessage()]
    assert lines
    assert "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%" in lines[0]
    assert "Prefix cache hit rate: 50.0%" in lines[0]


def test_idle_engine_is_not_logged(caplog):
    client = SimpleNamespace(stats=EngineStats())
    with caplog.at_level(logging.INFO, logger="muse.server"):
        run_logger_for(client, ServerMetrics("m"), 0.2)
    assert not [r for r in caplog.records if "throughput" in r.getMessage()]
