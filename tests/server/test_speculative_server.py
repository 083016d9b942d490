"""`muse serve --speculative-config`: replies equal the plain server's, and /metrics carries
vLLM's speculative-decoding counters."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live_server import LiveServer, start_server, stop_server

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
PROMPT = "one two three one two three one two three one two"


@pytest.fixture(scope="module")
def servers(server_logs: Path) -> Iterator[tuple[LiveServer, LiveServer]]:
    plain = start_server(server_logs)
    try:
        speculative = start_server(server_logs, "--speculative-config", json.dumps(NGRAM))
    except BaseException:
        stop_server(plain)
        raise
    yield plain, speculative
    stop_server(speculative)
    stop_server(plain)


def counter(metrics: str, name: str) -> float:
    values = re.findall(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+]+)$", metrics, re.MULTILINE)
    return sum(float(v) for v in values)


def test_replies_equal_the_plain_server_and_counters_move(servers):
    plain, speculative = servers
    replies = []
    for server in (plain, speculative):
        with server.client() as client:
            model = client.models.list().data[0].id
            reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=24,
                                              temperature=0.0)
            # A stop string from the middle of the reply ends both at the same token.
            words = reply.choices[0].text.split()
            stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=24,
                                                temperature=0.0, stop=[words[len(words) // 2]])
            replies.append([(r.choices[0].text, r.choices[0].finish_reason,
                             r.usage.completion_tokens) for r in (reply, stopped)])
    assert replies[0] == replies[1]
    # Engine totals reach the front end a few times a second.
    deadline = time.monotonic() + 10
    with speculative.http() as http:
        while True:
            metrics = http.get("/metrics").text
            if counter(metrics, "vllm:spec_decode_num_drafts_total") or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.2)
    drafts = counter(metrics, "vllm:spec_decode_num_drafts_total")
    draft_tokens = counter(metrics, "vllm:spec_decode_num_draft_tokens_total")
    accepted = counter(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    per_position = counter(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert drafts > 0 and draft_tokens >= drafts
    assert 0 <= accepted <= draft_tokens and per_position == accepted
