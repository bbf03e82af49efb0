"""The generation service: an HTTP process (SGLang-style native API + OpenAI completions) over the sampler.

    python -m drgrpo_jax.serve --model PATH [--host 127.0.0.1] [--port 30000]
    python -m drgrpo_jax.serve --config run.yaml    # reads `model.path`, `model.dtype` and a `serve:` section

Requests from concurrent clients are queued and cut into batches (rows = prompts x n); one worker
thread runs the jitted sampler on each batch with the weights current when the batch starts, so a
weight update (`/update_weights_from_disk`) swaps atomically between batches: batches in flight
finish on the old weights, and every completion reports the `weight_version` it was sampled with.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import queue
import secrets
import signal
import socket
import sys
import threading
import time
from collections import deque
from typing import Annotated, Any, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from flax import nnx
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from drgrpo_jax import sampling
from drgrpo_jax.models import from_pretrained
from drgrpo_jax.paths import local_folder
from drgrpo_jax.sampling import RowRequest, SamplingParams

log = logging.getLogger("drgrpo_jax.serve")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How the service loads its model and batches requests."""

    model: str = ""  # HF folder (config.json + safetensors) or .gguf file
    host: str = "127.0.0.1"  # bind address; loopback unless told otherwise
    port: int = 30000  # TCP port (SGLang's default); 0 = any free port (see port_file)
    port_file: str = ""  # write the bound port here once serving (for parents that asked for port 0)
    dtype: str = "float32"  # parameter and KV-cache dtype: float32 | bfloat16
    weight_version: str = "0"  # version reported until the first update
    max_batch_size: int = 32  # rows (prompts x n) per sampler call
    batch_wait_ms: float = 5.0  # after the first request, wait this long for more to batch with it
    max_context: int = 0  # prompt + new tokens limit; 0 = the model's max_position_embeddings
    max_rows_per_request: int = 4096  # prompts x n accepted in one request
    tokenizer: str = ""  # tokenizer folder; "" = the model folder (none: text prompts are refused)
    served_model_name: str = ""  # name in OpenAI responses; "" = the model path
    parent_pid: int = 0  # shut down when this process is gone (set by rollout.LocalServer); 0 = off

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not supported (supported: {sorted(_DTYPES)})")
        for name in ("max_batch_size", "max_rows_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.batch_wait_ms < 0 or self.max_context < 0:
            raise ValueError("batch_wait_ms, max_context: must be >= 0")


def load_config(path: str, overrides: dict[str, Any]) -> ServeConfig:
    """ServeConfig from a YAML file (a trainer config's `model` section and an optional `serve:` section)."""
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must be a YAML mapping")
    fields = {f.name for f in dataclasses.fields(ServeConfig)}
    section = raw.get("serve", raw if "model" not in raw or isinstance(raw.get("model"), str) else {}) or {}
    unknown = sorted(set(section) - fields)
    if unknown:
        raise ValueError(f"serve.{unknown[0]}: unknown key (known: {sorted(fields)})")
    values = dict(section)
    model_section = raw.get("model")
    if isinstance(model_section, dict):  # a trainer config: model.path and model.dtype
        values.setdefault("model", model_section.get("path", ""))
        values.setdefault("dtype", model_section.get("dtype", "float32"))
        values.setdefault("tokenizer", model_section.get("tokenizer_path") or "")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ServeConfig(**values)


@dataclasses.dataclass(frozen=True)
class Weights:
    """One immutable generation of served weights; swapped as a whole."""

    graphdef: nnx.GraphDef
    state: nnx.State
    config: Any  # drgrpo_jax.models.DecoderConfig
    version: str
    path: str


@dataclasses.dataclass(frozen=True)
class RowResult:
    """One completion."""

    output_ids: list[int]
    logprobs: list[float]
    stopped: bool  # ended on a stop/EOS token (the last of output_ids), else hit max_new_tokens
    weight_version: str


def load_weights(path: str, dtype: str, version: str) -> Weights:
    """Reads a checkpoint from disk (no device state is touched before it has loaded)."""
    model = from_pretrained(path, dtype=_DTYPES[dtype])
    graphdef, state = nnx.split(model)
    return Weights(graphdef, state, model.config, str(version), path)


def check_compatible(old: Weights, new: Weights) -> None:
    """Raises ValueError naming the first difference that would make `new` a different model."""
    if new.config != old.config:
        diffs = [f.name for f in dataclasses.fields(old.config)
                 if getattr(old.config, f.name) != getattr(new.config, f.name)]
        raise ValueError(f"model config differs from the served model in {diffs}")
    old_leaves = jax.tree_util.tree_leaves_with_path(old.state)
    new_leaves = jax.tree_util.tree_leaves_with_path(new.state)
    if [p for p, _ in old_leaves] != [p for p, _ in new_leaves]:
        raise ValueError("parameter tree differs from the served model")
    for (keypath, a), (_, b) in zip(old_leaves, new_leaves):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"{jax.tree_util.keystr(keypath)}: shape/dtype {b.shape} {b.dtype} "
                             f"does not match the served {a.shape} {a.dtype}")
        if not bool(jnp.all(jnp.isfinite(b))):
            raise ValueError(f"{jax.tree_util.keystr(keypath)}: contains NaN or inf")


@dataclasses.dataclass
class _Job:
    """A request's rows and the future its handler awaits."""

    rows: list[RowRequest]
    future: concurrent.futures.Future
    results: list[RowResult | None]
    remaining: int


class Engine:
    """Owns the weights, the request queue and the one worker thread that runs the sampler."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.weights = load_weights(config.model, config.dtype, config.weight_version)
        self.max_context = config.max_context or self.weights.config.max_position_embeddings
        self._update_lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._pending: deque[tuple[_Job, int]] = deque()
        self.batches_run = 0
        self._worker = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._worker.start()

    @property
    def alive(self) -> bool:
        """Whether the worker thread is still serving."""
        return self._worker.is_alive()

    def submit(self, rows: Sequence[RowRequest]) -> concurrent.futures.Future:
        """Queues rows; the future resolves to their RowResults in order."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(_Job(list(rows), future, [None] * len(rows), len(rows)))
        return future

    def close(self) -> None:
        """Stops the worker after the batch it is running."""
        self._queue.put(None)
        self._worker.join(timeout=60)

    def update_weights(self, path: str, version: str) -> Weights:
        """Loads, checks and swaps in new weights; on any error the served weights stay as they were."""
        with self._update_lock, local_folder(path) as folder:  # a gs:// folder is copied to local disk first
            new = load_weights(folder, self.config.dtype, version)
            old = self.weights
            check_compatible(old, new)
            # Keep the old graphdef: it is the static key of the compiled programs (no recompiles).
            self.weights = Weights(old.graphdef, new.state, old.config, new.version, path)
            log.info("weights %s -> %s from %s", old.version, new.version, path)
            return self.weights

    def _take_rows(self) -> list[tuple[_Job, int]] | None:
        """Blocks for work, then gathers up to max_batch_size rows (None = shut down)."""
        while not self._pending:
            job = self._queue.get()
            if job is None:
                return None
            self._pending.extend((job, i) for i in range(len(job.rows)))
        deadline = time.monotonic() + self.config.batch_wait_ms / 1000
        while len(self._pending) < self.config.max_batch_size:
            try:
                job = self._queue.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)  # finish this batch, then stop
                break
            self._pending.extend((job, i) for i in range(len(job.rows)))
        count = min(len(self._pending), self.config.max_batch_size)
        return [self._pending.popleft() for _ in range(count)]

    def _run(self) -> None:
        """Worker loop: batch, sample, hand results back; an error fails only that batch's requests."""
        while (taken := self._take_rows()) is not None:
            weights = self.weights  # one read: the whole batch uses one version
            try:
                results = self.run_batch(weights, [job.rows[i] for job, i in taken])
            except Exception as error:  # noqa: BLE001 - reported to the requests, the service goes on
                log.exception("batch failed")
                for job, _ in taken:
                    if not job.future.done():
                        job.future.set_exception(error)
                continue
            for (job, i), result in zip(taken, results):
                job.results[i] = result
                job.remaining -= 1
                if job.remaining == 0 and not job.future.done():
                    job.future.set_result(job.results)

    def run_batch(self, weights: Weights, rows: list[RowRequest]) -> list[RowResult]:
        """Samples one batch of rows on `weights`, padded to bucketed static shapes."""
        batch = sampling.make_batch(
            rows, weights.config.eos_token_ids, batch_size=sampling.batch_bucket(len(rows)),
            prompt_len=sampling.bucket(max(len(r.prompt_ids) for r in rows)))
        out = sampling.generate(weights.graphdef, weights.state, batch,
                                max_new_tokens=sampling.bucket(max(r.params.max_new_tokens for r in rows)),
                                cache_dtype=_DTYPES[self.config.dtype])
        tokens, logprobs, lengths, stopped = jax.device_get(
            (out.tokens_BT, out.logprobs_BT, out.lengths_B, out.stopped_B))
        self.batches_run += 1
        return [RowResult(tokens[b, :lengths[b]].tolist(), logprobs[b, :lengths[b]].tolist(), bool(stopped[b]),
                          weights.version) for b in range(len(rows))]


# ---------------------------------------------------------------- HTTP layer

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


def build_app(engine: Engine, tokenizer: Any = None, *, port_file: str = "", port: int = 0) -> FastAPI:
    """The FastAPI application: SGLang-style native routes plus OpenAI /v1/completions."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if port_file:  # written once the app accepts requests: the parent's readiness signal
            with open(port_file + ".tmp", "w") as f:
                f.write(str(port))
            os.replace(port_file + ".tmp", port_file)
        yield

    app = FastAPI(title="drgrpo_jax generation service", lifespan=lifespan)
    name = engine.config.served_model_name or engine.config.model

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        return _error(400, _validation_message(error))

    @app.exception_handler(BadRequest)
    async def bad(_: Request, error: BadRequest) -> JSONResponse:
        return _error(400, str(error))

    async def run(rows: list[RowRequest]) -> list[RowResult]:
        try:
            return await asyncio.wrap_future(engine.submit(rows))
        except Exception as error:  # noqa: BLE001 - the batch failed; the service keeps running
            raise HTTPException(500, f"generation failed: {type(error).__name__}: {error}") from error

    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if tokenizer is not None else ""

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            return _error(503, "sampler worker has stopped")
        return JSONResponse({"status": "ok", "weight_version": engine.weights.version})

    @app.get("/get_model_info")
    async def model_info() -> dict:
        w = engine.weights
        return {"model_path": w.path, "tokenizer_path": engine.config.tokenizer or engine.config.model,
                "is_generation": True, "weight_version": w.version, "max_context": engine.max_context,
                "vocab_size": w.config.vocab_size, "eos_token_ids": list(w.config.eos_token_ids),
                "dtype": engine.config.dtype, "max_batch_size": engine.config.max_batch_size,
                "batches_run": engine.batches_run}

    @app.get("/get_weight_version")
    async def weight_version() -> dict:
        return {"weight_version": engine.weights.version}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "drgrpo_jax",
                                            "max_model_len": engine.max_context}]}

    @app.post("/update_weights_from_disk")
    async def update_weights(body: UpdateWeightsRequest) -> JSONResponse:
        version = str(body.weight_version) if body.weight_version is not None else _next_version(
            engine.weights.version)
        try:
            weights = await asyncio.to_thread(engine.update_weights, body.model_path, version)
        except Exception as error:  # noqa: BLE001 - any load/check failure leaves the old weights serving
            return JSONResponse({"success": False, "message": f"model_path: {type(error).__name__}: {error}",
                                 "weight_version": engine.weights.version}, status_code=400)
        return JSONResponse({"success": True, "message": "Succeeded to update model weights.",
                             "weight_version": weights.version})

    @app.post("/generate")
    async def generate(body: GenerateRequest) -> Any:
        prompts, is_batch = _prompts(body.text, body.input_ids, tokenizer, "input_ids")
        params = body.sampling_params or SamplingParamsIn()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise BadRequest(f"sampling_params: {len(per_prompt)} entries for {len(prompts)} prompts")
        _check_prompts(engine, prompts, [p.max_new_tokens for p in per_prompt], "input_ids")
        rids = body.rid if isinstance(body.rid, list) else [body.rid or secrets.token_hex(8)] * len(prompts)
        rows = _rows(prompts, per_prompt, not isinstance(params, list), engine.config.max_rows_per_request)
        start = time.perf_counter()
        results = await run(rows)
        latency = time.perf_counter() - start
        out = []
        for row, result, prompt_index in zip(rows, results, [i for i, p in enumerate(per_prompt) for _ in range(p.n)]):
            finish = ({"type": "stop", "matched": result.output_ids[-1]} if result.stopped
                      else {"type": "length", "length": len(result.output_ids)})
            meta = {"id": rids[prompt_index], "prompt_tokens": len(row.prompt_ids),
                    "completion_tokens": len(result.output_ids), "finish_reason": finish,
                    "weight_version": result.weight_version, "e2e_latency": latency}
            if body.return_logprob:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(result.logprobs, result.output_ids)]
            out.append({"text": decode(result.output_ids, per_prompt[prompt_index].skip_special_tokens),
                        "output_ids": result.output_ids, "meta_info": meta})
        return out if is_batch or len(out) > 1 else out[0]

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict:
        prompt = body.prompt
        text = prompt if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)) else None
        prompts, _ = _prompts(text, None if text is not None else prompt, tokenizer, "prompt")
        params = SamplingParamsIn(max_new_tokens=16 if body.max_tokens is None else body.max_tokens,
                                  temperature=1.0 if body.temperature is None else body.temperature,
                                  top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k, n=body.n,
                                  stop_token_ids=body.stop_token_ids, seed=body.seed, ignore_eos=body.ignore_eos)
        _check_prompts(engine, prompts, [params.max_new_tokens] * len(prompts), "prompt")
        rows = _rows(prompts, [params] * len(prompts), True, engine.config.max_rows_per_request)
        results = await run(rows)
        choices = []
        for index, result in enumerate(results):
            logprobs = None
            if body.logprobs is not None:
                tokens = (tokenizer.convert_ids_to_tokens(result.output_ids) if tokenizer is not None
                          else [f"token_id:{t}" for t in result.output_ids])
                pieces = [decode([t], False) for t in result.output_ids]
                # Only the sampled token's log-prob is computed: top_logprobs holds that one entry.
                logprobs = {"tokens": tokens, "token_logprobs": result.logprobs,
                            "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, result.logprobs)]
                            if body.logprobs > 0 else None,
                            "text_offset": np.cumsum([0] + [len(p) for p in pieces[:-1]]).tolist()
                            if pieces else []}
            choices.append({"index": index, "text": decode(result.output_ids), "logprobs": logprobs,
                            "finish_reason": "stop" if result.stopped else "length",
                            "token_ids": result.output_ids, "weight_version": result.weight_version})
        completion_tokens = sum(len(r.output_ids) for r in results)
        prompt_tokens = sum(len(p) for p in prompts)
        return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
                "model": body.model or name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    return app

def load_tokenizer(config: ServeConfig) -> Any:
    """The HF tokenizer next to the model, or None (then only token-id prompts are served)."""
    path = config.tokenizer or (config.model if os.path.isdir(config.model) else "")
    if not path:
        return None
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    except Exception as error:  # noqa: BLE001 - a model without a tokenizer is still servable
        log.warning("no tokenizer at %s (%s); text prompts will be refused", path, error)
        return None


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0 = any free port), created before uvicorn so the port is known."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def parse_args(argv: Sequence[str] | None) -> ServeConfig:
    """CLI flags (or --config YAML, flags overriding it) -> ServeConfig."""
    parser = argparse.ArgumentParser(prog="python -m drgrpo_jax.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="YAML: a trainer config (model.path, model.dtype) and/or a serve: section")
    parser.add_argument("--model", help="HF folder or .gguf file to serve")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--port-file", dest="port_file")
    parser.add_argument("--dtype", choices=sorted(_DTYPES))
    parser.add_argument("--weight-version", dest="weight_version")
    parser.add_argument("--max-batch-size", dest="max_batch_size", type=int)
    parser.add_argument("--batch-wait-ms", dest="batch_wait_ms", type=float)
    parser.add_argument("--max-context", dest="max_context", type=int)
    parser.add_argument("--tokenizer")
    parser.add_argument("--parent-pid", dest="parent_pid", type=int)
    args = vars(parser.parse_args(argv))
    config_path = args.pop("config")
    if config_path:
        config = load_config(config_path, args)
    else:
        config = ServeConfig(**{k: v for k, v in args.items() if v is not None})
    if not config.model:
        parser.error("--model (or model.path in --config) is required")
    return config


def _watch_parent(pid: int) -> None:
    """SIGTERMs this process once its parent is gone (a trainer killed before it could stop us)."""
    while os.getppid() == pid:
        time.sleep(1.0)
    log.warning("parent %d is gone; shutting down", pid)
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: Sequence[str] | None = None) -> None:
    """Loads the model, binds the port, serves until SIGINT/SIGTERM."""
    import uvicorn
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = parse_args(argv)
    sock = bind_socket(config.host, config.port)  # first, so a taken port fails before the slow load
    engine = Engine(config)
    app = build_app(engine, load_tokenizer(config), port_file=config.port_file, port=sock.getsockname()[1])
    log.info("serving %s (version %s) on http://%s:%d", config.model, engine.weights.version, config.host,
             sock.getsockname()[1])
    if config.parent_pid:
        threading.Thread(target=_watch_parent, args=(config.parent_pid,), daemon=True).start()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()


if __name__ == "__main__":
    main(sys.argv[1:])
