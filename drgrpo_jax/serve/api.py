"""The HTTP layer: request schemas and route handlers over the Engine (SGLang-native routes + OpenAI completions)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from drgrpo_jax.sampling import RowRequest, SamplingParams
from drgrpo_jax.serve.engine import Engine, RowResult

TokenId = Annotated[StrictInt, Field(ge=0)]
Seed = Annotated[StrictInt, Field(ge=0, lt=2**32)]
Probability = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
Temperature = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class _Request(BaseModel):
    """Requests reject unknown fields, so a misspelt option is an error instead of a silent default."""

    model_config = ConfigDict(extra="forbid")


class SamplingParamsIn(_Request):
    """SGLang's `sampling_params` (the subset this service implements)."""

    max_new_tokens: Annotated[StrictInt, Field(ge=0)] = 128
    temperature: Temperature = 1.0
    top_p: Probability = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1)] = -1  # -1 or 0 = off
    n: Annotated[StrictInt, Field(ge=1)] = 1
    stop_token_ids: list[TokenId] | None = None
    seed: Seed | None = None  # None = a fresh random seed per request
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True  # for the decoded `text` only


class GenerateRequest(_Request):
    """SGLang's native `/generate` body."""

    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] | None = None
    return_logprob: StrictBool = False
    stream: Literal[False] = False  # streaming is not implemented
    rid: str | list[str] | None = None


class UpdateWeightsRequest(_Request):
    """SGLang's `/update_weights_from_disk` body."""

    model_path: str
    weight_version: str | StrictInt | None = None  # None = previous version + 1 (when it is an integer)
    load_format: Literal["auto"] | None = None
    flush_cache: StrictBool = True  # accepted for SGLang clients; this service keeps no prefix cache


class CompletionRequest(_Request):
    """OpenAI's `/v1/completions` body (plus vLLM's top_k / stop_token_ids / ignore_eos)."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    model: str | None = None
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = 16
    temperature: Temperature | None = 1.0
    top_p: Probability | None = 1.0
    n: Annotated[StrictInt, Field(ge=1)] = 1
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    seed: Seed | None = None
    stream: Literal[False] = False
    echo: Literal[False] = False
    stop: None = None  # stop strings are not implemented: use stop_token_ids
    user: str | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] = -1
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool = False


class BadRequest(Exception):
    """A request the service refuses (HTTP 400); the message names the field and the reason."""


def _error(status: int, message: str) -> JSONResponse:
    """OpenAI-style error body (the openai client reads error.message)."""
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _validation_message(error: RequestValidationError) -> str:
    """The first pydantic error as 'field.path: reason'."""
    first = error.errors()[0]
    if first.get("type") == "json_invalid":
        return "body: not valid JSON"
    # Drop "body" and pydantic's union-branch labels ("SamplingParamsIn", "list[...]") from the path.
    parts = [str(p) for p in first.get("loc", ()) if p != "body" and not (isinstance(p, str) and (
        p[:1].isupper() or "[" in p))]
    location = ".".join(parts) or "body"
    return f"{location}: {first.get('msg', 'invalid')}"


def _prompts(text: str | list[str] | None, input_ids: list | None, tokenizer: Any, field: str
             ) -> tuple[list[list[int]], bool]:
    """(token-id prompts, was it a batch) from text or ids; exactly one of them must be given."""
    if (text is None) == (input_ids is None):
        raise BadRequest(f"{field}: give exactly one of text or input_ids")
    if text is not None:
        if tokenizer is None:
            raise BadRequest(f"{field}: this server has no tokenizer; send token ids")
        texts = [text] if isinstance(text, str) else text
        return [list(tokenizer(t)["input_ids"]) for t in texts], not isinstance(text, str)
    is_batch = bool(input_ids) and isinstance(input_ids[0], list)
    return (input_ids if is_batch else [input_ids]), is_batch


def _check_prompts(engine: Engine, prompts: list[list[int]], budgets: list[int], field: str) -> None:
    """Refuses empty prompts, unknown token ids and prompts + budgets beyond the context."""
    if not prompts:
        raise BadRequest(f"{field}: no prompts")
    vocab = engine.weights.config.vocab_size
    for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
        if not prompt:
            raise BadRequest(f"{field}[{i}]: empty prompt")
        if max(prompt) >= vocab:
            raise BadRequest(f"{field}[{i}]: token id {max(prompt)} is outside the vocabulary of {vocab}")
        if len(prompt) + budget > engine.max_context:
            raise BadRequest(f"{field}[{i}]: prompt of {len(prompt)} tokens + {budget} new tokens exceeds "
                             f"the context of {engine.max_context}")


def _rows(prompts: list[list[int]], params: list[SamplingParamsIn], shared_seed: bool, limit: int
          ) -> list[RowRequest]:
    """Rows prompt-major (prompt 0's n samples first); each row gets its own random stream."""
    if sum(p.n for p in params) > limit:
        raise BadRequest(f"n: {sum(p.n for p in params)} completions exceed max_rows_per_request={limit}")
    request_seed = secrets.randbits(32)
    rows = []
    for index, (prompt, p) in enumerate(zip(prompts, params)):
        settings = SamplingParams(max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                                  top_k=p.top_k, stop_token_ids=tuple(p.stop_token_ids or ()),
                                  ignore_eos=p.ignore_eos)
        # One shared seed: prompts are told apart by `stream`; per-prompt seeds are used as given.
        seed = p.seed if p.seed is not None else (request_seed if shared_seed else secrets.randbits(32))
        rows += [RowRequest(tuple(prompt), settings, seed, index if shared_seed else 0, j) for j in range(p.n)]
    return rows


def _next_version(current: str) -> str:
    """Default version of an update that names none."""
    return str(int(current) + 1) if current.lstrip("-").isdigit() else f"{current}+1"


# ---------------------------------------------------------------- shared by the handlers

@dataclasses.dataclass(frozen=True)
class Service:
    """What every route handler reads, stored on the app by build_app."""

    engine: Engine
    tokenizer: Any  # a transformers tokenizer, or None: only token-id prompts are served
    name: str  # the model's name in OpenAI responses


def _service(request: Request) -> Service:
    """The Service of the app this request came to."""
    return request.app.state.service


async def _run(engine: Engine, rows: list[RowRequest]) -> list[RowResult]:
    """The rows' results; a failed batch answers HTTP 500 and the service keeps running."""
    try:
        return await asyncio.wrap_future(engine.submit(rows))
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


# ---------------------------------------------------------------- SGLang-native routes

async def health(request: Request) -> JSONResponse:
    """GET /health: ok and the weight version while the sampler worker runs, else 503."""
    engine = _service(request).engine
    if not engine.alive:
        return _error(503, "sampler worker has stopped")
    return JSONResponse({"status": "ok", "weight_version": engine.weights.version})


async def model_info(request: Request) -> dict:
    """GET /get_model_info: SGLang's fields plus the context, vocabulary and batching this service uses."""
    engine = _service(request).engine
    w = engine.weights
    return {"model_path": w.path, "tokenizer_path": engine.config.tokenizer or engine.config.model,
            "is_generation": True, "weight_version": w.version, "max_context": engine.max_context,
            "vocab_size": w.config.vocab_size, "eos_token_ids": list(w.config.eos_token_ids),
            "dtype": engine.config.dtype, "max_batch_size": engine.config.max_batch_size,
            "batches_run": engine.batches_run}


async def weight_version(request: Request) -> dict:
    """GET /get_weight_version: the version new batches sample with."""
    return {"weight_version": _service(request).engine.weights.version}


async def update_weights(body: UpdateWeightsRequest, request: Request) -> JSONResponse:
    """POST /update_weights_from_disk: load, check, swap; on failure 400 and the old weights keep serving."""
    engine = _service(request).engine
    version = str(body.weight_version) if body.weight_version is not None else _next_version(
        engine.weights.version)
    try:
        weights = await asyncio.to_thread(engine.update_weights, body.model_path, version)
    except Exception as error:  # noqa: BLE001 - any load/check failure leaves the old weights serving
        return JSONResponse({"success": False, "message": f"model_path: {type(error).__name__}: {error}",
                             "weight_version": engine.weights.version}, status_code=400)
    return JSONResponse({"success": True, "message": "Succeeded to update model weights.",
                         "weight_version": weights.version})


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
    prompts, is_batch = _prompts(body.text, body.input_ids, service.tokenizer, "input_ids")
    params = body.sampling_params or SamplingParamsIn()
    per_prompt = _per_prompt(params, len(prompts))
    _check_prompts(engine, prompts, [p.max_new_tokens for p in per_prompt], "input_ids")
    rids = body.rid if isinstance(body.rid, list) else [body.rid or secrets.token_hex(8)] * len(prompts)
    rows = _rows(prompts, per_prompt, not isinstance(params, list), engine.config.max_rows_per_request)
    start = time.perf_counter()
    results = await _run(engine, rows)
    latency = time.perf_counter() - start
    prompt_of_row = [i for i, p in enumerate(per_prompt) for _ in range(p.n)]
    out = [_generated(result, row, rids[i], _decode(service.tokenizer, result.output_ids,
                                                    per_prompt[i].skip_special_tokens),
                      latency, body.return_logprob)
           for row, result, i in zip(rows, results, prompt_of_row)]
    return out if is_batch or len(out) > 1 else out[0]


# ---------------------------------------------------------------- OpenAI-compatible routes

async def models(request: Request) -> dict:
    """GET /v1/models: the one served model."""
    service = _service(request)
    return {"object": "list", "data": [{"id": service.name, "object": "model", "owned_by": "drgrpo_jax",
                                        "max_model_len": service.engine.max_context}]}


def _completion_prompts(prompt: str | list, tokenizer: Any) -> list[list[int]]:
    """Token-id prompts from OpenAI's `prompt`: a text, texts, token ids or lists of token ids."""
    text = prompt if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)) else None
    prompts, _ = _prompts(text, None if text is not None else prompt, tokenizer, "prompt")
    return prompts


def _completion_params(body: CompletionRequest) -> SamplingParamsIn:
    """The request's sampling settings in SGLang's terms; a null field takes OpenAI's default."""
    return SamplingParamsIn(max_new_tokens=16 if body.max_tokens is None else body.max_tokens,
                            temperature=1.0 if body.temperature is None else body.temperature,
                            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k, n=body.n,
                            stop_token_ids=body.stop_token_ids, seed=body.seed, ignore_eos=body.ignore_eos)


def _completion_logprobs(result: RowResult, tokenizer: Any, top: int) -> dict:
    """OpenAI's logprobs object for one choice."""
    tokens = (tokenizer.convert_ids_to_tokens(result.output_ids) if tokenizer is not None
              else [f"token_id:{t}" for t in result.output_ids])
    pieces = [_decode(tokenizer, [t], False) for t in result.output_ids]
    # Only the sampled token's log-prob is computed: top_logprobs holds that one entry.
    return {"tokens": tokens, "token_logprobs": result.logprobs,
            "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, result.logprobs)] if top > 0 else None,
            "text_offset": np.cumsum([0] + [len(p) for p in pieces[:-1]]).tolist() if pieces else []}


def _completion_choice(index: int, result: RowResult, tokenizer: Any, logprobs: int | None) -> dict:
    """One OpenAI choice, plus the token ids and weight version an RL client needs."""
    return {"index": index, "text": _decode(tokenizer, result.output_ids),
            "logprobs": None if logprobs is None else _completion_logprobs(result, tokenizer, logprobs),
            "finish_reason": "stop" if result.stopped else "length",
            "token_ids": result.output_ids, "weight_version": result.weight_version}


def _usage(prompts: list[list[int]], results: list[RowResult]) -> dict:
    """OpenAI's token counts."""
    completion_tokens = sum(len(r.output_ids) for r in results)
    prompt_tokens = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def completions(body: CompletionRequest, request: Request) -> dict:
    """POST /v1/completions: every prompt gets the same settings, and n completions each."""
    service = _service(request)
    engine = service.engine
    prompts = _completion_prompts(body.prompt, service.tokenizer)
    params = _completion_params(body)
    _check_prompts(engine, prompts, [params.max_new_tokens] * len(prompts), "prompt")
    rows = _rows(prompts, [params] * len(prompts), True, engine.config.max_rows_per_request)
    results = await _run(engine, rows)
    choices = [_completion_choice(i, result, service.tokenizer, body.logprobs) for i, result in enumerate(results)]
    return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
            "model": body.model or service.name, "choices": choices, "usage": _usage(prompts, results)}


# ---------------------------------------------------------------- the application

_ROUTES = (  # (method, path, handler)
    ("GET", "/health", health),
    ("GET", "/get_model_info", model_info),
    ("GET", "/get_weight_version", weight_version),
    ("GET", "/v1/models", models),
    ("POST", "/update_weights_from_disk", update_weights),
    ("POST", "/generate", generate),
    ("POST", "/v1/completions", completions),
)


def build_app(engine: Engine, tokenizer: Any = None, *, port_file: str = "", port: int = 0) -> FastAPI:
    """The FastAPI application: SGLang-style native routes plus OpenAI /v1/completions."""
    app = FastAPI(title="drgrpo_jax generation service",
                  lifespan=functools.partial(_publish_port, port_file=port_file, port=port))
    app.state.service = Service(engine, tokenizer, engine.config.served_model_name or engine.config.model)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(BadRequest, _bad_request)
    for method, path, handler in _ROUTES:
        app.add_api_route(path, handler, methods=[method])
    return app
