"""ASGI middleware that runs before any route: API keys, body size and body read time.

Pure ASGI (not Starlette's `BaseHTTPMiddleware`), so streamed responses and disconnects pass
through untouched.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from muse.server.errors import APIError, error_response

# Paths anyone may call even with --api-key: a load balancer's liveness probe.
OPEN_PATHS = frozenset({"/health"})
# A body over the limit is read and dropped (up to this much more) before the 413 goes out,
# so that clients which send the whole body before reading the reply still see the 413.
DRAIN_LIMIT_BYTES = 64 * 2**20


class RequireAPIKey:
    """Every path but /health needs `Authorization: Bearer KEY`, compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS \
                or scope["method"] == "OPTIONS":  # CORS preflights carry no credentials
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            response = error_response(APIError(401, "invalid or missing API key",
                                               code="invalid_api_key"))
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimits(Protocol):
    """Read at each request: the size limit may be set once the engine is ready."""

    max_request_body_bytes: int
    request_body_timeout_s: float


class BufferedBody:
    """Read the whole body up front, within `max_bytes` and `timeout_s`, then hand it on.

    Over the size: 413, without parsing anything. Too slow (a client that stops sending
    halfway): 408. Routes then read the buffered body at once; later `receive` calls go to the
    server, so disconnects are still seen.
    """

    def __init__(self, app: ASGIApp, limits: BodyLimits) -> None:
        self.app, self.limits = app, limits

    @property
    def max_bytes(self) -> int:
        return self.limits.max_request_body_bytes

    @property
    def timeout_s(self) -> float:
        return self.limits.request_body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        try:
            declared = int(dict(scope["headers"]).get(b"content-length", b"-1"))
        except ValueError:
            declared = -1
        try:
            body = await asyncio.wait_for(self._read(receive, declared), self.timeout_s)
        except asyncio.TimeoutError:
            error = APIError(408, f"the request body was not received within "
                                  f"{self.timeout_s:g} s", code="request_timeout",
                             headers={"Connection": "close"})
            await error_response(error)(scope, receive, send)
            return
        if body is None:
            size = f"{declared} bytes" if declared >= 0 else "more bytes"
            error = APIError(413, f"the request body has {size}; this server accepts at most "
                                  f"{self.max_bytes} (--max-request-body-bytes)",
                             code="request_too_large")
            await error_response(error)(scope, receive, send)
            return
        if body is False:  # the client left while sending
            return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive, declared: int) -> bytes | None | bool:
        """The body; None when over the limit (after draining a bounded amount); False when
        the client disconnected."""
        chunks, size = [], 0
        too_large = declared > self.max_bytes
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                too_large = True
                chunks.clear()
            if not too_large:
                chunks.append(chunk)
            if not message.get("more_body", False) or size > self.max_bytes + DRAIN_LIMIT_BYTES:
                break
        return None if too_large else b"".join(chunks)


class CountRequests:
    """Counts every finished HTTP request once, in `muse_requests_total{status}`.

    An error status is counted as `http_<status>`. A successful one is `finished`, unless a
    generation the route listed in `scope["state"]["generations"]` ended early: then its
    outcome (`abort` when the client left, `error`). Counting here, after the response and
    its cleanup have ended, covers every path (routing errors, auth, limits, exceptions)
    exactly once.
    """

    def __init__(self, app: ASGIApp, counter, skip_paths: frozenset[str]) -> None:
        self.app, self.counter, self.skip_paths = app, counter, skip_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.skip_paths:
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        state = scope.setdefault("state", {})
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            outcomes = {g.outcome for g in state.get("generations", ())}
            if status == 499:
                outcome = "abort"
            elif status >= 400:
                outcome = f"http_{status}"
            else:
                outcome = "error" if "error" in outcomes else \
                    "abort" if "abort" in outcomes else "finished"
            self.counter.labels(status=outcome).inc()
