"""Connection hygiene under uvicorn: a connection that has not sent its request's headers within `header_timeout_s`
is answered 408 and closed (uvicorn times only idle kept-alive connections), connections beyond `max_connections`
are answered 503 and closed at once, and uvicorn's own protocol errors (a malformed request, headers over the size
limit) answer in the service's OpenAI error shape instead of plain text."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["guarded_protocol", "raw_error"]


def raw_error(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 error response, OpenAI's body, closing the connection (written past h11's state)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a header deadline, a connection cap and OpenAI-shaped protocol errors."""

    header_timeout_s: float = 10.0
    max_connections: int = 256
    max_header_bytes: int = 16 * 2**10

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0  # bytes received towards the current request's headers
        self._tail = b""  # the last bytes of them, where a blank line split across reads may begin
        if len(self.connections) > self.max_connections:
            transport.write(raw_error(503, "Service Unavailable", f"connections: more than {self.max_connections} "
                                      "open (--max-connections); retry shortly"))
            transport.close()
            return
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.transport.write(raw_error(408, "Request Timeout", "headers: not received within "
                                           f"{self.header_timeout_s:g} s (--header-timeout-s)"))
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # the next request's headers start: time them, count them
            self._arm_header_timer()
            # h11 bounds only a header block still incomplete; one that arrives whole is bounded here. The
            # bytes after the blank line are the body's: not counted.
            seen = self._tail + data
            end = seen.find(b"\r\n\r\n")
            self._header_bytes += len(data) if end < 0 else max(end + 4 - len(self._tail), 0)
            self._tail = seen[-3:]
            if self._header_bytes > self.max_header_bytes:
                self.send_400_response("headers over the size limit")
                return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request line and headers are in
            self._disarm_header_timer()
            self._header_bytes, self._tail = 0, b""

    def on_response_complete(self) -> None:
        super().on_response_complete()  # the keep-alive timer now times the idle connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._disarm_header_timer()
        self.transport.write(raw_error(400, "Bad Request", f"request: {msg.rstrip('.')} (a malformed request line, "
                                       "or headers over --max-header-bytes)"))
        self.transport.close()


def guarded_protocol(header_timeout_s: float, max_connections: int, max_header_bytes: int) -> type[Any]:
    """The protocol class handed to uvicorn.Config(http=...), with these limits."""
    return type("GuardedH11Protocol", (_GuardedH11,), {"header_timeout_s": header_timeout_s,
                                                       "max_connections": max_connections,
                                                       "max_header_bytes": max_header_bytes})
