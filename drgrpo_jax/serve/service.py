"""What every route shares: the Service state stored on the app, the error body, the checks a request passes
before anything is queued, tokenizing and decoding, and running rows on the Scheduler."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse

from drgrpo_jax.errors import BadRequest, ClientGone
from drgrpo_jax.hub_ids import hub_id
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams
from drgrpo_jax.seeds import unseeded
from drgrpo_jax.serve.scheduler import RowResult, Scheduler
from drgrpo_jax.serve.schemas import MAX_TEXT_CHARS, SamplingParamsIn
from drgrpo_jax.serve.scoring import ScoringRate

__all__ = ["CHARS_PER_TOKEN", "DISCONNECT_POLL_S", "Service", "abort_message", "check_request", "check_share",
           "deadline_of", "decode", "error_response", "greedy_below", "prompt_ids", "run_rows", "sampler_rows",
           "service_of", "shown_name", "tokenize", "wait_while_wanted"]

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily: logits / t would overflow float32 (t ~ 1e-9)
CHARS_PER_TOKEN = 32  # a text longer than context x this cannot fit: refused before it is tokenized
DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks that its client is still there


@dataclasses.dataclass(frozen=True)
class Service:
    """What every route handler reads, stored on the app by build_app."""

    scheduler: Scheduler
    tokenizer: Any  # a transformers tokenizer, or None: only token-id prompts are served
    name: str  # the model's name in responses (served_model_name): never where it lies on the server
    weights_roots: tuple[str, ...] = ()  # normalized --weights-root folders and gs:// prefixes
    # The served model's measured scoring speed, learnt from its calls: what sizes a scoring call to its deadline.
    scoring_rate: ScoringRate = dataclasses.field(default_factory=ScoringRate)

    def shown(self, path: str) -> str:
        """What responses call the weights loaded from `path`: the served name for the model the service started
        with, else the last part of the path (a client holding only the API key learns no server path)."""
        return self.name if path == self.scheduler.config.model else shown_name(path)


def shown_name(spec: str) -> str:
    """A model's or tokenizer's name fit for a response: a Hub id as given, else the last part of its path or URI."""
    if hub_id(spec) is not None:
        return spec
    return os.path.basename(spec.rstrip("/")) or spec


def service_of(request: Request) -> Service:
    """The Service of the app this request came to."""
    return request.app.state.service


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI-style error body (the openai client reads error.message)."""
    kind = "invalid_request_error" if status < 500 else "internal_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers)


def greedy_below(temperature: float) -> float:
    """`temperature`, or 0 (greedy) when it is so small that dividing logits by it leaves float32's range; the
    token drawn is then the likeliest either way, and its log-prob is reported finite."""
    return 0.0 if temperature < GREEDY_BELOW else temperature


def tokenize(texts: list[str], tokenizer: Any, field: str, max_context: int) -> list[list[int]]:
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


def prompt_ids(text: str | list[str] | None, input_ids: list | None, tokenizer: Any, field: str, max_context: int
               ) -> tuple[list[list[int]], bool]:
    """(token-id prompts, was it a batch) from text or ids; exactly one of them must be given."""
    if (text is None) == (input_ids is None):
        raise BadRequest(f"{field}: give exactly one of text or input_ids")
    if text is not None:
        if tokenizer is None:
            raise BadRequest(f"{field}: this server has no tokenizer; send token ids")
        texts = [text] if isinstance(text, str) else text
        return tokenize(texts, tokenizer, field, max_context), not isinstance(text, str)
    assert input_ids is not None  # exactly one of the two was given (checked above)
    is_batch = bool(input_ids) and isinstance(input_ids[0], list)
    return (input_ids if is_batch else [input_ids]), is_batch


def decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text of `ids`, or "" without a tokenizer (such a server's clients read the token ids)."""
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if tokenizer is not None else ""


def check_request(scheduler: Scheduler, prompts: list[list[int]], params: list[SamplingParamsIn], field: str,
                  params_field: str, record: bool = False) -> None:
    """Refuses empty prompts, ids outside the vocabulary, prompts + budgets beyond the context or the sampler's
    memory budget (`record`: with the routed experts recorded), and requests over the row or token budget; all
    before anything is queued."""
    if not prompts:
        raise BadRequest(f"{field}: no prompts")
    vocab, limits = scheduler.weights.config.vocab_size, scheduler.config
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        if not prompt:
            raise BadRequest(f"{field}[{i}]: empty prompt")
        if max(prompt) >= vocab:
            raise BadRequest(f"{field}[{i}]: token id {max(prompt)} is outside the vocabulary of {vocab}")
        if len(prompt) + p.max_new_tokens > scheduler.max_context:
            raise BadRequest(f"{field}[{i}]: prompt of {len(prompt)} tokens + {p.max_new_tokens} new tokens exceeds "
                             f"the context of {scheduler.max_context}")
        if p.stop_token_ids and max(p.stop_token_ids) >= vocab:
            raise BadRequest(f"{params_field}stop_token_ids: token id {max(p.stop_token_ids)} is outside the "
                             f"vocabulary of {vocab}")
        need = scheduler.batch_bytes(1, len(prompt), p.max_new_tokens, record)
        if need > scheduler.batch_budget:
            raise BadRequest(f"{field}[{i}]: a prompt of {len(prompt)} tokens with {p.max_new_tokens} new tokens needs "
                             f"{need / 2**20:,.0f} MiB of sampler memory, over the service's budget of "
                             f"{scheduler.batch_budget / 2**20:,.0f} MiB a batch (--max-batch-bytes)")
    rows = sum(p.n for p in params)
    if rows > limits.max_rows_per_request:
        raise BadRequest(f"n: {rows} completions exceed max_rows_per_request={limits.max_rows_per_request}")
    tokens = sum(p.n * (len(prompt) + p.max_new_tokens) for prompt, p in zip(prompts, params))
    if tokens > limits.max_request_tokens:
        raise BadRequest(f"n: prompts x n x (prompt + new tokens) = {tokens} tokens exceed "
                         f"max_request_tokens={limits.max_request_tokens}")
    check_share(scheduler, max(p.max_new_tokens for p in params), field)


def check_share(scheduler: Scheduler, new_tokens: int, field: str) -> None:
    """Refuses a request whose batch would hold the workers for more than --admission-share of the deadline at
    the service's decoding speed: admitted, it would keep every later request waiting (or, with the queue full,
    refused) until the deadline, and be answered empty."""
    config = scheduler.config
    allowed = config.admission_share * config.request_timeout_s
    need = scheduler.batch_seconds(new_tokens) if config.admission_share else None
    if need is not None and need > allowed:
        raise BadRequest(f"{field}: up to {new_tokens} new tokens a completion would hold a batch for about "
                         f"{need:,.0f} s at this service's {scheduler.row_rate():,.0f} new tokens a second, over "
                         f"{allowed:g} s (--admission-share {config.admission_share:g} of --request-timeout-s "
                         f"{config.request_timeout_s:g}); ask for fewer new tokens")


def abort_message(scheduler: Scheduler, sampled: bool) -> str:
    """Why a completion ended with finish reason abort: its deadline passed (`sampled`: after some of it was
    sampled, or while its log-probs were computed; else before any of it was sampled)."""
    when = "before it finished" if sampled else "before this completion was sampled"
    return f"the request's deadline (--request-timeout-s {scheduler.config.request_timeout_s:g}) passed {when}"


def sampler_rows(prompts: list[list[int]], params: list[SamplingParamsIn], shared_seed: bool, vocab: int
                 ) -> list[RowRequest]:
    """Rows prompt-major (prompt 0's n samples first); each row gets its own random stream."""
    request_seed = unseeded()
    rows = []
    for index, (prompt, p) in enumerate(zip(prompts, params)):
        settings = SamplingParams(max_new_tokens=p.max_new_tokens, temperature=greedy_below(p.temperature),
                                  top_p=p.top_p,
                                  top_k=min(p.top_k, vocab), stop_token_ids=tuple(p.stop_token_ids or ()),
                                  ignore_eos=p.ignore_eos)
        # One shared seed: prompts are told apart by `stream`; per-prompt seeds are used as given.
        seed = p.row_seed if p.row_seed is not None else (request_seed if shared_seed else unseeded())
        rows += [RowRequest(tuple(prompt), settings, seed, index if shared_seed else 0, j) for j in range(p.n)]
    return rows


def deadline_of(scheduler: Scheduler) -> float:
    """When a request arriving now must be answered (time.monotonic()), from --request-timeout-s."""
    return time.monotonic() + scheduler.config.request_timeout_s


async def wait_while_wanted(waiter: asyncio.Future, request: Request, deadline: float,
                            stop: Callable[[], object]) -> bool:
    """Waits for `waiter` while its client is there, checking every DISCONNECT_POLL_S: True once it is done, False
    at `deadline` (the caller stops the work); when the client leaves, `stop()` and ClientGone."""
    while not (await asyncio.wait({waiter}, timeout=min(DISCONNECT_POLL_S,
                                                         max(deadline - time.monotonic(), 0))))[0]:
        if await request.is_disconnected():
            stop()
            raise ClientGone
        if time.monotonic() >= deadline:
            return False
    return True


async def run_rows(scheduler: Scheduler, rows: list[RowRequest], request: Request, deadline: float) -> list[RowResult]:
    """The rows' results; a failed batch answers HTTP 500 and the service keeps running.

    While waiting, the client is checked every DISCONNECT_POLL_S: once it is gone its rows are dropped
    at the next batch boundary (QueueFull, raised by submit, answers 429). At `deadline` the request is
    answered with the rows sampled so far and the others empty and `aborted` (their finish reason: abort).
    """
    future = scheduler.submit(rows)
    waiter = asyncio.wrap_future(future)
    if not await wait_while_wanted(waiter, request, deadline, future.cancel):
        done = scheduler.abandon(future)
        version = scheduler.weights.version
        return [r if r is not None else RowResult([], [], False, version, aborted=True) for r in done]
    try:
        return waiter.result()
    except Exception as error:
        raise HTTPException(500, f"generation failed: {type(error).__name__}: {error}") from error
