"""No single request can stall or exhaust the server: body size, read time, response size,
queue length. Each test drives a real `muse serve` as a hostile client would."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.live_server import MAX_MODEL_LEN, MODEL, LiveServer, start_server, stop_server
from tests.server.helpers import engine_idle, wait_until

# The shared server's default body limit is 4 MiB above its longest prompt.
HUGE_BODY_BYTES = 20 * 2**20
# The roomy server accepts bodies this large, so they are parsed (in a thread) and refused
# for their length instead.
ROOMY_LIMIT = 40 * 2**20
BODY_TIMEOUT_S = 2.0
HEADER_TIMEOUT_S = 1.0
# Generous bounds on things that should take milliseconds: a hang fails, a slow CPU does not.
HEALTH_TIMEOUT_S = 1.0
CLOSE_WITHIN_S = 15.0


@pytest.fixture(scope="module")
def roomy_server(server_logs: Path) -> Iterator[LiveServer]:
    live = start_server(server_logs, "--max-model-len", str(MAX_MODEL_LEN),
                        "--max-request-body-bytes", str(ROOMY_LIMIT),
                        "--request-body-timeout", str(BODY_TIMEOUT_S),
                        "--header-read-timeout", str(HEADER_TIMEOUT_S))
    yield live
    stop_server(live)


def completion_body(num_bytes: int) -> bytes:
    """A valid completions body of about `num_bytes` whose prompt is far too long."""
    return json.dumps({"model": MODEL, "prompt": "a" * num_bytes, "max_tokens": 1}).encode()


def post_while_checking_health(server: LiveServer, body: bytes) -> tuple[httpx.Response, int]:
    """Post `body`; meanwhile /health must answer each time within HEALTH_TIMEOUT_S."""
    with ThreadPoolExecutor(1) as pool:
        posted = pool.submit(httpx.post, f"{server.v1}/completions", content=body,
                             headers={"content-type": "application/json"}, timeout=120)
        checks = 0
        while not posted.done() or checks == 0:
            assert httpx.get(f"{server.base_url}/health",
                             timeout=HEALTH_TIMEOUT_S).status_code == 200
            checks += 1
            time.sleep(0.05)
        return posted.result(), checks


def test_a_huge_body_gets_413_and_health_stays_responsive(server):
    response, _ = post_while_checking_health(server, completion_body(HUGE_BODY_BYTES))
    assert response.status_code == 413, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and "--max-request-body-bytes" in \
        error["message"]


def test_a_huge_chunked_body_gets_413(server):
    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is counted as it comes
        body = completion_body(HUGE_BODY_BYTES)
        for start in range(0, len(body), 2**20):
            yield body[start:start + 2**20]

    response = httpx.post(f"{server.v1}/completions", content=chunks(), timeout=120,
                          headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_a_large_body_is_parsed_off_the_event_loop(roomy_server):
    response, _ = post_while_checking_health(roomy_server, completion_body(30 * 2**20))
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def front_end_rss_bytes(server: LiveServer) -> int:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_front_end_memory_stays_bounded_under_large_bodies(roomy_server):
    body = completion_body(5 * 2**20)
    with roomy_server.http() as http:
        http.post("/v1/completions", content=body)  # warm up the allocator once
        start = front_end_rss_bytes(roomy_server)
        for _ in range(50):
            response = http.post("/v1/completions", content=body,
                                 headers={"content-type": "application/json"})
            assert response.status_code == 400
    assert front_end_rss_bytes(roomy_server) - start < 500 * 2**20


def test_a_body_sent_too_slowly_gets_408(roomy_server):
    port = int(roomy_server.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=CLOSE_WITHIN_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"pro")
        reply = _read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"request_timeout" in reply


def test_half_sent_headers_are_dropped(roomy_server):
    port = int(roomy_server.base_url.rsplit(":", 1)[1])
    sockets = [socket.create_connection(("127.0.0.1", port), timeout=CLOSE_WITHIN_S)
               for _ in range(50)]
    try:
        for sock in sockets:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        start = time.monotonic()
        for sock in sockets:
            _read_until_closed(sock)  # raises socket.timeout if the server holds on
        assert time.monotonic() - start < CLOSE_WITHIN_S
    finally:
        for sock in sockets:
            sock.close()
    assert httpx.get(f"{roomy_server.base_url}/health", timeout=30).status_code == 200


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_response_with_too_many_logprobs_is_refused(server):
    with server.client() as client:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], n=128,
                max_tokens=MAX_MODEL_LEN // 2, logprobs=True, top_logprobs=20)
    assert "--max-response-logprobs" in refused.value.message
    assert refused.value.param == "max_tokens"


def test_many_prompts_times_n_count_against_the_queue(guarded_server):
    """The guarded server lets one sample wait: 500 prompts x 8 samples cannot pass."""
    with guarded_server.client() as client:
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=MODEL, prompt=["hi"] * 500, n=8, max_tokens=2)
    assert refused.value.status_code == 429 and refused.value.code == "overloaded"
    assert refused.value.response.headers.get("retry-after")
    wait_until(lambda: engine_idle(guarded_server.base_url, guarded_server.api_key), 30,
               "nothing was queued")


def test_concurrent_arrivals_cannot_overfill_the_queue(guarded_server):
    """Admission reserves room before tokenizing, so simultaneous requests are counted."""
    async def scenario() -> list:
        async with guarded_server.async_client() as client:
            return await asyncio.gather(*(
                client.completions.create(model=MODEL, prompt="hi", max_tokens=64,
                                          extra_body={"ignore_eos": True})
                for _ in range(8)), return_exceptions=True)

    outcomes = asyncio.run(scenario())
    served = [o for o in outcomes if not isinstance(o, Exception)]
    refused = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
    assert len(served) + len(refused) == 8, outcomes
    # One runs (max_num_seqs 1) and one waits: at most two can be admitted at once.
    assert 1 <= len(served) <= 2 and refused


def test_a_huge_enum_schema_compiles_while_others_decode(server):
    """A 30k-value enum takes seconds to compile; it must not stall anyone else."""
    enum = {"type": "object", "required": ["v"], "additionalProperties": False,
            "properties": {"v": {"enum": [f"value-{i}" for i in range(30_000)]}}}
    with server.client() as client, ThreadPoolExecutor(1) as pool:
        slow = pool.submit(
            client.chat.completions.create, model=MODEL, max_tokens=8,
            messages=[{"role": "user", "content": "pick"}],
            # Thinking off: the grammar holds from the first token (no reasoning block).
            extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
            response_format={"type": "json_schema",
                             "json_schema": {"name": "v", "schema": enum}})
        time.sleep(0.5)  # the schema is in the engine, compiling
        quick = client.completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                          extra_body={"ignore_eos": True})
        assert quick.usage.completion_tokens == 4
        # The order is the behaviour: an engine waiting for the compile could not have
        # finished the quick request while the slow one was still compiling.
        assert not slow.done(), "the compile finished before the check: not a test"
        # It then runs as usual (8 tokens may not close the object: only its start is JSON).
        assert '{"v": "value-'.startswith(slow.result().choices[0].message.content[:13])
