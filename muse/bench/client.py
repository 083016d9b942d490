"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Plain httpx and SSE parsing rather than the openai client: less work per chunk on the client,
so at high concurrency the timings measure the server, not the load generator.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class RequestOptions:
    model: str
    endpoint: str = "chat"
    # Generate exactly max_tokens (muse, vLLM, SGLang accept `ignore_eos`), so runs repeat.
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class StreamResult:
    ttft_s: float | None = None  # request sent -> first output chunk
    e2e_s: float = 0.0  # request sent -> end of the stream
    itl_s: list[float] = field(default_factory=list)  # gaps between output chunks
    text: str = ""  # the reply's content, to carry the conversation on
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if sent
    error: str | None = None

    @property
    def num_chunks(self) -> int:
        return len(self.itl_s) + (self.ttft_s is not None)


def message_text(message: dict[str, Any]) -> str:
    content = message.get("content") or ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def request_body(history: list[dict[str, Any]], max_tokens: int, options: RequestOptions
                 ) -> dict[str, Any]:
    """The JSON body for a conversation; for completions the messages' texts are joined."""
    # Greedy, so that a conversation carried on with the server's replies repeats.
    body: dict[str, Any] = {"model": options.model, "max_tokens": max_tokens,
                            "temperature": 0.0, "stream": True,
                            # Usage in every chunk (vLLM, SGLang and muse send it) times
                            # each token, even one that adds no text.
                            "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    if options.endpoint == "chat":
        body["messages"] = history
    else:
        body["prompt"] = "\n\n".join(message_text(m) for m in history)
    if options.ignore_eos:
        body["ignore_eos"] = True
    body.update(options.extra_body)
    return body


def body_digest(body: dict[str, Any]) -> str:
    """A fingerprint of exactly what was sent, to show two runs sent the same requests."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()
                          ).hexdigest()


def _output(choice: dict[str, Any]) -> tuple[bool, str]:
    """(whether this chunk carries generated text, the part that belongs to the reply)."""
    if "text" in choice:
        return bool(choice["text"]), choice["text"] or ""
    delta = choice.get("delta") or {}
    content = delta.get("content") or ""
    produced = bool(content or delta.get("reasoning_content") or delta.get("reasoning")
                    or delta.get("tool_calls"))
    return produced, content


def _completion_tokens(event: dict[str, Any]) -> int | None:
    usage = event.get("usage")
    return usage.get("completion_tokens") if isinstance(usage, dict) else None


def _read_usage(result: StreamResult, usage: dict[str, Any]) -> None:
    result.prompt_tokens = usage.get("prompt_tokens")
    result.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens")


async def stream_request(http: httpx.AsyncClient, endpoint: str, body: dict[str, Any]
                         ) -> StreamResult:
    result = StreamResult()
    parts: list[str] = []
    start = time.perf_counter()
    last = start
    tokens_so_far = 0
    try:
        async with http.stream("POST", ENDPOINTS[endpoint], json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {detail[:500]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"stream error: {json.dumps(event['error'])[:500]}"
                    return result
                if event.get("usage"):
                    _read_usage(result, event["usage"])
                # With per-chunk usage a chunk produced tokens when the count grew (its text
                # may be empty: a partial character, a hidden special token); without it,
                # when it carries text.
                counted = _completion_tokens(event)
                for choice in event.get("choices") or []:
                    produced, text = _output(choice)
                    if counted is not None:
                        produced = counted > tokens_so_far
                    if not produced:
                        parts.append(text)
                        continue
                    now = time.perf_counter()
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                    else:
                        # Microseconds are plenty, and keep the results file small.
                        result.itl_s.append(round(now - last, 6))
                    last = now
                    parts.append(text)
                if counted is not None:
                    tokens_so_far = max(tokens_so_far, counted)
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    finally:
        result.e2e_s = time.perf_counter() - start
    result.text = "".join(parts)
    if result.completion_tokens is None:
        result.error = "the server sent no usage (stream_options.include_usage)"
    return result
