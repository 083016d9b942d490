"""The disaggregated router: each chat or completions request is prefilled by a prefill
instance (`--kv-transfer-config '{"kv_role": "kv_producer"}'`), then decoded by a decode
instance (`kv_consumer`) that pulls the prompt's KV blocks from it, and the decode
instance's answer (a stream or a whole reply) goes back to the client as it comes.
Without prefill instances, requests go whole to the decode instances (plain instances).

With encoder instances (`--encode`; `--ec-transfer-config '{"ec_role": "ec_producer", ...}'`)
a chat request with media parts goes to one of them first (E/P/D): it encodes the media
into the EC connector's storage and answers without tokens, and the prefill (or decode)
instance, an `ec_consumer`, reads the encoder outputs from there instead of encoding. An
encoder instance that cannot be reached or fails is skipped; with none left the request
goes on and the next instance encodes its media itself.

- The prefill request is the client's with one output token, no stream, one sample and
  `kv_transfer_params: {"do_remote_decode": true}`; its reply's `kv_transfer_params` say
  where the blocks are, and go into the decode request (vLLM's protocol).
- Instances are chosen round-robin, or (`--routing least_loaded`) by the fewest running and
  waiting requests in their `/metrics` (read at most every second).
- A prefill instance that cannot be reached, answers 5xx or times out is skipped and the
  next one tried; a decode instance likewise, before the reply starts. With none left the
  client gets a 503 in OpenAI's error shape. A 4xx (a bad request) goes back as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from muse.router.launch import ROUTING  # noqa: E402  (one list of the policies)
LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
MEDIA_PARTS = ("image_url", "video_url", "audio_url", "input_audio")
METRICS_TTL_S = 1.0


class NoInstance(Exception):
    """No instance of a role could take the request."""


@dataclass
class Pool:
    """The instances of one role and how the next is chosen."""

    urls: list[str]
    routing: str = "round_robin"
    turn: itertools.count = field(default_factory=itertools.count)
    load: dict[str, tuple[float, float]] = field(default_factory=dict)  # url -> (load, when)

    async def order(self, client: httpx.AsyncClient) -> list[str]:
        """Every instance, the preferred first."""
        start = next(self.turn) % len(self.urls)
        rotated = self.urls[start:] + self.urls[:start]
        if self.routing != "least_loaded":
            return rotated
        loads = await asyncio.gather(*(self._load(client, url) for url in rotated))
        return [url for _, url in sorted(zip(loads, rotated), key=lambda pair: pair[0])]

    async def _load(self, client: httpx.AsyncClient, url: str) -> float:
        cached = self.load.get(url)
        if cached is not None and time.monotonic() - cached[1] < METRICS_TTL_S:
            return cached[0]
        try:
            text = (await client.get(f"{url}/metrics", timeout=2.0)).text
            value = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith(LOAD_METRICS))
        except (httpx.HTTPError, ValueError, IndexError):
            value = float("inf")  # unreachable: tried last
        self.load[url] = (value, time.monotonic())
        return value


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "service_unavailable"
                                   if status == 503 else "invalid_request_error",
                                   "param": None, "code": status}}, status_code=status)


def one_token_body(body: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """The client's request as a one-token, unstreamed, single-sample one."""
    short = {key: value for key, value in body.items()
             if key not in ("stream", "stream_options", "max_completion_tokens",
                            "kv_transfer_params")}
    short.update(max_tokens=1, stream=False, n=1, **fields)
    return short


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    return one_token_body(body, kv_transfer_params={"do_remote_decode": True})


def has_media(body: dict[str, Any]) -> bool:
    """Whether a chat request has image, video or audio parts."""
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(part, dict) and part.get("type") in MEDIA_PARTS
        for message in messages if isinstance(message, dict)
        and isinstance(message.get("content"), list) for part in message["content"])


def build_router(prefill: list[str], decode: list[str], routing: str = "round_robin",
                 timeout_s: float = 600.0, api_key: str | None = None,
                 encode: list[str] | None = None) -> FastAPI:
    if routing not in ROUTING:
        raise ValueError(f"routing must be one of {ROUTING}, got {routing!r}")
    if not decode:
        raise ValueError("the router needs at least one decode instance")
    prefill_pool, decode_pool = Pool(prefill, routing), Pool(decode, routing)
    encode_pool = Pool(list(encode or []), routing)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="muse router", lifespan=lifespan)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def first_answer(pool: Pool, path: str, body: dict[str, Any]
                           ) -> httpx.Response | None:
        """The first reply below 500 from the pool's instances in its order (those that cannot
        be reached or fail are skipped); None when none answers."""
        for url in await pool.order(client):
            try:
                reply = await client.post(f"{url}{path}", json=body, headers=headers)
            except httpx.HTTPError:
                continue
            if reply.status_code < 500:
                return reply
        return None

    def passed_on(reply: httpx.Response) -> Response:
        return Response(reply.content, reply.status_code, media_type="application/json")

    async def run_encode(body: dict[str, Any]) -> Response | None:
        """Have an encoder instance encode the request's media; a 4xx reply to give the
        client (bad media), or None to go on (encoded, or no encoder instance could)."""
        reply = await first_answer(encode_pool, "/v1/chat/completions", one_token_body(body))
        return passed_on(reply) if reply is not None and reply.status_code >= 400 else None

    async def run_prefill(path: str, body: dict[str, Any]) -> dict[str, Any] | Response:
        """The prefill reply's `kv_transfer_params`, or the response to give the client."""
        reply = await first_answer(prefill_pool, path, prefill_body(body))
        if reply is None:
            raise NoInstance("no prefill instance could take the request")
        if reply.status_code >= 400:
            return passed_on(reply)
        return reply.json().get("kv_transfer_params") or {}

    async def run_decode(path: str, body: dict[str, Any]) -> Response:
        for url in await decode_pool.order(client):
            request = client.build_request("POST", f"{url}{path}", json=body, headers=headers)
            try:
                reply = await client.send(request, stream=True)
            except httpx.HTTPError:
                continue
            if reply.status_code >= 500:
                await reply.aclose()
                continue
            if not body.get("stream") or reply.status_code >= 400:
                content = await reply.aread()
                await reply.aclose()
                return Response(content, reply.status_code, media_type="application/json")
            return StreamingResponse(_relay(reply), media_type="text/event-stream")
        raise NoInstance("no decode instance could take the request")

    async def route(path: str, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except json.JSONDecodeError as exc:
            return error(400, f"the body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object")
        try:
            if encode_pool.urls and path == "/v1/chat/completions" and has_media(body):
                refused = await run_encode(body)
                if refused is not None:
                    return refused
            if not prefill_pool.urls:
                return await run_decode(path, body)
            transfer = await run_prefill(path, body)
            if isinstance(transfer, Response):
                return transfer
            return await run_decode(path, {**body, "kv_transfer_params": transfer})
        except NoInstance as exc:
            return error(503, str(exc))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await route("/v1/chat/completions", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await route("/v1/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        for url in await decode_pool.order(client):
            try:
                reply = await client.get(f"{url}/v1/models", headers=headers)
                return Response(reply.content, reply.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        return error(503, "no decode instance answers")

    @app.get("/health")
    async def health() -> Response:
        async def up(url: str) -> bool:
            try:
                return (await client.get(f"{url}/health", timeout=2.0)).status_code == 200
            except httpx.HTTPError:
                return False
        ups = await asyncio.gather(*(up(url) for url in prefill + decode))
        fine = (not prefill or any(ups[:len(prefill)])) and any(ups[len(prefill):])
        return Response(status_code=200 if fine else 503)

    return app


async def _relay(reply: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in reply.aiter_raw():
            yield chunk
    finally:
        await reply.aclose()
