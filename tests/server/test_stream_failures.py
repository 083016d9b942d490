"""A stream that fails after it began ends properly (an error event, then `[DONE]`), and a
tool call nested deeper than JSON can be read stays content instead of failing the reply."""

from __future__ import annotations

import asyncio
import json

from muse.engine.sampling_params import SamplingParams
from muse.server.chat import _stream
from muse.server.generation import GenerationState, SampleUpdate
from muse.server.parsers.chat_output import ChatOutputParser
from muse.server.parsers.tool_calls import parse_tool_call
from muse.server.protocol import ChatCompletionRequest
from muse.server.serving import ChatPlan
from muse.tokenizer import MuseTokenizer

DEEP = 50_000


async def failing_updates():
    yield SampleUpdate(0, "Hello", [1], [])
    raise RuntimeError("boom in the middle")


def collect_stream(updates) -> list[str]:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True)
    plan = ChatPlan([1, 2], SamplingParams(), parse_reasoning=False, parse_tools=False,
                    tools=None)

    async def run() -> list[str]:
        return [event async for event in _stream(
            request, plan, updates, [ChatOutputParser(False, False)], MuseTokenizer.base(),
            GenerationState(), {"id": "x", "created": 0, "model": "m"})]

    return asyncio.run(run())


def test_a_stream_that_fails_sends_an_error_event_then_done():
    events = collect_stream(failing_updates())
    assert events[-1] == "data: [DONE]\n\n"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "internal_error" and "RuntimeError" in error["message"]
    assert "boom" not in error["message"]  # internals stay in the log
    assert any('"Hello"' in event for event in events)


def test_a_deeply_nested_tool_call_is_not_a_call():
    body = '{"name": "f", "arguments": {"a": ' + "[" * DEEP + "]" * DEEP + "}}"
    assert parse_tool_call(body, None) is None
    parser = ChatOutputParser(reasoning=False, tools=True)
    text = f"<tool_call>{body}</tool_call>"
    whole = parser.parse(text)
    assert whole.tool_calls == [] and whole.content == text
    streamed = ChatOutputParser(reasoning=False, tools=True)
    pieces = [streamed.feed(text[i:i + 4096]) for i in range(0, len(text), 4096)]
    pieces.append(streamed.finish())
    assert "".join(p.content or "" for p in pieces) == text
    assert not any(p.tool_calls for p in pieces)
