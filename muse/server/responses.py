"""OpenAI response bodies and SSE framing shared by chat and completions."""

from __future__ import annotations

import json
import logging
import time
from contextlib import aclosing
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Send

from muse.engine.request import TokenLogprobs
from muse.server.engine_client import EngineDeadError, RequestError
from muse.server.errors import APIError, error_body
from muse.server.generation import GenerationState, SampleUpdate

logger = logging.getLogger("muse.server")


def usage(state: GenerationState) -> dict[str, Any]:
    return {"prompt_tokens": state.num_prompt_tokens,
            "completion_tokens": state.num_output_tokens,
            "total_tokens": state.num_prompt_tokens + state.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": state.num_cached_tokens}}


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def now() -> int:
    return int(time.time())


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, entries: list[TokenLogprobs]) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(tokenizer, token_id), "logprob": logprob,
                "bytes": list(tokenizer.token_bytes(token_id))}

    return {"content": [{**item(e.token_id, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}


def completion_logprobs(tokenizer, entries: list[TokenLogprobs | None],
                        text_offset: int = 0) -> dict[str, Any]:
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for entry in entries:
        if entry is None:  # the first prompt token has no logprob
            tokens.append(None)
            token_logprobs.append(None)
            top.append(None)
            offsets.append(offset)
            continue
        text = token_text(tokenizer, entry.token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        top.append({token_text(tokenizer, t): lp for t, lp in entry.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


class ClosingStreamingResponse(StreamingResponse):
    """An SSE response that closes its body generator however the response ends.

    When the client goes away Starlette cancels the task writing the body, which can leave the
    generator suspended at a `yield`: its cleanup (aborting the request in the engine, counting
    it in the metrics) would then wait for the garbage collector. Closing it here, shielded from
    that cancellation, runs the cleanup before the response returns.
    """

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


async def first_then_rest(updates: AsyncIterator[SampleUpdate]
                          ) -> tuple[SampleUpdate | None, AsyncIterator[SampleUpdate]]:
    """Wait for the first update before answering, so admission errors become a 4xx."""
    try:
        first = await updates.__anext__()
    except StopAsyncIteration:
        first = None
    except RequestError as error:
        await updates.aclose()
        raise APIError(error.status, str(error), param=error.param) from None
    except EngineDeadError as error:
        await updates.aclose()
        raise APIError(503, f"the engine failed: {error}", code="engine_dead") from None

    async def rest() -> AsyncIterator[SampleUpdate]:
        # Closing `rest` closes `updates` at once (not when it is garbage collected), so a
        # request whose client left is aborted and counted before the response ends.
        async with aclosing(updates):
            if first is not None:
                yield first
            async for update in updates:
                yield update

    return first, rest()


def stream_error(error: Exception) -> str:
    """The SSE event that tells a client its stream failed after it had begun."""
    if isinstance(error, EngineDeadError):
        return sse(error_body(503, f"the engine failed: {error}", code="engine_dead"))
    if isinstance(error, RequestError):
        return sse(error_body(error.status, str(error), error.param))
    logger.error("a stream failed", exc_info=error)
    return sse(error_body(500, f"internal error ({type(error).__name__})",
                          code="internal_error"))
