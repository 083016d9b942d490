"""A server with a host-memory KV tier (`--kv-offload-gb`): a prompt whose prefix the GPU
pools lost is served from host memory, `/metrics` reports each tier, and
`POST /reset_prefix_cache` empties them all."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.helpers import random_prompt
from tests.engine.test_kv_offload import tiers, tiny_block_set_bytes
from tests.live_server import MODEL, LiveServer, start_server, stop_server
from tests.server.helpers import metric, read_metrics, wait_until

PROMPT = random_prompt(70, 1)
OTHERS = [random_prompt(70, seed) for seed in range(2, 10)]


@pytest.fixture(scope="module")
def tiered(server_logs: Path) -> Iterator[LiveServer]:
    args = tiers(tiny_block_set_bytes(), 64)
    live = start_server(server_logs, "--max-num-seqs", str(args["max_num_seqs"]),
                        "--max-num-batched-tokens", str(args["max_num_batched_tokens"]),
                        "--kv-cache-memory-bytes", str(args["kv_cache_memory_bytes"]),
                        "--hicache-size", str(args["kv_offload_gb"]))
    yield live
    stop_server(live)


def test_host_memory_serves_what_the_gpu_lost_and_reset_empties_it(tiered):
    def complete(prompt: list[int]):
        with tiered.client() as client:
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                             temperature=0)

    def host(name: str) -> float:
        return metric(read_metrics(tiered.base_url), name, tier="host")

    first = complete(PROMPT)
    for prompt in OTHERS:
        complete(prompt)
    again = complete(PROMPT)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 64
    assert again.choices[0].text == first.choices[0].text
    wait_until(lambda: host("muse:kv_tier_hit_tokens_total") == 64, 10, "the host hits counted")
    assert host("muse:kv_tier_used_bytes") > 0
    assert host("muse:kv_tier_capacity_bytes") >= host("muse:kv_tier_used_bytes")
    with tiered.http() as http:
        assert http.post("/reset_prefix_cache").status_code == 200
    assert complete(PROMPT).usage.prompt_tokens_details.cached_tokens == 0
