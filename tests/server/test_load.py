"""Many concurrent streaming clients, some of which hang up midway.

Every client that stays gets its whole reply; the ones that leave have their requests
aborted, so once all are done the KV cache holds no blocks of finished requests.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.live_server import MAX_MODEL_LEN, MODEL
from tests.server.helpers import engine_idle, metric, read_metrics, wait_until

NUM_CLIENTS = 64
NUM_LEAVING = 16  # every fourth client
MAX_TOKENS = 48
CHUNKS_BEFORE_LEAVING = 3
IDLE_TIMEOUT_S = 30.0
NO_EOS = {"ignore_eos": True}


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Client {i} asks about llama number {i * 7}."}]


async def chat_to_the_end(client, i: int) -> dict:
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages(i), max_tokens=MAX_TOKENS, seed=i, stream=True,
        logprobs=True, top_logprobs=0, stream_options={"include_usage": True},
        extra_body=NO_EOS)
    finish, usage, num_logprobs = None, None, 0
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                num_logprobs += len(choice.logprobs.content)
            finish = choice.finish_reason or finish
    return {"client": i, "finish": finish, "tokens": num_logprobs,
            "usage": usage.completion_tokens if usage else None}


async def complete_to_the_end(client, i: int) -> dict:
    stream = await client.completions.create(
        model=MODEL, prompt=f"Client {i} writes about llama number {i * 7}",
        max_tokens=MAX_TOKENS, seed=i, stream=True, logprobs=0,
        stream_options={"include_usage": True}, extra_body=NO_EOS)
    finish, usage, num_tokens = None, None, 0
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            num_tokens += len(choice.logprobs.tokens)
            finish = choice.finish_reason or finish
    return {"client": i, "finish": finish, "tokens": num_tokens,
            "usage": usage.completion_tokens if usage else None}


async def leave_midway(client, i: int) -> dict:
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages(i), max_tokens=MAX_TOKENS, seed=i, stream=True,
        extra_body=NO_EOS)
    received = 0
    async for _ in stream:
        received += 1
        if received == CHUNKS_BEFORE_LEAVING:
            break
    await stream.close()
    return {"client": i, "left_after": received}


def test_concurrent_streams_with_clients_leaving_midway(server):
    wait_until(lambda: engine_idle(server.base_url), IDLE_TIMEOUT_S, "the engine going idle")
    before = read_metrics(server.base_url)

    async def run_clients():
        async with server.async_client() as client:
            work = []
            for i in range(NUM_CLIENTS):
                if i % 4 == 3:
                    work.append(leave_midway(client, i))
                elif i % 2 == 0:
                    work.append(chat_to_the_end(client, i))
                else:
                    work.append(complete_to_the_end(client, i))
            return await asyncio.gather(*work)

    results = asyncio.run(run_clients())
    leaving = [r for r in results if "left_after" in r]
    staying = [r for r in results if "left_after" not in r]
    assert len(leaving) == NUM_LEAVING and len(staying) == NUM_CLIENTS - NUM_LEAVING
    assert all(r["left_after"] == CHUNKS_BEFORE_LEAVING for r in leaving)
    for result in staying:
        assert result["finish"] == "length", result
        assert result["tokens"] == result["usage"] == MAX_TOKENS, result

    # Eventually-true: the aborted requests' blocks are returned and nothing runs.
    wait_until(lambda: engine_idle(server.base_url), IDLE_TIMEOUT_S,
               "the KV cache emptying (muse_kv_cache_blocks_used 0, no requests running)")

    def grew(samples, status: str) -> float:
        return metric(samples, "muse_requests_total", status=status) - \
            metric(before, "muse_requests_total", status=status)

    def ended(samples) -> float:
        return grew(samples, "finished") + grew(samples, "abort")

    # Each request ends exactly once: finished, or aborted when its client left first. The
    # front end counts a request when its response has ended, which can be just after the
    # engine went idle.
    wait_until(lambda: ended(read_metrics(server.base_url)) >= NUM_CLIENTS, IDLE_TIMEOUT_S,
               "every request being counted finished or aborted")
    after = read_metrics(server.base_url)
    assert grew(after, "finished") >= len(staying)
    assert ended(after) == NUM_CLIENTS


def test_server_serves_after_the_load(server, client):
    reply = client.completions.create(model=MODEL, prompt="After the storm", max_tokens=6,
                                      extra_body=NO_EOS)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6


def test_client_giving_up_on_a_whole_reply_aborts_it(server):
    """A non-streamed request whose client goes away is aborted, not run to the end."""
    wait_until(lambda: engine_idle(server.base_url), IDLE_TIMEOUT_S, "the engine going idle")
    before = read_metrics(server.base_url)
    # The client stops waiting long before the reply can be whole, and hangs up.
    with server.client(timeout=2.0) as impatient, pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model=MODEL, messages=messages(0),
                                          max_tokens=MAX_MODEL_LEN - 64, extra_body=NO_EOS)
    wait_until(lambda: engine_idle(server.base_url), IDLE_TIMEOUT_S,
               "the abandoned request releasing its KV blocks")
    after = read_metrics(server.base_url)
    for status, expected in (("abort", 1), ("finished", 0)):
        grew = metric(after, "muse_requests_total", status=status) - \
            metric(before, "muse_requests_total", status=status)
        assert grew == expected, status
