"""uvicorn's h11 protocol with a deadline for a request's headers.

uvicorn bounds idle keep-alive connections but not a client that opens a connection and then
sends its request line and headers slowly (or never finishes them): each such connection
would be held forever. Here a connection whose request headers are not complete within
`header_timeout_s` of its opening (or of the previous response) is closed.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_overdue)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        self._header_timer = None

    def _headers_overdue(self) -> None:
        # IDLE: h11 has not seen a whole request head since the connection (or the last
        # response) began. A request being served is past IDLE and is left alone.
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def protocol_with_header_timeout(timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,),
                {"header_timeout_s": timeout_s})
