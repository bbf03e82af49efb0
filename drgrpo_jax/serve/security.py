"""What the service trusts: API keys (Bearer, constant-time), the Host header, body sizes and weight-path roots,
checked by `Guard` before any route runs and by `confine_weight_path` before a weight push is loaded."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import hmac
import ipaddress
import json
import os
import re
import stat
import tempfile
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from drgrpo_jax.config.serve import LOOPBACK_NAMES, REMOTE_SCHEMES, clean_remote
from drgrpo_jax.errors import PathNotAllowed
from drgrpo_jax.weight_folders import is_remote

OPEN_PATHS = frozenset({"/health"})  # GET /health answers without a key: launchers and load balancers probe it
# The admin key, when one is set, is required here.
ADMIN_PATHS = frozenset({"/update_weights_from_disk", "/update_weights_from_tensor"})


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


def host_of(authority: str) -> str | None:
    """The host of a Host header's `host[:port]` (lowercased; an IPv6 address without its brackets), or None
    when it is not exactly that: userinfo (`a@b`), a path, query or fragment, a port that is not digits, anything
    after the port or the brackets, characters the URL parser would drop."""
    try:
        parts = urllib.parse.urlsplit("//" + authority)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0-65535
    except ValueError:
        return None
    host = parts.hostname
    if not host or parts.netloc != authority or "@" in authority or parts.path or parts.query or parts.fragment:
        return None
    bracketed = f"[{host}]" if ":" in host else host
    if authority[:len(bracketed)].lower() != bracketed or not re.fullmatch(r"(:[0-9]*)?", authority[len(bracketed):]):
        return None
    try:  # one spelling per address: [0:0::1] is ::1
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host


def _host_name(headers: dict[bytes, bytes]) -> str | None:
    """The Host header's host (None when absent or malformed)."""
    return host_of(headers.get(b"host", b"").decode("latin-1").strip())


class Guard:
    """ASGI middleware: key, Host and body checks before any route runs.

    It answers 401 without a valid key (every route but `GET /health`), 400 for a non-loopback `Host` on a
    loopback-bound service (DNS rebinding), 413 for a body over the limit however it is sent (a declared length
    or chunks), and 408 for a body not sent within `body_timeout_s`. The body is read whole here, before the
    route, so no route ever sees a partial body or waits on a slow client.
    """

    def __init__(self, app: Any, *, keys: Keys, max_body_bytes: int, loopback_only: bool,
                 body_timeout_s: float = 30.0):
        self.app, self.keys, self.max_body_bytes, self.loopback_only = app, keys, max_body_bytes, loopback_only
        self.body_timeout_s = body_timeout_s

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
        try:
            body, too_large = await asyncio.wait_for(self._read_body(receive), self.body_timeout_s)
        except TimeoutError:
            await _reply(send, 408, f"body: not received within {self.body_timeout_s:g} s")
            return
        if too_large:
            await _reply(send, 413, f"body: exceeds the limit of {self.max_body_bytes} bytes")
            return
        if body is None:
            return  # the client left while sending: nobody to answer
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Any) -> tuple[bytes | None, bool]:
        """(the whole body, None when the client disconnected; whether reading stopped as it passed the limit)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, False
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None, True
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False


def _replay(body: bytes, receive: Any) -> Any:
    """An ASGI receive that hands over `body` once, then the client's own messages (its disconnect)."""
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


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

def confine_weight_path(path: str, roots: Sequence[str], *, required: bool) -> str:
    """`path` cleaned (bucket URIs) or normalized (local) when it lies under one of `roots` (normalized); else
    PathNotAllowed naming the rule. Total: any string a client sends gets an answer, never an exception of
    another type.

    Decided on the string alone: a local path is compared lexically, and `open_weight_folder` then walks it
    below the root refusing every symbolic link, so what is checked is what is opened. With no roots: refused
    when `required` (a service beyond loopback), else any path, as it is.
    """
    if "\x00" in path:
        raise PathNotAllowed("model_path: not allowed: a path may not contain a NUL character")
    if not roots:
        if required:
            raise PathNotAllowed("model_path: not allowed: this service has no --weights-root, so it loads no "
                                 "weight updates")
        return path
    rule = "model_path: not allowed: weights load only from folders under the service's --weights-root"
    if is_remote(path):
        clean = clean_remote(path)
        if clean is not None and any(r.startswith(REMOTE_SCHEMES) and (clean == r or clean.startswith(r + "/"))
                                     for r in roots):
            return clean
        raise PathNotAllowed(rule + " (a URI only under a configured gs:// prefix, without '.' or '..')")
    if not os.path.isabs(path):
        raise PathNotAllowed(rule + " (an absolute path)")
    if ".." in path.split(os.sep):
        raise PathNotAllowed(rule + " (without '..')")
    normal = os.path.normpath(path)
    if _root_of(normal, roots) is None:
        raise PathNotAllowed(rule)
    return normal


def _root_of(path: str, roots: Sequence[str]) -> str | None:
    """The local root that `path` (normalized) lies in or is, else None."""
    for root in roots:
        if not is_remote(root) and (path == root or path.startswith(root.rstrip(os.sep) + os.sep)):
            return root
    return None


_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a FIFO cannot hang the open
_NO_LINKS = ("model_path: not allowed: a symbolic link below the service's --weights-root ({name}); weights load "
             "only from real folders and files under it")


def _open_below(root: str, parts: Sequence[str]) -> int:
    """A descriptor of root/parts..., opened one component at a time without following a symbolic link."""
    fd = os.open(root, _OPEN_DIR)  # the root itself is the operator's (resolved at start-up)
    try:
        for part in parts:
            try:
                child = os.open(part, _OPEN_DIR, dir_fd=fd)
            except OSError as error:
                if error.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(
                        os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise PathNotAllowed(_NO_LINKS.format(name=part)) from None
                raise
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def open_weight_folder(path: str, roots: Sequence[str]) -> Iterator[str]:
    """A private folder whose entries are the regular files of `path` (confined, under a local root), each
    opened once through a descriptor with no symbolic link followed below the root: loading from it reads
    exactly the files that were checked, however the folder is changed meanwhile (no check-then-use window).

    PathNotAllowed (403) for a symbolic link on the way or among the files; OSError when the folder is missing.
    Remote and unconfined paths are handed on as they are. Linux (/proc/self/fd).
    """
    root = _root_of(path, roots) if os.path.isabs(path) else None
    if root is None:
        yield path
        return
    parts = [p for p in os.path.relpath(path, root).split(os.sep) if p not in ("", ".")]
    folder_fd = _open_below(root, parts)
    fds: list[int] = []
    try:
        with tempfile.TemporaryDirectory(prefix="drgrpo_pinned_") as view:
            for name in os.listdir(folder_fd):
                try:
                    fd = os.open(name, _OPEN_FILE, dir_fd=folder_fd)
                except OSError as error:
                    if error.errno == errno.ELOOP:
                        raise PathNotAllowed(_NO_LINKS.format(name=name)) from None
                    continue  # a subfolder opened read-only still succeeds; anything else cannot be read
                fds.append(fd)
                if stat.S_ISREG(os.fstat(fd).st_mode):  # subfolders and devices are not part of a model
                    os.symlink(f"/proc/self/fd/{fd}", os.path.join(view, name))
            yield view
    finally:
        for fd in (folder_fd, *fds):
            os.close(fd)
