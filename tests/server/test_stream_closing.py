"""Closing a reply's update stream aborts the request and counts it at once.

The stream is closed while the test still holds every inner generator, so nothing can be
left to the garbage collector: only an explicit close runs the cleanup in time.
"""

from __future__ import annotations

import asyncio

from muse.engine.sampling_params import SamplingParams
from muse.server.engine_client import EngineClient
from muse.server.generation import GenerationState, generate
from muse.server.messages import AbortRequest, AddRequest, SampleDelta
from muse.server.metrics import ServerMetrics
from muse.server.responses import ClosingStreamingResponse, first_then_rest


class FakeEngineClient(EngineClient):
    """Answers every request with `num_tokens` one-token deltas, at once."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__()
        self.num_tokens = num_tokens
        self.commands: list = []

    def _submit(self, command) -> None:
        self.commands.append(command)
        if isinstance(command, AddRequest):
            for i in range(self.num_tokens):
                self.queues[command.request_id].put_nowait(SampleDelta(
                    command.request_id, 0, [7], None,
                    "length" if i == self.num_tokens - 1 else None, 3, 0))


class Tokenizer:
    def decode(self, token_ids, **_) -> str:
        return "x" * len(token_ids)

    def convert_ids_to_tokens(self, token_ids):
        return ["x"] * len(token_ids)


def samples_counted(metrics: ServerMetrics, reason: str) -> float:
    """Samples the generation counted as ended for `reason` (the HTTP request itself is
    counted by the CountRequests middleware, from the state's outcome)."""
    return metrics.registry.get_sample_value(
        "vllm:request_success_total", {"model_name": "", "finished_reason": reason}) or 0.0


def test_closing_the_stream_midway_aborts_and_counts_the_request_at_once():
    async def scenario():
        client, metrics = FakeEngineClient(num_tokens=10), ServerMetrics()
        params = SamplingParams(max_tokens=10)
        state = GenerationState()
        inner = generate(client, Tokenizer(), "r1", [1, 2, 3], params, metrics, state)
        first, rest = await first_then_rest(inner)
        assert first is not None
        await rest.__anext__()
        await rest.aclose()  # what the response does when its client goes away
        # Checked inside the loop: leaving it closes every generator still open.
        assert [type(c) for c in client.commands] == [AddRequest, AbortRequest]
        assert not client.queues
        assert samples_counted(metrics, "abort") == 1 and state.outcome == "abort"
        assert samples_counted(metrics, "length") == 0
        assert inner.ag_frame is None  # closed, not waiting for the garbage collector

    asyncio.run(scenario())


def test_a_stream_read_to_the_end_counts_the_request_finished():
    async def scenario():
        client, metrics = FakeEngineClient(num_tokens=4), ServerMetrics()
        state = GenerationState()
        _, rest = await first_then_rest(generate(
            client, Tokenizer(), "r2", [1, 2, 3], SamplingParams(max_tokens=4), metrics, state))
        updates = [update async for update in rest]
        return client, metrics, state, updates

    client, metrics, state, updates = asyncio.run(scenario())
    assert [u.finish_reason for u in updates] == [None, None, None, "length"]
    assert state.num_output_tokens == 4
    assert [type(c) for c in client.commands] == [AddRequest]
    assert samples_counted(metrics, "length") == 1 and state.outcome is None
    assert samples_counted(metrics, "abort") == 0


def disconnect_at_second_chunk():
    """ASGI callables as uvicorn gives them (spec 2.3): the client leaves while the second
    chunk of the body is being written, so Starlette cancels the writer in the middle of `send`."""
    sent: list[bytes] = []
    left = asyncio.Event()

    async def receive():
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body":
            sent.append(message["body"])
            if len(sent) == 2:
                left.set()
                await asyncio.Event().wait()  # the socket never drains

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
    return sent, receive, send, scope


def test_a_client_leaving_mid_write_aborts_and_counts_the_request_before_the_response_ends():
    async def scenario():
        client, metrics = FakeEngineClient(num_tokens=10), ServerMetrics()
        state = GenerationState()
        _, rest = await first_then_rest(generate(
            client, Tokenizer(), "r3", [1, 2, 3], SamplingParams(max_tokens=10), metrics,
            state))

        async def body():
            try:
                async for update in rest:
                    yield update.text
            finally:
                await asyncio.sleep(0)  # cleanup that awaits, like the chat stream's
                await rest.aclose()

        response = ClosingStreamingResponse(body(), media_type="text/event-stream")
        sent, receive, send, scope = disconnect_at_second_chunk()
        await response(scope, receive, send)
        assert len(sent) == 2
        # The response still holds its body, so only an explicit close got here in time.
        assert [type(c) for c in client.commands] == [AddRequest, AbortRequest]
        assert samples_counted(metrics, "abort") == 1 and state.outcome == "abort"
        assert samples_counted(metrics, "length") == 0

    asyncio.run(scenario())
