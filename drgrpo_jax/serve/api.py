"""The HTTP layer: the SGLang-native route handlers over the Engine, the checks and helpers every route shares
(openai_routes.py builds OpenAI's on them), and build_app."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

from drgrpo_jax.sampler.generate import RowRequest, SamplingParams
from drgrpo_jax.serve.engine import Engine, QueueFull, RowResult
from drgrpo_jax.serve.schemas import MAX_TEXT_CHARS, GenerateRequest, SamplingParamsIn, UpdateWeightsRequest
from drgrpo_jax.serve.security import Guard, Keys, PathNotAllowed, confine_weight_path, normalize_roots
from drgrpo_jax.serve.weights import InvalidWeights, check_newer

CHARS_PER_TOKEN = 32  # a text longer than context x this cannot fit: refused before it is tokenized
DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks that its client is still there


class BadRequest(Exception):
    """A request the service refuses (HTTP 400); the message names the field and the reason."""


class ClientGone(Exception):
    """The client disconnected while its rows were queued or running (nobody reads the answer)."""


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI-style error body (the openai client reads error.message)."""
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers)


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


def _tokenize(texts: list[str], tokenizer: Any, field: str, max_context: int) -> list[list[int]]:
    """Token ids of each text; a text that cannot fit the context is refused before tokenizing it."""
    limit = min(max_context * CHARS_PER_TOKEN, MAX_TEXT_CHARS)
    prompts = []
    for i, text in enumerate(texts):
        if len(text) > limit:
            raise BadRequest(f"{field}[{i}]: {len(text)} characters cannot fit the context of {max_context} tokens")
        try:
            prompts.append([int(t) for t in tokenizer(text)["input_ids"]])
        except Exception:  # noqa: BLE001 - whatever the tokenizer chokes on is the request's fault
            raise BadRequest(f"{field}[{i}]: the tokenizer cannot encode this text") from None
    return prompts


def _prompts(text: str | list[str] | None, input_ids: list | None, tokenizer: Any, field: str, max_context: int
             ) -> tuple[list[list[int]], bool]:
    """(token-id prompts, was it a batch) from text or ids; exactly one of them must be given."""
    if (text is None) == (input_ids is None):
        raise BadRequest(f"{field}: give exactly one of text or input_ids")
    if text is not None:
        if tokenizer is None:
            raise BadRequest(f"{field}: this server has no tokenizer; send token ids")
        texts = [text] if isinstance(text, str) else text
        return _tokenize(texts, tokenizer, field, max_context), not isinstance(text, str)
    assert input_ids is not None  # exactly one of the two was given (checked above)
    is_batch = bool(input_ids) and isinstance(input_ids[0], list)
    return (input_ids if is_batch else [input_ids]), is_batch


def _check_request(engine: Engine, prompts: list[list[int]], params: list[SamplingParamsIn], field: str,
                   params_field: str) -> None:
    """Refuses empty prompts, ids outside the vocabulary, prompts + budgets beyond the context, and requests
    over the row or token budget; all before anything is queued."""
    if not prompts:
        raise BadRequest(f"{field}: no prompts")
    vocab, limits = engine.weights.config.vocab_size, engine.config
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        if not prompt:
            raise BadRequest(f"{field}[{i}]: empty prompt")
        if max(prompt) >= vocab:
            raise BadRequest(f"{field}[{i}]: token id {max(prompt)} is outside the vocabulary of {vocab}")
        if len(prompt) + p.max_new_tokens > engine.max_context:
            raise BadRequest(f"{field}[{i}]: prompt of {len(prompt)} tokens + {p.max_new_tokens} new tokens exceeds "
                             f"the context of {engine.max_context}")
        if p.stop_token_ids and max(p.stop_token_ids) >= vocab:
            raise BadRequest(f"{params_field}stop_token_ids: token id {max(p.stop_token_ids)} is outside the "
                             f"vocabulary of {vocab}")
    rows = sum(p.n for p in params)
    if rows > limits.max_rows_per_request:
        raise BadRequest(f"n: {rows} completions exceed max_rows_per_request={limits.max_rows_per_request}")
    tokens = sum(p.n * (len(prompt) + p.max_new_tokens) for prompt, p in zip(prompts, params))
    if tokens > limits.max_request_tokens:
        raise BadRequest(f"n: prompts x n x (prompt + new tokens) = {tokens} tokens exceed "
                         f"max_request_tokens={limits.max_request_tokens}")


def _rows(prompts: list[list[int]], params: list[SamplingParamsIn], shared_seed: bool, vocab: int
          ) -> list[RowRequest]:
    """Rows prompt-major (prompt 0's n samples first); each row gets its own random stream."""
    request_seed = secrets.randbits(32)
    rows = []
    for index, (prompt, p) in enumerate(zip(prompts, params)):
        settings = SamplingParams(max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                                  top_k=min(p.top_k, vocab), stop_token_ids=tuple(p.stop_token_ids or ()),
                                  ignore_eos=p.ignore_eos)
        # One shared seed: prompts are told apart by `stream`; per-prompt seeds are used as given.
        seed = p.seed if p.seed is not None else (request_seed if shared_seed else secrets.randbits(32))
        rows += [RowRequest(tuple(prompt), settings, seed, index if shared_seed else 0, j) for j in range(p.n)]
    return rows


def _next_version(current: str) -> str:
    """Default version of an update that names none."""
    return str(int(current) + 1) if current.isdigit() else f"{current}+1"


# ---------------------------------------------------------------- shared by the handlers

@dataclasses.dataclass(frozen=True)
class Service:
    """What every route handler reads, stored on the app by build_app."""

    engine: Engine
    tokenizer: Any  # a transformers tokenizer, or None: only token-id prompts are served
    name: str  # the model's name in OpenAI responses
    weights_roots: tuple[str, ...] = ()  # normalized --weights-root folders and gs:// prefixes


def _service(request: Request) -> Service:
    """The Service of the app this request came to."""
    return request.app.state.service


async def _run(engine: Engine, rows: list[RowRequest], request: Request) -> list[RowResult]:
    """The rows' results; a failed batch answers HTTP 500 and the service keeps running.

    While waiting, the client is checked every DISCONNECT_POLL_S: once it is gone its rows are dropped
    at the next batch boundary (QueueFull, raised by submit, answers 429).
    """
    future = engine.submit(rows)
    waiter = asyncio.wrap_future(future)
    while not (await asyncio.wait({waiter}, timeout=DISCONNECT_POLL_S))[0]:
        if await request.is_disconnected():
            future.cancel()
            raise ClientGone
    try:
        return waiter.result()
    except Exception as error:
        raise HTTPException(500, f"generation failed: {type(error).__name__}: {error}") from error


def _decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text of `ids`, or "" without a tokenizer (such a server's clients read the token ids)."""
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if tokenizer is not None else ""


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


async def _invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
    """A body that fails its schema: 400 (not FastAPI's 422) with 'field: reason'."""
    return _error(400, _validation_message(error))


async def _bad_request(_: Request, error: BadRequest) -> JSONResponse:
    """A request refused by a check: 400 with the check's message."""
    return _error(400, str(error))


async def _busy(_: Request, error: QueueFull) -> JSONResponse:
    """The queue is full: 429 with Retry-After, so a client waits or tries another service."""
    return _error(429, f"queue: {error}", headers={"Retry-After": str(error.retry_after_s)})


async def _client_gone(_: Request, __: ClientGone) -> JSONResponse:
    """Nobody reads this answer (nginx's 499 'client closed request'); its rows were dropped."""
    return _error(499, "client closed the request")


async def _http_error(_: Request, error: HTTPException) -> JSONResponse:
    """FastAPI's own HTTP errors (a body it cannot parse, an unknown route) in the same OpenAI shape."""
    return _error(error.status_code, str(error.detail), headers=getattr(error, "headers", None))


# ---------------------------------------------------------------- SGLang-native routes

async def health(request: Request) -> JSONResponse:
    """GET /health: ok and the weight version while the sampler worker runs, else 503."""
    engine = _service(request).engine
    if not engine.alive:
        return _error(503, "sampler worker has stopped")
    return JSONResponse({"status": "ok", "weight_version": engine.weights.version})


async def model_info(request: Request) -> dict:
    """GET /get_model_info: SGLang's fields plus the context, vocabulary, batching, queue and LoRA adapter
    (null, or the merged adapter's path, rank, alpha and targets) of this service."""
    engine = _service(request).engine
    w = engine.weights
    return {"model_path": w.path, "tokenizer_path": engine.config.tokenizer or engine.config.model,
            "is_generation": True, "weight_version": w.version, "max_context": engine.max_context,
            "vocab_size": w.config.vocab_size, "eos_token_ids": list(w.config.eos_token_ids),
            "dtype": engine.config.dtype, "max_batch_size": engine.config.max_batch_size,
            "batches_run": engine.batches_run, "queued_tokens": engine.queued_tokens,
            "rows_dropped": engine.rows_dropped, "adapter": w.adapter}


async def weight_version(request: Request) -> dict:
    """GET /get_weight_version: the version new batches sample with."""
    return {"weight_version": _service(request).engine.weights.version}


def _update_answer(status: int, message: str, version: str) -> JSONResponse:
    """SGLang's update answer (`success`, `message`, the version now served)."""
    return JSONResponse({"success": status == 200, "message": message, "weight_version": version},
                        status_code=status)


async def update_weights(body: UpdateWeightsRequest, request: Request) -> JSONResponse:
    """POST /update_weights_from_disk: confine, load, check, swap; on failure 403/400 and the old weights serve on.

    The path is an HF model folder or a PEFT LoRA adapter folder (merged into the current base weights).
    The path must lie under a --weights-root (403 otherwise); integer versions may not go backwards
    unless the body says allow_rollback (a trainer resuming from a checkpoint); a
    load failure says only that the folder is not a valid model (the service's log has the detail).
    """
    service = _service(request)
    engine = service.engine
    version = str(body.weight_version) if body.weight_version is not None else _next_version(
        engine.weights.version)
    try:
        path = confine_weight_path(body.model_path, service.weights_roots, required=not engine.config.loopback)
        if not body.allow_rollback:
            check_newer(engine.weights.version, version)
        weights = await asyncio.to_thread(engine.update_weights, path, version, shown_path=body.model_path,
                                          allow_rollback=body.allow_rollback)
    except PathNotAllowed as error:
        return _update_answer(403, str(error), engine.weights.version)
    except InvalidWeights as error:
        return _update_answer(400, str(error), engine.weights.version)
    return _update_answer(200, "Succeeded to update model weights.", weights.version)


def _per_prompt(params: SamplingParamsIn | list[SamplingParamsIn], num_prompts: int) -> list[SamplingParamsIn]:
    """One SamplingParamsIn per prompt: a list gives each prompt its own, a single one is shared."""
    per_prompt = params if isinstance(params, list) else [params] * num_prompts
    if len(per_prompt) != num_prompts:
        raise BadRequest(f"sampling_params: {len(per_prompt)} entries for {num_prompts} prompts")
    return per_prompt


def _finish_reason(result: RowResult) -> dict:
    """SGLang's finish_reason: the stop token that ended the completion, or the length it ran to."""
    if result.stopped:
        return {"type": "stop", "matched": result.output_ids[-1]}
    return {"type": "length", "length": len(result.output_ids)}


def _generated(result: RowResult, row: RowRequest, rid: str, text: str, latency: float, return_logprob: bool
               ) -> dict:
    """One completion in SGLang's /generate shape."""
    meta = {"id": rid, "prompt_tokens": len(row.prompt_ids), "completion_tokens": len(result.output_ids),
            "finish_reason": _finish_reason(result), "weight_version": result.weight_version,
            "e2e_latency": latency}
    if return_logprob:  # SGLang's (log-prob, token id, token text) triples; the text is left out
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(result.logprobs, result.output_ids)]
    return {"text": text, "output_ids": result.output_ids, "meta_info": meta}


async def generate(body: GenerateRequest, request: Request) -> Any:
    """POST /generate: completions prompt-major, a single object when one prompt asked for one."""
    service = _service(request)
    engine = service.engine
    # Off the event loop: tokenizing long texts must not stall /health and every other client.
    prompts, is_batch = await asyncio.to_thread(_prompts, body.text, body.input_ids, service.tokenizer,
                                                "input_ids" if body.text is None else "text", engine.max_context)
    params = body.sampling_params or SamplingParamsIn()
    per_prompt = _per_prompt(params, len(prompts))
    _check_request(engine, prompts, per_prompt, "input_ids" if body.text is None else "text", "sampling_params.")
    if isinstance(body.rid, list) and len(body.rid) != len(prompts):
        raise BadRequest(f"rid: {len(body.rid)} ids for {len(prompts)} prompts")
    rids = body.rid if isinstance(body.rid, list) else [body.rid or secrets.token_hex(8)] * len(prompts)
    rows = _rows(prompts, per_prompt, not isinstance(params, list), engine.weights.config.vocab_size)
    start = time.perf_counter()
    results = await _run(engine, rows, request)
    latency = time.perf_counter() - start
    prompt_of_row = [i for i, p in enumerate(per_prompt) for _ in range(p.n)]
    out = [_generated(result, row, rids[i], _decode(service.tokenizer, result.output_ids,
                                                    per_prompt[i].skip_special_tokens),
                      latency, body.return_logprob)
           for row, result, i in zip(rows, results, prompt_of_row)]
    return out if is_batch or len(out) > 1 else out[0]


# ---------------------------------------------------------------- the application

_ROUTES = (  # (method, path, handler)
    ("GET", "/health", health),
    ("GET", "/get_model_info", model_info),
    ("GET", "/get_weight_version", weight_version),
    ("POST", "/update_weights_from_disk", update_weights),
    ("POST", "/generate", generate),
)


_ERROR_RESPONSES = {  # documented on every route in /openapi.json (FastAPI's 422 is never answered here)
    "400": "a field out of range or malformed: the error message names it",
    "401": "missing or invalid API key (when the service has one): send 'Authorization: Bearer <key>'",
    "403": "a weight path outside every --weights-root",
    "413": "request body over --max-body-bytes",
    "429": "queue full: retry after the Retry-After header's seconds, or on another service",
}


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


def build_app(engine: Engine, tokenizer: Any = None, *, keys: Keys | None = None, port_file: str = "", port: int = 0,
              extra_routes: Sequence[tuple[str, str, Any]] = ()) -> FastAPI:
    """The FastAPI application: SGLang-style native routes plus `extra_routes` (method, path, handler; the OpenAI
    ones: serve/app.py), behind the Guard."""
    config = engine.config
    app = FastAPI(title="drgrpo_jax generation service",
                  lifespan=functools.partial(_publish_port, port_file=port_file, port=port))
    app.state.service = Service(engine, tokenizer, config.served_model_name or config.model,
                                normalize_roots(config.weights_roots))
    # Starlette types a handler as taking any Exception; each of these takes only the type it is registered for.
    handlers: list[tuple[type[Exception], Any]] = [(RequestValidationError, _invalid_request),
                                                    (BadRequest, _bad_request), (QueueFull, _busy),
                                                    (ClientGone, _client_gone), (HTTPException, _http_error)]
    for error_type, handler in handlers:
        app.add_exception_handler(error_type, handler)
    for method, path, handler in (*_ROUTES, *extra_routes):
        app.add_api_route(path, handler, methods=[method])
    app.openapi = functools.partial(_openapi, app)  # type: ignore[method-assign]
    app.add_middleware(Guard, keys=keys or Keys(), max_body_bytes=config.max_body_bytes, loopback_only=config.loopback)
    return app
