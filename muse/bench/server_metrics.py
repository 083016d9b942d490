"""The server's own counters, read from `/metrics` before and after a level: prefix-cache hits
and speculative-decoding acceptance.

Known names: vLLM's counters (which muse also exposes). Servers without them (SGLang exposes
only a prefix-cache rate) report None, and the usage-based hit rate stands alone.
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Counter totals by sample name; a labelled sample is also kept under "name{label=value}".
Counters = dict[str, float]

# (hits, queries), both in prompt tokens.
PREFIX_CACHE_SAMPLES = (
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"),
)
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


async def server_counters(http: httpx.AsyncClient) -> Counters | None:
    """Every sample summed over label sets, or None where `/metrics` cannot be read."""
    try:
        response = await http.get("/metrics")
        response.raise_for_status()
        totals: Counters = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
                for label, value in sample.labels.items():
                    key = f"{sample.name}{{{label}={value}}}"
                    totals[key] = totals.get(key, 0.0) + sample.value
    except (httpx.HTTPError, ValueError):
        return None
    return totals


def prefix_cache_delta(before: Counters | None, after: Counters | None
                       ) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    for hits_name, queries_name in PREFIX_CACHE_SAMPLES:
        if hits_name in after and queries_name in after:
            hits = after[hits_name] - before.get(hits_name, 0.0)
            queries = after[queries_name] - before.get(queries_name, 0.0)
            return {"server_hits_tokens": hits, "server_queries_tokens": queries,
                    "server_hit_rate": hits / queries if queries > 0 else None}
    return None


def spec_decode_delta(before: Counters | None, after: Counters | None) -> dict[str, Any] | None:
    """Speculative decoding over the level: drafts (one per request and step that had them),
    draft and accepted tokens, the mean acceptance length (tokens per target forward of a
    request, the one extra token included: 1 + accepted / drafts) and the acceptance rate of
    each draft position. None where the server does not speculate or exposes no counters."""
    if before is None or after is None or SPEC_DRAFTS not in after:
        return None

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = delta(SPEC_DRAFTS)
    if drafts <= 0:
        return None
    positions = sorted(int(key.split("=")[1].rstrip("}")) for key in after
                       if key.startswith(SPEC_ACCEPTED_PER_POSITION + "{position="))
    accepted, draft_tokens = delta(SPEC_ACCEPTED), delta(SPEC_DRAFT_TOKENS)
    return {
        "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
        "mean_acceptance_length": 1.0 + accepted / drafts,
        "acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else None,
        "accepted_per_position": [
            delta(f"{SPEC_ACCEPTED_PER_POSITION}{{position={p}}}") / drafts for p in positions],
    }
