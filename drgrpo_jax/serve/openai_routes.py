"""OpenAI-compatible routes: `/v1/models`, `/v1/completions` (with `stop`, `logprobs`, `echo`) and
`/v1/chat/completions` (the tokenizer's chat template), for ordinary clients and lm-evaluation-harness."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import threading
import time
from typing import Any

import numpy as np
from fastapi import HTTPException, Request

from drgrpo_jax.errors import BadRequest
from drgrpo_jax.serve.engine import Engine
from drgrpo_jax.serve.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingParamsIn
from drgrpo_jax.serve.scoring import ScoredSequence, call_bytes, rows_per_call, score_sequences
from drgrpo_jax.serve.service import (
    Service,
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
                 ) -> tuple[list[ScoredSequence] | None, list[Choice]]:
    """(log-probs of each sequence under the weights that sampled it, the choices); 503 when the weights were
    swapped meanwhile. When scoring is not done by `deadline` the log-probs are None and every choice's finish
    reason is abort: the request is answered by its deadline all the same, and the scoring stops there (within
    one call of --max-batch-size rows), as it does when the client leaves.

    Every reported log-prob and top entry comes from this one forward pass over prompt + completion at the
    request's temperature (1 for greedy, as the sampler reports), so a token's log-prob equals its top entry
    exactly when it was the likeliest; the sampler's own log-probs (`/generate`) agree to ~1e-4.
    """
    weights, config = service.engine.weights, service.engine.config
    if any(c.weight_version != weights.version for c in choices):
        raise HTTPException(503, "weights: a new version was loaded while this request ran; send it again")
    stop = threading.Event()
    rows = rows_per_call(weights.config, max(map(len, sequences)), top, config.max_scoring_bytes,
                         service.engine.batch_budget, config.max_batch_size)
    scoring = asyncio.ensure_future(asyncio.to_thread(
        score_sequences, weights.graphdef, weights.state, sequences, [temperature] * len(sequences), top,
        weights.config.vocab_size, config.max_scoring_bytes, rows_per_call=rows, stopped=stop.is_set))
    scored = scoring.result() if await wait_while_wanted(scoring, request, deadline, stop.set) else None
    if scored is None:
        stop.set()
        return None, [dataclasses.replace(c, finish_reason="abort") for c in choices]
    return scored, choices


def _check_scoring(engine: Engine, prompts: list[list[int]], new_tokens: int, top: int, field: str) -> None:
    """Refuses, before anything is sampled, log-probs whose one sequence's scoring call would not fit the
    service's memory budget (--max-batch-bytes)."""
    longest = max(map(len, prompts)) + new_tokens
    need = call_bytes(engine.weights.config, 1, longest, top, engine.config.max_scoring_bytes)
    if need > engine.batch_budget:
        raise BadRequest(f"{field}: scoring a sequence of {longest} tokens needs {need / 2**20:,.0f} MiB, over the "
                         f"service's budget of {engine.batch_budget / 2**20:,.0f} MiB a batch (--max-batch-bytes)")


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
                                        "max_model_len": service.engine.max_context}]}


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


async def completions(body: CompletionRequest, request: Request) -> dict:
    """POST /v1/completions: every prompt gets the same settings, and n completions each."""
    service = service_of(request)
    engine, tokenizer = service.engine, service.tokenizer
    deadline = deadline_of(engine)
    prompts = await asyncio.to_thread(_completion_prompts, body.prompt, tokenizer, engine.max_context)
    stops = _stops(body.stop, tokenizer)
    limits = engine.config
    # OpenAI's default of 16 when max_tokens is left out, or the operator's if that is smaller.
    params = _params(body, _budget(body.max_tokens, "max_tokens", min(16, limits.default_max_tokens),
                                   limits.max_tokens_limit))
    check_request(engine, prompts, [params] * len(prompts), "prompt", "")
    if body.logprobs is not None:
        _check_scoring(engine, prompts, params.max_new_tokens, body.logprobs, "logprobs")
    rows = sampler_rows(prompts, [params] * len(prompts), True, engine.weights.config.vocab_size)
    results = await run_rows(engine, rows, request, deadline)
    choices = await asyncio.to_thread(lambda: [apply_stop(r, tokenizer, stops) for r in results])
    prompt_of = [i for i in range(len(prompts)) for _ in range(body.n)]
    sequences = [prompts[p] + c.token_ids for p, c in zip(prompt_of, choices)]
    scored = None
    if body.logprobs is not None:
        scored, choices = await _score(service, sequences, params.temperature, body.logprobs, choices, request,
                                        deadline)
    out = []
    for index, (p, choice) in enumerate(zip(prompt_of, choices)):
        prefix = _echo_prefix(body.prompt, p, prompts[p], tokenizer) if body.echo else ""
        first = 0 if body.echo else len(prompts[p])
        logprobs = (None if scored is None or body.logprobs is None else
                    _legacy_logprobs(tokenizer, sequences[index], scored[index], first, body.logprobs))
        out.append({"index": index, "text": prefix + choice.text, "logprobs": logprobs,
                    "finish_reason": choice.finish_reason, "token_ids": choice.token_ids,
                    "weight_version": choice.weight_version})
    return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
            "model": body.model or service.name, "choices": out, "usage": _usage(prompts, choices)}


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


async def chat_completions(body: ChatCompletionRequest, request: Request) -> dict:
    """POST /v1/chat/completions: n assistant replies to one conversation."""
    service = service_of(request)
    engine, tokenizer = service.engine, service.tokenizer
    deadline = deadline_of(engine)
    prompt = await asyncio.to_thread(_chat_prompt, body.messages, tokenizer, engine.max_context)
    stops = _stops(body.stop, tokenizer)
    top = body.top_logprobs or 0
    if top and not body.logprobs:  # before any work: a refused request costs no batch
        raise BadRequest("top_logprobs: needs logprobs: true")
    limits = engine.config
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    given = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    # Not the rest of the context: one request without max_tokens must not hold the worker for minutes.
    budget = _budget(given, field, min(limits.default_max_tokens, max(engine.max_context - len(prompt), 0)),
                     limits.max_tokens_limit)
    if body.max_tokens is not None and body.max_tokens > limits.max_tokens_limit:
        raise BadRequest(f"max_tokens: {body.max_tokens} exceeds this service's limit of "
                         f"{limits.max_tokens_limit} (--max-tokens-limit)")
    params = _params(body, budget)
    check_request(engine, [prompt], [params], "messages", "")
    if body.logprobs:
        _check_scoring(engine, [prompt], params.max_new_tokens, top, "logprobs")
    results = await run_rows(engine, sampler_rows([prompt], [params], True, engine.weights.config.vocab_size),
                             request, deadline)
    choices = await asyncio.to_thread(lambda: [apply_stop(r, tokenizer, stops) for r in results])
    sequences = [prompt + c.token_ids for c in choices]
    scored = None
    if body.logprobs:
        scored, choices = await _score(service, sequences, params.temperature, top, choices, request, deadline)
    out = [{"index": j, "message": {"role": "assistant", "content": choice.text},
            "logprobs": None if scored is None else _chat_logprobs(tokenizer, sequences[j], scored[j], len(prompt),
                                                                   top),
            "finish_reason": choice.finish_reason, "token_ids": choice.token_ids,
            "weight_version": choice.weight_version} for j, choice in enumerate(choices)]
    return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
            "model": body.model or service.name, "choices": out, "usage": _usage([prompt], choices)}


ROUTES = (  # (method, path, handler), wired by serve/app.py
    ("GET", "/v1/models", models),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/chat/completions", chat_completions),
)
