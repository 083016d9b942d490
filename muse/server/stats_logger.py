"""A log line every few seconds while the server is busy: throughput, queue and KV usage."""

from __future__ import annotations

import asyncio
import logging
import time

from muse.server.engine_client import EngineClient
from muse.server.metrics import ServerMetrics
from muse.server.serving import ServerOptions

logger = logging.getLogger("muse.server")


def _total(metrics: ServerMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": metrics.model_name})
    return value or 0.0


async def log_stats_while_running(client: EngineClient, metrics: ServerMetrics,
                                  options: ServerOptions) -> None:
    interval = options.log_stats_interval_s
    if not interval:
        return
    last_time = time.monotonic()
    last = (0.0, 0.0)
    while True:
        await asyncio.sleep(interval)
        stats = client.stats
        metrics.update_engine(stats)
        now = time.monotonic()
        totals = (_total(metrics, "vllm:prompt_tokens_total"),
                  _total(metrics, "vllm:generation_tokens_total"))
        busy = stats.running or stats.waiting or totals != last
        if busy:
            elapsed = now - last_time
            hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries \
                if stats.prefix_cache_queries else 0.0
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%", (totals[0] - last[0]) / elapsed,
                (totals[1] - last[1]) / elapsed, stats.running, stats.waiting,
                100 * stats.kv_usage, 100 * hit_rate)
        last_time, last = now, totals
