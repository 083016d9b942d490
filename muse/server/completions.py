"""`/v1/completions`: one or several prompts, `echo`, logprobs, streaming."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse

from muse.engine.sampling_params import SamplingParams
from muse.server.engine_client import EngineClient
from muse.server.generation import GenerationState, generate, kv_transfer_reply
from muse.server.metrics import ServerMetrics
from muse.server.protocol import CompletionRequest
from muse.server.responses import (
    ClosingStreamingResponse,
    completion_logprobs,
    first_then_rest,
    now,
    sse,
    stream_error,
)
from muse.server.serving import ServerOptions, lora_name_for, response_model


def _usage(states: list[GenerationState]) -> dict[str, Any]:
    prompt = sum(s.num_prompt_tokens for s in states)
    output = sum(s.num_output_tokens for s in states)
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output,
            "prompt_tokens_details": {"cached_tokens": sum(s.num_cached_tokens
                                                           for s in states)}}


async def completion(request: CompletionRequest, prompts: list[list[int]],
                     params: list[SamplingParams], client: EngineClient, tokenizer,
                     options: ServerOptions, metrics: ServerMetrics, request_id: str,
                     states: list[GenerationState]):
    n = request.n
    streams = []
    for p, (prompt, sampling) in enumerate(zip(prompts, params)):
        if request.echo and request.logprobs is not None:
            sampling.prompt_logprobs = request.logprobs
        updates = generate(client, tokenizer, f"{request_id}-{p}", prompt, sampling, metrics,
                           states[p], cache_salt=request.cache_salt,
                           kv_transfer_params=request.kv_transfer_params,
                           lora_name=lora_name_for(request.model, options))
        streams.append((await first_then_rest(updates))[1])
    head = {"id": request_id, "created": now(),
            "model": response_model(request.model, options)}
    echo_texts = [tokenizer.decode(p, skip_special_tokens=True) if request.echo else ""
                  for p in prompts]
    if request.stream:
        return ClosingStreamingResponse(
            _stream(request, streams, states, echo_texts, tokenizer, head),
            media_type="text/event-stream")
    finish: dict[tuple[int, int], Any] = {}
    logprobs: dict[tuple[int, int], list] = {}

    async def drain(p: int) -> None:
        async for update in streams[p]:
            logprobs.setdefault((p, update.index), []).extend(update.logprobs)
            if update.finish_reason is not None:
                finish[(p, update.index)] = (update.finish_reason, update.stop_reason)

    await asyncio.gather(*(drain(p) for p in range(len(prompts))))
    choices = []
    for p, state in enumerate(states):
        for index in range(n):
            text = echo_texts[p] + state.texts.get(index, "")
            entry = None
            if request.logprobs is not None:
                entries = (state.prompt_logprobs or []) if request.echo else []
                entry = completion_logprobs(tokenizer, entries + logprobs.get((p, index), []))
            reason, stop = finish.get((p, index), (None, None))
            choices.append({"index": p * n + index, "text": text, "logprobs": entry,
                            "finish_reason": reason, "stop_reason": stop})
    transfer = kv_transfer_reply(client, request.kv_transfer_params, f"{request_id}-0") \
        if len(prompts) == 1 else None
    return JSONResponse({**head, "object": "text_completion", "choices": choices,
                         "usage": _usage(states),
                         **({"kv_transfer_params": transfer} if transfer else {})})


async def _stream(request: CompletionRequest, streams: list[AsyncIterator],
                  states: list[GenerationState], echo_texts: list[str], tokenizer,
                  head: dict) -> AsyncIterator[str]:
    n = request.n
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    continuous_usage = include_usage and request.stream_options.continuous_usage_stats
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: int) -> None:
        try:
            async for update in streams[p]:
                # The usage as of this update: by the time the chunk is written, the other
                # pumps (or this one) may have counted later tokens.
                await queue.put((p, update, _usage(states) if continuous_usage else None))
        except Exception as error:  # noqa: BLE001 - sent to the client as an error event
            await queue.put((p, error, None))
        finally:
            await queue.put((p, None, None))

    tasks = [asyncio.create_task(pump(p)) for p in range(len(streams))]
    echoed: set[tuple[int, int]] = set()
    offsets: dict[tuple[int, int], int] = {}  # text offset of each choice's next token
    remaining = len(streams)
    try:
        while remaining:
            p, update, usage_then = await queue.get()
            if update is None:
                remaining -= 1
                continue
            if isinstance(update, Exception):
                yield stream_error(update)
                yield sse("[DONE]")
                return
            text, entries = update.text, list(update.logprobs)
            key = (p, update.index)
            if request.echo and key not in echoed:
                echoed.add(key)
                text = echo_texts[p] + text
                entries = (states[p].prompt_logprobs or []) + entries
            logprobs = None
            if request.logprobs is not None:
                logprobs = completion_logprobs(tokenizer, entries, offsets.get(key, 0))
                offsets[key] = offsets.get(key, 0) + sum(len(t) for t in logprobs["tokens"] if t)
            yield sse({**head, "object": "text_completion", "choices": [{
                "index": p * n + update.index, "text": text, "logprobs": logprobs,
                "finish_reason": update.finish_reason, "stop_reason": update.stop_reason}],
                **({"usage": usage_then} if continuous_usage else {})})
        if include_usage:
            yield sse({**head, "object": "text_completion", "choices": [],
                       "usage": _usage(states)})
        yield sse("[DONE]")
    finally:
        # A client that went away ends this stream early: the pumps' cancellation closes their
        # update streams, which aborts the requests; wait for it so none is left half done.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
