"""serve/connections.py against the uvicorn installed: it subclasses uvicorn's private H11Protocol (pyproject.toml
bounds uvicorn to the tested minor series), so these tests name what it relies on and fail on that, in process,
before any service starts."""

from __future__ import annotations

import asyncio
import json

import pytest
import uvicorn
from uvicorn.server import ServerState

from drgrpo_jax.serve.connections import guarded_protocol


class _Transport(asyncio.Transport):
    """Records what the protocol writes and whether it closed the connection."""

    def __init__(self):
        super().__init__()
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data):
        self.written.append(bytes(data))

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)


@pytest.fixture
def connect():
    """A guarded protocol over a fake transport, on its own event loop."""
    loop = asyncio.new_event_loop()
    config = uvicorn.Config(app=lambda scope, receive, send: None, log_level="warning")
    config.load()

    def connected(max_connections=8, max_header_bytes=1024):
        protocol = guarded_protocol(10.0, max_connections, max_header_bytes)(
            config=config, server_state=ServerState(), app_state={}, _loop=loop)
        transport = _Transport()
        protocol.connection_made(transport)
        return protocol, transport

    yield connected
    loop.close()


def test_the_private_names_it_relies_on_are_there():
    from uvicorn.protocols.http import h11_impl

    assert hasattr(h11_impl, "H11Protocol"), "uvicorn moved H11Protocol: serve/connections.py must follow it"
    missing = [name for name in ("connection_made", "data_received", "on_response_complete", "connection_lost",
                                 "send_400_response") if not callable(getattr(h11_impl.H11Protocol, name, None))]
    assert not missing, f"uvicorn's H11Protocol lost {missing}: serve/connections.py overrides them"


def test_a_connection_carries_the_state_it_reads(connect):
    protocol, transport = connect()
    for name in ("conn", "connections", "loop", "transport"):  # read by _GuardedH11
        assert hasattr(protocol, name), f"uvicorn's H11Protocol no longer sets self.{name}"
    assert protocol in protocol.connections and not transport.closed
    protocol.connection_lost(None)


def test_headers_over_the_limit_are_refused_in_the_services_error_shape(connect):
    protocol, transport = connect(max_header_bytes=64)
    protocol.data_received(b"GET /health HTTP/1.1\r\nhost: localhost\r\nx-pad: " + b"a" * 100 + b"\r\n\r\n")
    head, _, body = b"".join(transport.written).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and transport.closed
    assert json.loads(body)["error"]["code"] == 400


def test_connections_beyond_the_cap_are_answered_503(connect):
    protocol, transport = connect(max_connections=0)
    assert b"".join(transport.written).startswith(b"HTTP/1.1 503") and transport.closed
