"""What the service trusts: API keys (Bearer, constant-time), the Host header, body sizes and weight-path roots,
checked by `Guard` before any route runs and by `confine_weight_path` before a weight push is loaded."""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

OPEN_PATHS = frozenset({"/health"})  # GET /health answers without a key: launchers and load balancers probe it
# The admin key, when one is set, is required here.
ADMIN_PATHS = frozenset({"/update_weights_from_disk", "/update_weights_from_tensor"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
REMOTE_SCHEMES = ("gs://", "file://")  # URI schemes a weight root may name: a bucket prefix (file:// in tests)


class PathNotAllowed(Exception):
    """A weight path outside every --weights-root (HTTP 403); the message names the rule, never the disk."""


def is_loopback(host: str) -> bool:
    """Whether binding to `host` keeps the service on this machine."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclasses.dataclass(frozen=True)
class Keys:
    """The keys read from the environment at start-up ("" = none)."""

    api_key: str = ""
    admin_key: str = ""


def read_keys(api_key_env: str, admin_key_env: str, environ: Mapping[str, str] | None = None) -> Keys:
    """The keys from the named environment variables; ValueError naming the flag when a named variable is empty."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    keys = {}
    for flag, name in (("api_key_env", api_key_env), ("admin_key_env", admin_key_env)):
        value = env.get(name, "") if name else ""
        if name and not value.strip():
            raise ValueError(f"{flag}: environment variable {name} is not set or empty")
        keys[flag] = value.strip()
    return Keys(keys["api_key_env"], keys["admin_key_env"])


def _same(given: str, key: str) -> bool:
    """Constant-time comparison (no timing oracle on how much of the key matched)."""
    return bool(key) and hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode())


def _bearer(headers: dict[bytes, bytes]) -> str:
    """The token of `Authorization: Bearer <token>` ("" when absent)."""
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def authorized(path: str, token: str, keys: Keys) -> bool:
    """Whether `token` may call `path`: the admin key is needed on admin routes when set, either key elsewhere."""
    if path in OPEN_PATHS or not (keys.api_key or keys.admin_key):
        return True
    if path in ADMIN_PATHS and keys.admin_key:
        return _same(token, keys.admin_key)
    return _same(token, keys.api_key) or _same(token, keys.admin_key) or not keys.api_key


def _host_name(headers: dict[bytes, bytes]) -> str:
    """The Host header without its port (IPv6 brackets removed)."""
    host = headers.get(b"host", b"").decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


class _TooLarge(Exception):
    """The body grew past the limit while being read."""


class Guard:
    """ASGI middleware: key, Host and body-size checks before any route runs.

    It answers 401 without a valid key (every route but `GET /health`), 400 for a non-loopback `Host` on a
    loopback-bound service (DNS rebinding), and 413 for a body over the limit.
    """

    def __init__(self, app: Any, *, keys: Keys, max_body_bytes: int, loopback_only: bool):
        self.app, self.keys, self.max_body_bytes, self.loopback_only = app, keys, max_body_bytes, loopback_only

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.loopback_only and _host_name(headers) not in LOOPBACK_NAMES:
            await _reply(send, 400, "Host: this service is bound to loopback and answers only localhost names")
            return
        if not authorized(scope["path"], _bearer(headers), self.keys):
            await _reply(send, 401, "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                         code="invalid_api_key", extra=[(b"www-authenticate", b"Bearer")])
            return
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await _reply(send, 413, f"body: {int(length)} bytes exceed the limit of {self.max_body_bytes}")
            return
        await self._counted(scope, receive, send)

    async def _counted(self, scope: dict, receive: Any, send: Any) -> None:
        """Runs the app with a receive that stops a (chunked) body at the limit; 413 if nothing was sent yet."""
        received, started = 0, False

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _TooLarge
            return message

        async def tracking_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if not started:
                await _reply(send, 413, f"body: exceeds the limit of {self.max_body_bytes} bytes")


async def _reply(send: Any, status: int, message: str, *, code: str | int | None = None,
                 extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """An OpenAI-style error answer sent straight through ASGI."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "code": status if code is None else code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra]})
    await send({"type": "http.response.body", "body": body})


# ---------------------------------------------------------------- weight paths

def _clean_remote(path: str) -> str | None:
    """`scheme://rest` with no empty, `.` or `..` segment, else None."""
    scheme, _, rest = path.partition("://")
    parts = rest.split("/")
    if not scheme or any(p in ("", ".", "..") for p in parts[:-1]) or parts[-1] in (".", ".."):
        return None
    return f"{scheme}://{rest.rstrip('/')}"


def normalize_roots(roots: Sequence[str]) -> tuple[str, ...]:
    """Roots as compared: local ones absolute with symlinks resolved, bucket prefixes cleaned; ValueError if bad."""
    out = []
    for root in roots:
        if "://" in root:
            clean = _clean_remote(root)
            if clean is None or not root.startswith(REMOTE_SCHEMES):
                raise ValueError(f"weights_roots: {root!r} is neither a local folder nor a gs://bucket/prefix")
            out.append(clean)
        else:
            out.append(os.path.realpath(os.path.abspath(root)))
    return tuple(out)


def confine_weight_path(path: str, roots: Sequence[str], *, required: bool) -> str:
    """The path to load (symlinks resolved) when `path` lies under one of `roots` (normalized); else PathNotAllowed.

    Decided without touching the model files. With no roots: refused when `required` (a service beyond
    loopback), else any path, as it is.
    """
    if not roots:
        if required:
            raise PathNotAllowed("model_path: not allowed: this service has no --weights-root, so it loads no "
                                 "weight updates")
        return path
    rule = "model_path: not allowed: weights load only from folders under the service's --weights-root"
    if "://" in path:
        clean = _clean_remote(path)
        if clean is not None and any(r.startswith(REMOTE_SCHEMES) and (clean == r or clean.startswith(r + "/"))
                                     for r in roots):
            return clean
        raise PathNotAllowed(rule + " (a URI only under a configured gs:// prefix, without '.' or '..')")
    if not os.path.isabs(path):
        raise PathNotAllowed(rule + " (an absolute path)")
    real = os.path.realpath(path)
    for root in roots:
        if "://" not in root and (real == root or real.startswith(root.rstrip(os.sep) + os.sep)):
            return real
    raise PathNotAllowed(rule + " (after resolving symlinks and '..')")

