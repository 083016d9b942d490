"""The server's own prefix-cache counters, read from `/metrics` before and after a level.

Known names: vLLM's counters (which muse also exposes). Servers without them (SGLang exposes
only a rate) report None, and the usage-based hit rate stands alone.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

# (hits, queries), both in prompt tokens.
PREFIX_CACHE_SAMPLES = (
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"),
)


async def prefix_cache_counters(http: httpx.AsyncClient) -> tuple[float, float] | None:
    """(hits, queries) summed over label sets, or None where the server has neither."""
    try:
        response = await http.get("/metrics")
        response.raise_for_status()
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    except (httpx.HTTPError, ValueError):
        return None
    for hits, queries in PREFIX_CACHE_SAMPLES:
        if hits in totals and queries in totals:
            return totals[hits], totals[queries]
    return None


def prefix_cache_delta(before: tuple[float, float] | None, after: tuple[float, float] | None
                       ) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    hits, queries = after[0] - before[0], after[1] - before[1]
    return {"server_hits_tokens": hits, "server_queries_tokens": queries,
            "server_hit_rate": hits / queries if queries > 0 else None}
