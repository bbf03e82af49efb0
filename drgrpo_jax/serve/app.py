"""build_app: the service's FastAPI application, SGLang's native routes and OpenAI's behind the Guard, every error
in OpenAI's error shape, and the port file that tells a parent process the service is ready."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from drgrpo_jax.config.serve import normalize_roots
from drgrpo_jax.errors import BadRequest, ClientGone, QueueFull
from drgrpo_jax.serve.native_routes import ROUTES as NATIVE_ROUTES
from drgrpo_jax.serve.openai_routes import ROUTES as OPENAI_ROUTES
from drgrpo_jax.serve.scheduler import Scheduler
from drgrpo_jax.serve.security import Guard, Keys
from drgrpo_jax.serve.service import Service, error_response, shown_name

__all__ = ["build_app"]

log = logging.getLogger("drgrpo_jax.serve")

_ERROR_RESPONSES = {  # documented on every route in /openapi.json (FastAPI's 422 is never answered here)
    "400": "a field out of range or malformed: the error message names it",
    "401": "missing or invalid API key (when the service has one): send 'Authorization: Bearer <key>'",
    "403": "a weight path outside every --weights-root",
    "404": "no such route",
    "405": "the route does not answer this method",
    "408": "the request's body was not sent within --body-timeout-s",
    "413": "request body over --max-body-bytes (however it is sent, chunked included)",
    "429": "queue full: retry after the Retry-After header's seconds, or on another service",
    "500": "the service failed on this request (its log says why); it goes on serving",
}
# What Starlette's and FastAPI's own errors say, in this service's words (naming the field: the body).
_OWN_MESSAGES = {"There was an error parsing the body": "body: cannot be parsed as JSON (not UTF-8, nested too "
                                                        "deep, or a number too long)"}


def _validation_message(error: RequestValidationError) -> str:
    """The first pydantic error as 'field.path: reason'."""
    first = error.errors()[0]
    if first.get("type") == "json_invalid":
        return "body: not valid JSON"
    if tuple(first.get("loc", ())) == ("body",) and isinstance(first.get("input"), bytes | str):
        return "body: must be a JSON object sent with the header 'Content-Type: application/json'"
    # Drop "body" and pydantic's union-branch labels ("SamplingParamsIn", "list[...]") from the path.
    parts = [str(p) for p in first.get("loc", ()) if p != "body" and not (isinstance(p, str) and (
        p[:1].isupper() or "[" in p))]
    location = ".".join(parts) or "body"
    return f"{location}: {first.get('msg', 'invalid')}"


async def _invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
    """A body that fails its schema: 400 (not FastAPI's 422) with 'field: reason'."""
    return error_response(400, _validation_message(error))


async def _bad_request(_: Request, error: BadRequest) -> JSONResponse:
    """A request refused by a check: 400 with the check's message."""
    return error_response(400, str(error))


async def _busy(_: Request, error: QueueFull) -> JSONResponse:
    """The queue is full: 429 with Retry-After, so a client waits or tries another service."""
    return error_response(429, f"queue: {error}", headers={"Retry-After": str(error.retry_after_s)})


async def _client_gone(_: Request, __: ClientGone) -> JSONResponse:
    """Nobody reads this answer (nginx's 499 'client closed request'); its rows were dropped."""
    return error_response(499, "client closed the request")


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own HTTP errors (a body it cannot parse, an unknown route, a wrong method) in
    the same OpenAI shape."""
    message = _OWN_MESSAGES.get(str(error.detail), str(error.detail))
    if error.status_code == 404 and message == "Not Found":
        message = f"{request.url.path}: no such route"
    elif error.status_code == 405:
        message = f"{request.url.path}: does not answer {request.method}"
    return error_response(error.status_code, message, headers=getattr(error, "headers", None))


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    """Anything unexpected: 500 in the OpenAI shape, the detail in the service's log only."""
    log.error("%s %s failed", request.method, request.url.path, exc_info=error)
    return error_response(500, "internal error: the service's log has the detail; it goes on serving")


def _write_port_file(port_file: str, port: int) -> None:
    """Writes the port through a temporary file and a rename, so the parent never reads half of it."""
    with open(port_file + ".tmp", "w") as f:
        f.write(str(port))
    os.replace(port_file + ".tmp", port_file)


@contextlib.asynccontextmanager
async def _publish_port(_: FastAPI, *, port_file: str, port: int) -> AsyncIterator[None]:
    """Lifespan: the port file is written once the app accepts requests, the parent's readiness signal."""
    if port_file:
        _write_port_file(port_file, port)  # a few bytes once at startup: blocking the loop here costs nothing
    yield


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema with the statuses this service answers: 400 where FastAPI would document 422."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        error = {"application/json": {"schema": {"type": "object", "properties": {"error": {"type": "object"}}}}}
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                responses.update({code: {"description": text, "content": error}
                                  for code, text in _ERROR_RESPONSES.items()})
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def build_app(scheduler: Scheduler, tokenizer: Any = None, *, keys: Keys | None = None, port_file: str = "",
              port: int = 0) -> FastAPI:
    """SGLang's `/generate`, `/update_weights_from_disk`, `/update_weights_from_tensor`, `/health`, ... and
    OpenAI's `/v1/*` over `scheduler`, behind the Guard; `port_file` gets `port` once the app accepts requests."""
    config = scheduler.config
    app = FastAPI(title="drgrpo_jax generation service",
                  lifespan=functools.partial(_publish_port, port_file=port_file, port=port))
    app.state.service = Service(scheduler, tokenizer, config.served_model_name or shown_name(config.model),
                                normalize_roots(config.weights_roots))
    # Starlette types a handler as taking any Exception; each of these takes only the type it is registered for.
    handlers: list[tuple[type[Exception], Any]] = [(RequestValidationError, _invalid_request),
                                                    (BadRequest, _bad_request), (QueueFull, _busy),
                                                    (ClientGone, _client_gone), (HTTPException, _http_error),
                                                    (StarletteHTTPException, _http_error),
                                                    (Exception, _internal_error)]
    for error_type, handler in handlers:
        app.add_exception_handler(error_type, handler)
    for method, path, handler in (*NATIVE_ROUTES, *OPENAI_ROUTES):
        app.add_api_route(path, handler, methods=[method])
    app.openapi = functools.partial(_openapi, app)  # type: ignore[method-assign]
    app.add_middleware(Guard, keys=keys or Keys(), max_body_bytes=config.max_body_bytes, loopback_only=config.loopback,
                       body_timeout_s=config.body_timeout_s)
    return app
