"""OpenAI-compatible routes: `/v1/models`, `/v1/completions` (with `stop`, `logprobs`, `echo`) and
`/v1/chat/completions` (the tokenizer's chat template), for ordinary clients and lm-evaluation-harness."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import HTTPException, Request
from fastapi.responses import StreamingResponse

from drgrpo_jax.errors import BadRequest
from drgrpo_jax.sampler.batch import RowRequest
from drgrpo_jax.serve.scheduler import RowResult, Scheduler
from drgrpo_jax.serve.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingParamsIn
from drgrpo_jax.serve.scoring import ScoredSequence, call_bytes, rows_per_call, score_sequences
from drgrpo_jax.serve.service import (
    Service,
    abort_message,
    check_request,
    deadline_of,
    decode,
    greedy_below,
    prompt_ids,
    run_rows,
    sampler_rows,
    service_of,
    tokenize,
    wait_while_wanted,
)
from drgrpo_jax.serve.stops import Choice, apply_stop

__all__ = ["ROUTES", "chat_completions", "completions", "models"]


def _stops(stop: str | list[str] | None, tokenizer: Any) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if stops and tokenizer is None:
        raise BadRequest("stop: this server has no tokenizer to match stop strings; use stop_token_ids")
    return stops


async def _score(service: Service, sequences: list[list[int]], temperature: float, top: int,
                 choices: list[Choice], request: Request, deadline: float
                 ) -> tuple[list[ScoredSequence] | None, list[Choice]] | None:
    """(log-probs of each sequence under the weights that sampled it, the choices); None when the weights were
    swapped since (the caller samples again). When scoring is not done by `deadline` the log-probs are None and
    every choice's finish reason is abort: the request is answered by its deadline all the same. Each scoring
    call takes only the rows the service's measured scoring speed says end by the deadline, and none is started
    that would not (`score_sequences`): the scoring gives up there, before its deadline (at once when one sequence
    alone would outrun it), rather than a call past it; it stops before its next call when the client leaves.

    Every reported log-prob and top entry comes from this one forward pass over prompt + completion at the
    request's temperature (1 for greedy, as the sampler reports), so a token's log-prob equals its top entry
    exactly when it was the likeliest; the sampler's own log-probs (`/generate`) agree to ~1e-4. The scoring
    marks itself busy with the scheduler (`programs_in_use`), so an idle drop of the compiled programs waits for it.
    """
    scheduler = service.scheduler
    weights, config = scheduler.weights, scheduler.config
    if any(c.weight_version != weights.version for c in choices):
        return None
    stop = threading.Event()
    rows = rows_per_call(weights.config, max(map(len, sequences)), top, config.max_scoring_bytes,
                         scheduler.batch_budget, config.max_batch_size)

    def score() -> list[ScoredSequence] | None:
        with scheduler.programs_in_use():
            return score_sequences(weights.graphdef, weights.state, sequences, [temperature] * len(sequences), top,
                                   weights.config.vocab_size, config.max_scoring_bytes, rows_per_call=rows,
                                   stopped=stop.is_set, deadline=deadline, rate=service.scoring_rate)

    scoring = asyncio.ensure_future(asyncio.to_thread(score))
    scored = scoring.result() if await wait_while_wanted(scoring, request, deadline, stop.set) else None
    if scored is None:
        stop.set()
        return None, [dataclasses.replace(c, finish_reason="abort") for c in choices]
    return scored, choices


def _apply_stops(results: list[RowResult], tokenizer: Any, stops: list[str]) -> list[Choice]:
    return [apply_stop(r, tokenizer, stops) for r in results]


async def _sample(service: Service, rows: list[RowRequest], stops: list[str], scoring: tuple[float, int] | None,
                  request: Request, deadline: float
                  ) -> tuple[list[Choice], list[list[int]], list[ScoredSequence] | None]:
    """(the rows' choices after their stop strings, each row's prompt + completion, their log-probs when
    `scoring` (temperature, top) asks for them). Log-probs come from the weights that sampled the tokens: when
    the weights were swapped between sampling and scoring, the rows are sampled once more on the new ones, and a
    second swap answers 503."""
    scheduler, tokenizer = service.scheduler, service.tokenizer
    for _ in range(2):
        results = await run_rows(scheduler, rows, request, deadline)
        choices = await asyncio.to_thread(_apply_stops, results, tokenizer, stops)
        sequences = [list(row.prompt_ids) + choice.token_ids for row, choice in zip(rows, choices)]
        if scoring is None:
            return choices, sequences, None
        scored = await _score(service, sequences, *scoring, choices, request, deadline)
        if scored is not None:
            return scored[1], sequences, scored[0]
    raise HTTPException(503, "weights: a new version was loaded twice while this request ran; send it again")


def _ending(scheduler: Scheduler, choice: Choice) -> dict:
    """A choice's finish reason, the version that sampled it and, when it was cut short, why (`abort_reason`:
    OpenAI's finish reasons carry no message, and an empty 200 must say why it is empty)."""
    ending = {"finish_reason": choice.finish_reason, "weight_version": choice.weight_version}
    if choice.finish_reason == "abort":
        ending["abort_reason"] = abort_message(scheduler, bool(choice.token_ids))
    return ending


_LAST_CHUNK_FIELDS = ("finish_reason", "weight_version", "abort_reason")


def _chunks(response: dict, kind: str, include_usage: bool) -> list[dict]:
    """The response as OpenAI's stream chunks: per choice one with its content (chat: `delta`) and one with its
    finish reason, then (`include_usage`) one with the usage and no choices."""
    head = {"id": response["id"], "object": kind, "created": response["created"], "model": response["model"]}
    empty: dict[str, Any] = {"delta": {}} if kind == "chat.completion.chunk" else {"text": ""}
    chunks = []
    for choice in response["choices"]:
        content = {k: v for k, v in choice.items() if k not in _LAST_CHUNK_FIELDS}
        if "message" in content:
            content["delta"] = content.pop("message")
        last = {"index": choice["index"], **empty, "logprobs": None,
                **{k: choice[k] for k in _LAST_CHUNK_FIELDS if k in choice}}
        chunks += [{**head, "choices": [{**content, "finish_reason": None}]}, {**head, "choices": [last]}]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": response["usage"]})
    return chunks


def _event_stream(chunks: list[dict]) -> StreamingResponse:
    """Server-sent events as OpenAI's and vLLM's servers send them: `data: {chunk}` each, then `data: [DONE]`."""
    async def events() -> AsyncIterator[str]:
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _answer(response: dict, body: CompletionRequest | ChatCompletionRequest, kind: str) -> Any:
    """The response as one JSON object, or (`stream`) as server-sent events."""
    if not body.stream:
        return response
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return _event_stream(_chunks(response, kind, include_usage))


def _check_scoring(scheduler: Scheduler, prompts: list[list[int]], new_tokens: int, top: int, field: str) -> None:
    """Refuses, before anything is sampled, log-probs whose one sequence's scoring call would not fit the
    service's memory budget (--max-batch-bytes)."""
    longest = max(map(len, prompts)) + new_tokens
    need = call_bytes(scheduler.weights.config, 1, longest, top, scheduler.config.max_scoring_bytes)
    if need > scheduler.batch_budget:
        raise BadRequest(f"{field}: scoring a sequence of {longest} tokens needs {need / 2**20:,.0f} MiB, over the "
                         f"service's budget of {scheduler.batch_budget / 2**20:,.0f} MiB a batch (--max-batch-bytes)")


def _pieces(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's own text (special tokens included), or `token_id:N` without a tokenizer."""
    return [decode(tokenizer, [t], False) if tokenizer is not None else f"token_id:{t}" for t in ids]


def _token_names(tokenizer: Any, ids: list[int]) -> list[str]:
    """The vocabulary's names of the tokens (what OpenAI's legacy `tokens` lists)."""
    return tokenizer.convert_ids_to_tokens(ids) if tokenizer is not None else [f"token_id:{t}" for t in ids]


# ---------------------------------------------------------------- /v1/models and /v1/completions

async def models(request: Request) -> dict:
    """GET /v1/models: the one served model."""
    service = service_of(request)
    return {"object": "list", "data": [{"id": service.name, "object": "model", "owned_by": "drgrpo_jax",
                                        "max_model_len": service.scheduler.max_context}]}


def _completion_prompts(prompt: str | list, tokenizer: Any, max_context: int) -> list[list[int]]:
    """Token-id prompts from OpenAI's `prompt`: a text, texts, token ids or lists of token ids."""
    text = prompt if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)) else None
    ids = None if text is not None or isinstance(prompt, str) else prompt
    prompts, _ = prompt_ids(text, ids, tokenizer, "prompt", max_context)
    return prompts


def _budget(given: int | None, field: str, default: int, limit: int) -> int:
    """The new-token budget: `given`, else the operator's default; refused (naming `field`) above the limit."""
    if given is not None and given > limit:
        raise BadRequest(f"{field}: {given} exceeds this service's limit of {limit} (--max-tokens-limit)")
    return default if given is None else given


def _params(body: CompletionRequest | ChatCompletionRequest, max_new_tokens: int) -> SamplingParamsIn:
    """The request's sampling settings in SGLang's terms; a null field takes OpenAI's default."""
    return SamplingParamsIn(max_new_tokens=max_new_tokens,
                            temperature=greedy_below(1.0 if body.temperature is None else body.temperature),
                            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k, n=body.n,
                            stop_token_ids=body.stop_token_ids, seed=body.seed, ignore_eos=body.ignore_eos)


def _legacy_logprobs(tokenizer: Any, sequence: list[int], scored: ScoredSequence, first: int, top: int) -> dict:
    """OpenAI's completions `logprobs` of sequence[first:] (position 0 has none: null, as OpenAI's echo)."""
    ids = sequence[first:]
    names, pieces = _token_names(tokenizer, ids), _pieces(tokenizer, ids)
    positions = range(first, len(sequence))
    token_logprobs = [None if i == 0 else scored.token_logprobs[i - 1] for i in positions]
    tops = None
    if top > 0:
        tops = [None if i == 0 else dict(zip(_token_names(tokenizer, scored.top_ids[i - 1]),
                                             scored.top_logprobs[i - 1])) for i in positions]
    return {"tokens": names, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": np.cumsum([0] + [len(p) for p in pieces[:-1]]).tolist() if pieces else []}


def _echo_prefix(prompt: str | list, index: int, ids: list[int], tokenizer: Any) -> str:
    """What `echo` puts before completion `index`'s text: its prompt as sent, or decoded from its ids."""
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], str):
        return str(prompt[index])
    return decode(tokenizer, ids, False)


def _usage(prompts: list[list[int]], choices: list[Choice]) -> dict:
    """OpenAI's token counts (each prompt once, as vLLM counts them)."""
    completion_tokens = sum(len(c.token_ids) for c in choices)
    prompt_tokens = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def completions(body: CompletionRequest, request: Request) -> Any:
    """POST /v1/completions: every prompt gets the same settings, and n completions each."""
    service = service_of(request)
    scheduler, tokenizer = service.scheduler, service.tokenizer
    deadline = deadline_of(scheduler)
    prompts = await asyncio.to_thread(_completion_prompts, body.prompt, tokenizer, scheduler.max_context)
    stops = _stops(body.stop, tokenizer)
    limits = scheduler.config
    # OpenAI's default of 16 when max_tokens is left out, or the operator's if that is smaller.
    params = _params(body, _budget(body.max_tokens, "max_tokens", min(16, limits.default_max_tokens),
                                   limits.max_tokens_limit))
    check_request(scheduler, prompts, [params] * len(prompts), "prompt", "")
    if body.logprobs is not None:
        _check_scoring(scheduler, prompts, params.max_new_tokens, body.logprobs, "logprobs")
    rows = sampler_rows(prompts, [params] * len(prompts), True, scheduler.weights.config.vocab_size)
    scoring = None if body.logprobs is None else (params.temperature, body.logprobs)
    choices, sequences, scored = await _sample(service, rows, stops, scoring, request, deadline)
    prompt_of = [i for i in range(len(prompts)) for _ in range(body.n)]
    out = []
    for index, (p, choice) in enumerate(zip(prompt_of, choices)):
        prefix = _echo_prefix(body.prompt, p, prompts[p], tokenizer) if body.echo else ""
        first = 0 if body.echo else len(prompts[p])
        logprobs = (None if scored is None or body.logprobs is None else
                    _legacy_logprobs(tokenizer, sequences[index], scored[index], first, body.logprobs))
        out.append({"index": index, "text": prefix + choice.text, "logprobs": logprobs,
                    "token_ids": choice.token_ids, **_ending(scheduler, choice)})
    response = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
                "model": body.model or service.name, "choices": out, "usage": _usage(prompts, choices)}
    return _answer(response, body, "text_completion")


# ---------------------------------------------------------------- /v1/chat/completions

def _message_text(message: ChatMessage) -> str | None:
    if message.content is None or isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def _chat_prompt(messages: list[ChatMessage], tokenizer: Any, max_context: int) -> list[int]:
    """The conversation rendered by the tokenizer's chat template, ready for the assistant's turn, as ids."""
    if tokenizer is None:
        raise BadRequest("messages: this server has no tokenizer to apply a chat template")
    if not getattr(tokenizer, "chat_template", None):
        raise BadRequest("messages: the served tokenizer has no chat template; use /v1/completions")
    conversation = [{"role": m.role, "content": _message_text(m), **({"name": m.name} if m.name else {})}
                    for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # noqa: BLE001 - templates raise their own errors on conversations they refuse
        raise BadRequest(f"messages: the chat template refuses this conversation: {error}") from None
    # The template writes its special tokens (BOS included) itself: none are added when tokenizing.
    ids = tokenize([text], _NoSpecialTokens(tokenizer), "messages", max_context)[0]
    if not ids:
        raise BadRequest("messages: the chat template rendered an empty prompt")
    return ids


@dataclasses.dataclass(frozen=True)
class _NoSpecialTokens:
    """The tokenizer, called without adding special tokens (a chat template holds them already)."""

    tokenizer: Any

    def __call__(self, text: str) -> Any:
        return self.tokenizer(text, add_special_tokens=False)


def _chat_logprobs(tokenizer: Any, sequence: list[int], scored: ScoredSequence, first: int, top: int) -> dict:
    """OpenAI's chat `logprobs.content`: each completion token's text, log-prob, bytes and top entries."""
    def entry(token_id: int, logprob: float) -> dict:
        text = _pieces(tokenizer, [token_id])[0]
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for i in range(first, len(sequence)):
        tops = [entry(t, lp) for t, lp in zip(scored.top_ids[i - 1][:top], scored.top_logprobs[i - 1][:top])]
        content.append({**entry(sequence[i], scored.token_logprobs[i - 1]), "top_logprobs": tops})
    return {"content": content}


async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    """POST /v1/chat/completions: n assistant replies to one conversation."""
    service = service_of(request)
    scheduler, tokenizer = service.scheduler, service.tokenizer
    deadline = deadline_of(scheduler)
    prompt = await asyncio.to_thread(_chat_prompt, body.messages, tokenizer, scheduler.max_context)
    stops = _stops(body.stop, tokenizer)
    top = body.top_logprobs or 0
    if top and not body.logprobs:  # before any work: a refused request costs no batch
        raise BadRequest("top_logprobs: needs logprobs: true")
    limits = scheduler.config
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    given = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    # Not the rest of the context: one request without max_tokens must not hold the worker for minutes.
    budget = _budget(given, field, min(limits.default_max_tokens, max(scheduler.max_context - len(prompt), 0)),
                     limits.max_tokens_limit)
    if body.max_tokens is not None and body.max_tokens > limits.max_tokens_limit:
        raise BadRequest(f"max_tokens: {body.max_tokens} exceeds this service's limit of "
                         f"{limits.max_tokens_limit} (--max-tokens-limit)")
    params = _params(body, budget)
    check_request(scheduler, [prompt], [params], "messages", "")
    if body.logprobs:
        _check_scoring(scheduler, [prompt], params.max_new_tokens, top, "logprobs")
    rows = sampler_rows([prompt], [params], True, scheduler.weights.config.vocab_size)
    scoring = (params.temperature, top) if body.logprobs else None
    choices, sequences, scored = await _sample(service, rows, stops, scoring, request, deadline)
    out = [{"index": j, "message": {"role": "assistant", "content": choice.text},
            "logprobs": None if scored is None else _chat_logprobs(tokenizer, sequences[j], scored[j], len(prompt),
                                                                   top),
            "token_ids": choice.token_ids, **_ending(scheduler, choice)} for j, choice in enumerate(choices)]
    response = {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
                "model": body.model or service.name, "choices": out, "usage": _usage([prompt], choices)}
    return _answer(response, body, "chat.completion.chunk")


ROUTES = (  # (method, path, handler), wired by serve/app.py
    ("GET", "/v1/models", models),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/chat/completions", chat_completions),
)
