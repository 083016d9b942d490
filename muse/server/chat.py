"""`/v1/chat/completions`: whole replies and SSE streams with reasoning and tool calls."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from muse.server.engine_client import EngineClient
from muse.server.generation import GenerationState, generate, kv_transfer_reply
from muse.server.metrics import ServerMetrics
from muse.server.parsers.chat_output import ChatOutputParser, DeltaMessage
from muse.server.protocol import ChatCompletionRequest
from muse.server.responses import (ClosingStreamingResponse, chat_logprobs, first_then_rest,
                                   now, sse, stream_error, usage)
from muse.server.serving import (CHAT_HIDDEN_TOKEN_IDS, ChatPlan, ServerOptions, lora_name_for,
                                 response_model)


def _finish_reason(reason: str | None, made_tool_calls: bool) -> str | None:
    return "tool_calls" if made_tool_calls and reason == "stop" else reason


def _delta_json(delta: DeltaMessage) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if delta.reasoning_content:
        body["reasoning_content"] = delta.reasoning_content
    if delta.content:
        body["content"] = delta.content
    if delta.tool_calls:
        body["tool_calls"] = [
            {"index": call.index,
             **({"id": call.id, "type": "function"} if call.id else {}),
             "function": {**({"name": call.name} if call.name else {}),
                          "arguments": call.arguments}}
            for call in delta.tool_calls]
    return body


async def chat_completion(request: ChatCompletionRequest, plan: ChatPlan, client: EngineClient,
                          tokenizer, options: ServerOptions, metrics: ServerMetrics,
                          request_id: str, state: GenerationState):
    updates = generate(client, tokenizer, request_id, plan.prompt_token_ids, plan.params,
                       metrics, state, CHAT_HIDDEN_TOKEN_IDS, plan.media, request.cache_salt,
                       request.kv_transfer_params, lora_name_for(request.model, options))
    _, updates = await first_then_rest(updates)
    parsers = [ChatOutputParser(plan.parse_reasoning, plan.parse_tools, plan.tools,
                                plan.thinking) for _ in range(plan.params.n)]
    head = {"id": request_id, "created": now(),
            "model": response_model(request.model, options)}
    if request.stream:
        return ClosingStreamingResponse(
            _stream(request, plan, updates, parsers, tokenizer, state, head),
            media_type="text/event-stream")
    logprobs: dict[int, list] = {i: [] for i in range(plan.params.n)}
    finish: dict[int, str | None] = {}
    async for update in updates:
        logprobs[update.index].extend(update.logprobs)
        if update.finish_reason is not None:
            finish[update.index] = update.finish_reason
    choices = []
    for index, parser in enumerate(parsers):
        parsed = parser.parse(state.texts.get(index, ""))
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning_content is not None:
            message["reasoning_content"] = parsed.reasoning_content
        if parsed.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in parsed.tool_calls]
        choices.append({
            "index": index, "message": message,
            "logprobs": chat_logprobs(tokenizer, logprobs[index])
            if plan.params.logprobs is not None else None,
            "finish_reason": _finish_reason(finish.get(index), bool(parsed.tool_calls))})
    transfer = kv_transfer_reply(client, request.kv_transfer_params, request_id)
    return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                         "usage": usage(state),
                         **({"kv_transfer_params": transfer} if transfer else {})})


async def _stream(request: ChatCompletionRequest, plan: ChatPlan, updates: AsyncIterator,
                  parsers: list[ChatOutputParser], tokenizer, state: GenerationState,
                  head: dict) -> AsyncIterator[str]:
    chunk = {**head, "object": "chat.completion.chunk"}
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    continuous_usage = include_usage and request.stream_options.continuous_usage_stats
    made_tool_calls = [False] * plan.params.n

    def choice(index: int, delta: dict, finish: str | None = None, logprobs=None) -> str:
        body = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        chunk_usage = usage(state) if continuous_usage else None
        return sse({**chunk, "choices": [body],
                    **({"usage": chunk_usage} if include_usage else {})})

    for index in range(plan.params.n):
        yield choice(index, {"role": "assistant", "content": ""})
    try:
        async for update in updates:
            parser = parsers[update.index]
            delta = parser.feed(update.text)
            if update.finish_reason is not None:
                tail = parser.finish()
                delta = DeltaMessage(
                    (delta.reasoning_content or "") + (tail.reasoning_content or "") or None,
                    (delta.content or "") + (tail.content or "") or None,
                    delta.tool_calls + tail.tool_calls)
            made_tool_calls[update.index] |= bool(delta.tool_calls)
            logprobs = chat_logprobs(tokenizer, update.logprobs) \
                if plan.params.logprobs is not None and update.logprobs else None
            if not delta.is_empty() or logprobs or (continuous_usage and update.token_ids):
                yield choice(update.index, _delta_json(delta), logprobs=logprobs)
            if update.finish_reason is not None:
                yield choice(update.index, {}, _finish_reason(update.finish_reason,
                                                              made_tool_calls[update.index]))
    except Exception as error:  # the stream has begun: an error event, then its end
        yield stream_error(error)
        yield sse("[DONE]")
        return
    finally:
        # A client that went away closes this stream; closing `updates` aborts the request.
        await updates.aclose()
    if include_usage:
        yield sse({**chunk, "choices": [], "usage": usage(state)})
    yield sse("[DONE]")
