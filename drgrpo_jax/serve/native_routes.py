"""SGLang's native routes: `/generate`, `/health`, `/get_model_info`, `/get_weight_version`, `/flush_cache`, and the
weight updates `/update_weights_from_disk` and `/update_weights_from_tensor` (the trainer's push through shared
memory)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import secrets
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse

from drgrpo_jax.errors import BadRequest, InvalidWeights, PathNotAllowed
from drgrpo_jax.named_tensors import NAME_FORM, SEGMENT_NAME
from drgrpo_jax.sampler.batch import RowRequest
from drgrpo_jax.sampler.programs import compiled_programs
from drgrpo_jax.serve.scheduler import RowResult
from drgrpo_jax.serve.schemas import (
    GenerateRequest,
    SamplingParamsIn,
    UpdateWeightsFromTensorRequest,
    UpdateWeightsRequest,
)
from drgrpo_jax.serve.security import confine_weight_path, open_weight_folder
from drgrpo_jax.serve.service import (
    abort_message,
    check_request,
    deadline_of,
    decode,
    error_response,
    prompt_ids,
    run_rows,
    sampler_rows,
    service_of,
    shown_name,
)
from drgrpo_jax.serve.stops import Choice, apply_stop
from drgrpo_jax.serve.weights import Weights, check_newer

__all__ = ["FLUSHED", "ROUTES", "flush_cache", "generate", "health", "model_info", "update_weights",
           "update_weights_from_tensor", "weight_version"]


# ---------------------------------------------------------------- the service's state

async def health(request: Request) -> JSONResponse:
    """GET /health: ok and the weight version while the sampler worker runs, else 503."""
    scheduler = service_of(request).scheduler
    if not scheduler.alive:
        return error_response(503, "sampler worker has stopped")
    return JSONResponse({"status": "ok", "weight_version": scheduler.weights.version})


async def model_info(request: Request) -> dict:
    """GET /get_model_info: SGLang's fields plus the context, vocabulary, batching, queue, the rows and batches
    cut short because their clients left, the sampler programs compiled and kept (one set per new batch shape) and
    those dropped while idle (--max-kept-programs), whether pushes reach running batches (--inflight-updates), and
    LoRA adapter (null, or the merged adapter's name, rank, alpha and targets) of this service, and the prefix
    cache's counters (`prefix_cache`: hit_tokens, miss_tokens, evicted_blocks, cached_blocks, budget_bytes,
    pool_bytes; budget 0 = off). The paths are names (`Service.shown`): no server path is shown."""
    service = service_of(request)
    scheduler, w = service.scheduler, service.scheduler.weights
    adapter = w.adapter and {**w.adapter, "path": service.shown(w.adapter["path"])}
    tokenizer = shown_name(scheduler.config.tokenizer) if scheduler.config.tokenizer else service.name
    return {"model_path": service.shown(w.path), "tokenizer_path": tokenizer,
            "is_generation": True, "weight_version": w.version, "max_context": scheduler.max_context,
            "vocab_size": w.config.vocab_size, "eos_token_ids": list(w.config.eos_token_ids),
            "dtype": scheduler.config.dtype, "max_batch_size": scheduler.config.max_batch_size,
            "max_batch_bytes": scheduler.batch_budget,
            "batches_run": scheduler.batches_run, "queued_tokens": scheduler.queued_tokens,
            "rows_dropped": scheduler.rows_dropped, "rows_cut": scheduler.rows_cut,
            "batches_stopped": scheduler.batches_stopped, "compiled_programs": compiled_programs(),
            "programs_dropped": scheduler.programs_dropped, "adapter": adapter,
            "inflight_updates": scheduler.config.inflight_updates, "prefix_cache": scheduler.prefix_stats(),
            "continuous_admission": scheduler.config.continuous_admission, "rows_joined": scheduler.rows_joined}


async def weight_version(request: Request) -> dict:
    """GET /get_weight_version: the version new batches sample with."""
    return {"weight_version": service_of(request).scheduler.weights.version}


# SGLang's answer, word for word: clients (and SGLang's own tools) read the status and this text.
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
           "the operation will not be performed.)\n")


async def flush_cache(request: Request) -> PlainTextResponse:
    """POST /flush_cache: empties the prefix cache, as SGLang's: 200 and SGLang's text, or 400 while any
    request is queued or running (nothing is flushed then)."""
    if service_of(request).scheduler.flush_cache():
        return PlainTextResponse(FLUSHED)
    return PlainTextResponse("Flush cache failed: requests are queued or running.\n", status_code=400)


# ---------------------------------------------------------------- weight updates

def _next_version(current: str) -> str:
    """Default version of an update that names none."""
    return str(int(current) + 1) if current.isdigit() else f"{current}+1"


def _update_answer(status: int, message: str, version: str) -> JSONResponse:
    """SGLang's update answer (`success`, `message`, the version now served); a refusal also carries OpenAI's
    `error` object, so every error of the service has that shape."""
    body: dict[str, Any] = {"success": status == 200, "message": message, "weight_version": version}
    if status != 200:
        body["error"] = {"message": message, "type": "invalid_request_error", "code": status}
    return JSONResponse(body, status_code=status)


async def update_weights(body: UpdateWeightsRequest, request: Request) -> JSONResponse:
    """POST /update_weights_from_disk: confine, load, check, swap; on failure 403/400 and the old weights serve on.

    The path is an HF model folder or a PEFT LoRA adapter folder (merged into the current base weights).
    The path must lie under a --weights-root, with no symbolic link below it (403 otherwise, naming the rule);
    its files are opened once, through descriptors, and loaded from those (no window to swap them); integer
    versions may not go backwards unless the body says allow_rollback (a trainer resuming from a checkpoint); a
    load failure says only that the folder is not a valid model (the service's log has the detail).
    """
    service = service_of(request)
    scheduler = service.scheduler
    version = str(body.weight_version) if body.weight_version is not None else _next_version(
        scheduler.weights.version)
    try:
        path = confine_weight_path(body.model_path, service.weights_roots, required=not scheduler.config.loopback)
        if not body.allow_rollback:
            check_newer(scheduler.weights.version, version)

        def load() -> Weights:  # off the event loop: opening a folder on a slow disk must not stall /health
            with open_weight_folder(path, service.weights_roots) as folder:  # read through descriptors: no race
                return scheduler.served.load_folder(folder, version, shown_path=body.model_path,
                                                    allow_rollback=body.allow_rollback)

        weights = await asyncio.to_thread(load)
    except PathNotAllowed as error:
        return _update_answer(403, str(error), scheduler.weights.version)
    except InvalidWeights as error:
        return _update_answer(400, str(error), scheduler.weights.version)
    except OSError:  # the folder (or a folder on the way) is missing or unreadable: the log of a load says no more
        return _update_answer(400, "model_path: not a valid model folder", scheduler.weights.version)
    return _update_answer(200, "Succeeded to update model weights.", weights.version)


async def update_weights_from_tensor(body: UpdateWeightsFromTensorRequest, request: Request) -> JSONResponse:
    """POST /update_weights_from_tensor: a whole model from a shared-memory segment (`drgrpo_jax.rollout.weight_push`),
    checked as a disk update is.

    Named after SGLang's in-process update, but the body is this service's own: the segment's name and its
    index (`tensor_segment`), not serialized tensors. A segment lives on this machine only, so a service bound
    beyond loopback refuses the route (403); the admin key guards it like /update_weights_from_disk.
    """
    scheduler = service_of(request).scheduler
    if not scheduler.config.loopback:
        return _update_answer(403, "segment: shared-memory updates are served on loopback only",
                              scheduler.weights.version)
    if not SEGMENT_NAME.fullmatch(body.segment):  # whole: a trailing newline or another path is no segment name
        return _update_answer(400, f"segment: not a weight segment name ({NAME_FORM})",
                              scheduler.weights.version)
    version = str(body.weight_version) if body.weight_version is not None else _next_version(scheduler.weights.version)
    index = [entry.model_dump() for entry in body.tensors]
    try:
        if not body.allow_rollback:
            check_newer(scheduler.weights.version, version)
        weights = await asyncio.to_thread(scheduler.served.load_segment, body.segment, index, version,
                                          allow_rollback=body.allow_rollback)
    except (InvalidWeights, ValueError) as error:
        return _update_answer(400, str(error), scheduler.weights.version)
    return _update_answer(200, "Succeeded to update model weights.", weights.version)


# ---------------------------------------------------------------- /generate

def _per_prompt(params: SamplingParamsIn | list[SamplingParamsIn], num_prompts: int) -> list[SamplingParamsIn]:
    """One SamplingParamsIn per prompt: a list gives each prompt its own, a single one is shared."""
    per_prompt = params if isinstance(params, list) else [params] * num_prompts
    if len(per_prompt) != num_prompts:
        raise BadRequest(f"sampling_params: {len(per_prompt)} entries for {num_prompts} prompts")
    return per_prompt


def _finish_reason(result: RowResult, choice: Choice, aborted: str) -> dict:
    """SGLang's finish_reason: the stop string or token that ended the completion, the length it ran to, or
    abort with `aborted` (the request's deadline passed first)."""
    if choice.finish_reason == "abort":
        return {"type": "abort", "message": aborted}
    if choice.matched is not None:
        return {"type": "stop", "matched": choice.matched}
    if result.stopped:
        return {"type": "stop", "matched": result.output_ids[-1]}
    return {"type": "length", "length": len(result.output_ids)}


def _generated(result: RowResult, choice: Choice, row: RowRequest, rid: str, latency: float,
               return_logprob: bool, aborted: str) -> dict:
    """One completion in SGLang's /generate shape (its tokens through the one that completed a stop string).

    `routed_experts` (asked for): SGLang's base64 of the int32 (little-endian) experts [prompt + completion - 1,
    L, k] of every token the model read, in token, layer, slot order (a stop string's cut drops the tail's).
    `output_token_weight_versions` (--inflight-updates): the version that sampled each of `output_ids`;
    `weight_version` stays the batch's first, the oldest of them.
    """
    ids = choice.token_ids
    meta = {"id": rid, "prompt_tokens": len(row.prompt_ids), "completion_tokens": len(ids),
            "cached_tokens": result.cached_tokens,
            "finish_reason": _finish_reason(result, choice, aborted), "weight_version": result.weight_version,
            "e2e_latency": latency}
    if return_logprob:  # SGLang's (log-prob, token id, token text) triples; the text is left out
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(result.logprobs, ids)]
    if result.token_versions is not None:
        meta["output_token_weight_versions"] = result.token_versions[:len(ids)]
    if result.routed_experts is not None:
        read = result.routed_experts[:max(len(row.prompt_ids) + len(ids) - 1, 0)]
        meta["routed_experts"] = base64.b64encode(read.astype("<i4").tobytes()).decode("ascii")
    return {"text": choice.text, "output_ids": ids, "meta_info": meta}


def _choice(result: RowResult, tokenizer: Any, params: SamplingParamsIn) -> Choice:
    """The completion after its stop strings, its text decoded as the request asked."""
    stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    if stops:
        return apply_stop(result, tokenizer, stops)
    reason = "abort" if result.aborted else "stop" if result.stopped else "length"
    return Choice(result.output_ids, decode(tokenizer, result.output_ids, params.skip_special_tokens), reason,
                  result.weight_version)


async def generate(body: GenerateRequest, request: Request) -> Any:
    """POST /generate: completions prompt-major, a single object when one prompt asked for one."""
    service = service_of(request)
    scheduler = service.scheduler
    if body.return_routed_experts and not scheduler.weights.config.moe:
        raise BadRequest(f"return_routed_experts: the served {scheduler.weights.config.family} model has no router "
                         f"(only a mixture of experts routes tokens)")
    deadline = deadline_of(scheduler)
    field = "input_ids" if body.text is None else "text"
    # Off the event loop: tokenizing long texts must not stall /health and every other client.
    prompts, is_batch = await asyncio.to_thread(prompt_ids, body.text, body.input_ids, service.tokenizer, field,
                                                scheduler.max_context)
    params = body.sampling_params or SamplingParamsIn()
    per_prompt = _per_prompt(params, len(prompts))
    check_request(scheduler, prompts, per_prompt, field, "sampling_params.", record=body.return_routed_experts)
    if service.tokenizer is None and any(p.stop for p in per_prompt):
        raise BadRequest("sampling_params.stop: this server has no tokenizer to match stop strings; use "
                         "stop_token_ids")
    if isinstance(body.rid, list) and len(body.rid) != len(prompts):
        raise BadRequest(f"rid: {len(body.rid)} ids for {len(prompts)} prompts")
    rids = body.rid if isinstance(body.rid, list) else [body.rid or secrets.token_hex(8)] * len(prompts)
    rows = sampler_rows(prompts, per_prompt, not isinstance(params, list), scheduler.weights.config.vocab_size)
    if body.return_routed_experts:
        rows = [dataclasses.replace(row, return_routed_experts=True) for row in rows]
    start = time.perf_counter()
    results = await run_rows(scheduler, rows, request, deadline)
    latency = time.perf_counter() - start
    prompt_of_row = [i for i, p in enumerate(per_prompt) for _ in range(p.n)]
    choices = await asyncio.to_thread(lambda: [_choice(result, service.tokenizer, per_prompt[i])
                                               for result, i in zip(results, prompt_of_row)])
    out = [_generated(result, choice, row, rids[i], latency, body.return_logprob,
                      abort_message(scheduler, bool(result.output_ids)))
           for row, result, choice, i in zip(rows, results, choices, prompt_of_row)]
    return out if is_batch or len(out) > 1 else out[0]


ROUTES = (  # (method, path, handler), wired by serve/app.py
    ("GET", "/health", health),
    ("GET", "/get_model_info", model_info),
    ("GET", "/get_weight_version", weight_version),
    ("POST", "/update_weights_from_disk", update_weights),
    ("POST", "/generate", generate),
    ("POST", "/update_weights_from_tensor", update_weights_from_tensor),
    ("POST", "/flush_cache", flush_cache),
)
