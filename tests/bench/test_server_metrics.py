"""The server counters `muse bench serve` reads around a level: prefix-cache hits and the
speculative-decoding acceptance, from vLLM-named Prometheus counters."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from muse.bench.server_metrics import prefix_cache_delta, server_counters, spec_decode_delta


def metrics_text(drafts: int, draft_tokens: int, accepted: int, per_position: list[int],
                 hits: int = 0, queries: int = 0) -> str:
    lines = [
        "# TYPE vllm:prefix_cache_hits counter", f"vllm:prefix_cache_hits_total {hits}",
        "# TYPE vllm:prefix_cache_queries counter", f"vllm:prefix_cache_queries_total {queries}",
        "# TYPE vllm:spec_decode_num_drafts counter",
        f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {drafts}',
        "# TYPE vllm:spec_decode_num_draft_tokens counter",
        f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {draft_tokens}',
        "# TYPE vllm:spec_decode_num_accepted_tokens counter",
        f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {accepted}',
        "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter"]
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",'
              f'position="{p}"}} {count}' for p, count in enumerate(per_position)]
    return "\n".join(lines) + "\n"


def read(text: str):
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=text))

    async def go():
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as http:
            return await server_counters(http)

    return asyncio.run(go())


def test_acceptance_over_a_level_is_the_counters_difference():
    before = read(metrics_text(10, 30, 20, [9, 7, 4], hits=5, queries=10))
    after = read(metrics_text(20, 60, 35, [18, 12, 5], hits=25, queries=50))
    spec = spec_decode_delta(before, after)
    assert spec["num_drafts"] == 10 and spec["num_accepted_tokens"] == 15
    assert spec["mean_acceptance_length"] == pytest.approx(2.5)
    assert spec["acceptance_rate"] == pytest.approx(0.5)
    assert spec["accepted_per_position"] == pytest.approx([0.9, 0.5, 0.1])
    assert prefix_cache_delta(before, after)["server_hit_rate"] == pytest.approx(0.5)


def test_no_speculation_or_no_drafts_reports_none():
    plain = read("# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total 1\n")
    assert spec_decode_delta(plain, plain) is None
    idle = read(metrics_text(10, 30, 20, [9, 7, 4]))
    assert spec_decode_delta(idle, idle) is None  # no draft during the level
    assert spec_decode_delta(None, idle) is None
