"""Trainer-side rollout client: prompts out, completions + behaviour log-probs + weight version back.

It drives the inference engine the services run (`rollout.engine`) through that engine's module under
rollout/engines/ (our service, SGLang, vLLM: one interface, `engines.base.Engine`), and never branches on its name.
Several URLs form a data-parallel fleet (`rollout/routing.py` says which URL samples which prompt): a call with
routing keys (an episode's turns) goes by key, so each episode stays with the service that caches its prefix; one
without keys is cut into contiguous shares of whole groups. A URL that keeps failing (`retryable`) hands its prompts
to the others and, for `rest_s` after, is asked only when no other URL is left. Weight pushes go by folder
(`update_weights`, as the engine loads one) or, to the trainer's own child (rollout/local_service.py), by
shared-memory segment (`update_weights_from_segment`).
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import functools
import json
import logging
import os
import random
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, Self

import httpx
import numpy as np

from drgrpo_jax.config.engines import EngineName
from drgrpo_jax.errors import RolloutError, StaleWeightsError
from drgrpo_jax.models.hf_io import load_hf_config
from drgrpo_jax.rollout.engines import ENGINES
from drgrpo_jax.rollout.engines.base import Completion, PrefixCacheStats, Sampling, described, json_object
from drgrpo_jax.rollout.local_service import LocalServer
from drgrpo_jax.rollout.prefix_cache import PrefixCacheReadings
from drgrpo_jax.rollout.routing import Router, route_key
from drgrpo_jax.seeds import prompt_seeds, unseeded
from drgrpo_jax.weight_folders import is_remote

log = logging.getLogger("drgrpo_jax.rollout")
__all__ = ["Completions", "RolloutClient", "RouterShape", "check_versions", "decode_routed_experts",
           "model_vocab_size", "retryable"]
_BUSY_4XX = frozenset({408, 429})  # client-error codes that mean "not now", not "bad request"
# An answer's size cap: a generate call's is its rows x budget x this (vLLM's per-token entry is ~170 bytes with its
# one top log-prob, SGLang's ~40; the rest is room for fields the client does not read), never below the floor,
# which is every other answer's cap (start-up settings, weight pushes).
ANSWER_BYTES_PER_TOKEN = 1024
MIN_ANSWER_CAP = 32 << 20


class _Answer(NamedTuple):
    """One HTTP answer, read whole."""

    status: int
    headers: httpx.Headers
    content: bytes


def retryable(status: int | None) -> bool:
    """Whether a request that failed with HTTP `status` (None = no answer) may succeed elsewhere or later.

    Decided on the status, never on a message: no answer (connection errors, timeouts), 5xx, 408 and 429 say the
    server cannot serve now, so the request is retried on the same URL with exponential backoff and jitter (no
    sooner than a 429/503's Retry-After asks), then fails over to the next URL; any other 4xx says the request
    itself is bad, which every server would refuse, so it raises at once.
    """
    return status is None or status >= 500 or status in _BUSY_4XX


@dataclasses.dataclass(frozen=True)
class Completions:
    """What one `generate` call sampled: G completions of each of P prompts, prompt-major (row p * G + g), padded
    to the generation budget T; the arrays carry the rollout record's names (`rollout/record.py`)."""

    response_ids: np.ndarray  # int32 [N, T], 0 after each completion's end
    behaviour_logprobs: np.ndarray  # float32 [N, T]: the sampler's (temperature-scaled), 0 on padding
    response_mask: np.ndarray  # bool [N, T]: True on generated tokens
    lengths: np.ndarray  # int32 [N]
    truncated: np.ndarray  # bool [N]: hit the budget without a stop token
    weight_versions: tuple[str | None, ...]  # [N] as the service reported them: the oldest that sampled the row
    # int32 [N, T]: the version that sampled each token (a service with --inflight-updates reports it per token;
    # otherwise the row's), -1 on padding and where the version is not an integer
    token_versions: np.ndarray
    group_size: int  # G
    # Router replay (asked for): per row int32 [prompt + length - 1, L, k], the experts every layer chose for each
    # token the service read (the prompt's, then the completion's but its last); None when not asked.
    routed_experts: tuple[np.ndarray, ...] | None = None


class RouterShape(NamedTuple):
    """What a served mixture's routed experts look like: L layers, k experts per token out of e."""

    layers: int
    experts_per_token: int
    num_experts: int


def check_versions(versions: Sequence[str | None], expected: str | int, max_staleness: int = 0) -> None:
    """Raises StaleWeightsError unless every version is within max_staleness of the expected one."""
    expected_text = str(expected)
    for version in set(versions):
        if version == expected_text:
            continue
        numeric = version is not None and version.lstrip("-").isdigit() and expected_text.isdigit()
        if max_staleness > 0 and numeric and version is not None and \
                int(expected_text) - max_staleness <= int(version) <= int(expected_text):
            continue
        raise StaleWeightsError(f"weight_version: got {version!r}, expected {expected_text!r}"
                                + (f" (at most {max_staleness} versions old)" if max_staleness else ""))


class RolloutClient:
    """Sends rollouts to one or more generation services and gathers them in prompt order.

    `api_key`: every request carries `Authorization: Bearer <key>`. `local_server` (the trainer's own child,
    `LocalServer`): when it dies (killed, OOM) the client restarts it, loads the weights last pushed and redoes
    the request (`service_restarts` counts it, up to `max_restarts`). `engine`: the inference engine the services
    run, by its rollout.engine name (`ENGINES`); each URL's start-up settings are checked on first use.
    `vocab_size`: the trained model's vocabulary, which every answered token id must be in; None: each URL's own
    report, read once (our service's /get_model_info), else only int32 ids are checked. `timeout_s` bounds each
    request whole (sending, waiting and reading), not each read. `rest_s`: how long a URL that failed a generate call
    is asked only when every other is resting or failed (its keys come back to it after).
    """

    def __init__(self, urls: Sequence[str], *, timeout_s: float = 600.0, connect_timeout_s: float = 10.0,
                 max_retries: int = 4, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 transport: httpx.BaseTransport | None = None, api_key: str | None = None,
                 local_server: LocalServer | None = None, max_restarts: int = 3, engine: EngineName = "ours",
                 vocab_size: int | None = None, rest_s: float = 30.0):
        if isinstance(urls, str):
            urls = [urls]
        if not urls:
            raise ValueError("urls: need at least one generation service URL")
        if max_retries < 0 or backoff_s < 0:
            raise ValueError("max_retries, backoff_s: must be >= 0")
        if engine not in ENGINES:
            raise ValueError(f"engine: {engine!r} is not one of {', '.join(ENGINES)}")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size: must be >= 1, got {vocab_size}")
        self._engine = ENGINES[engine]
        self.vocab_size = vocab_size
        self._vocab_sizes: dict[str, int | None] = {}  # each URL's own report, when vocab_size is not given
        self.timeout_s = timeout_s
        self._ready: set[str] = set()  # the URLs checked by check_engine
        self._returns_experts: set[str] = set()  # the URLs checked to return routed experts
        self.seeds_ignored_by: tuple[str, ...] = ()  # the URLs that sample without honouring the seeds sent
        self.urls = tuple(u.rstrip("/") for u in urls)
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self._router = Router(rest_s)
        self._prefix_caches = PrefixCacheReadings()
        self.local_server, self.max_restarts = local_server, max_restarts
        self.service_restarts = 0  # times local_server was found dead and restarted
        self._restart_lock = threading.Lock()
        self._pushed: tuple[str, str] | None = None  # (path, version) of the last weights every service took
        self._pushed_segment: dict[str, Any] | None = None  # or the /update_weights_from_tensor body of the last push
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s), transport=transport,
                                  headers=headers)
        workers = max(len(self.urls), self._engine.in_flight)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout")
        # Pushes have threads of their own: with in-flight updates one must reach a service while a round's
        # requests hold every thread of the pool above.
        self._push_pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="push")

    @property
    def engine(self) -> EngineName:
        """The services' engine, by its rollout.engine name."""
        return self._engine.name

    def close(self) -> None:
        """Releases connections and threads."""
        self._pool.shutdown(wait=True)
        self._push_pool.shutdown(wait=True)
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, url: str, path: str, body: Any = None, max_bytes: int = MIN_ANSWER_CAP,
                 attempts: int | None = None) -> Any:
        """One call with retries while `retryable` (`attempts` in all, else max_retries + 1); its answer's JSON (None
        when empty); raises RolloutError with the last HTTP status (None = no answer), or at once for an answer that
        is not JSON."""
        error: Exception | None = None
        status: int | None = None
        retry_after = 0.0  # what the service asked for (429/503 Retry-After), capped at max_backoff_s
        attempts = self.max_retries + 1 if attempts is None else attempts
        for attempt in range(attempts):
            if attempt:
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
                delay *= 0.5 + random.random() / 2  # jitter: a fleet of clients does not retry in step
                time.sleep(max(delay, min(retry_after, self.max_backoff_s)))
            try:
                answer = self._exchange(method, url + path, body, max_bytes)
            except httpx.TransportError as e:  # connect/read/write errors and timeouts
                error, status, retry_after = e, None, 0.0
                if self._local_server_died(url):
                    break  # no retry can reach a dead child; generate/update_weights restart it
                continue
            if answer.status < 400:
                return _json(answer, f"{url}{path}", url)  # vLLM's /collective_rpc may answer empty
            status = answer.status
            retry_after = _retry_after(answer.headers)
            error = RolloutError(f"{url}{path}: HTTP {status}: {_error_message(answer.content)}", status=status,
                                 url=url)
            if not retryable(status):
                raise error
        raise RolloutError(f"{url}{path}: failed after {attempts} attempts: {error}",
                           status=status, url=url) from error

    def _exchange(self, method: str, url: str, body: Any, max_bytes: int) -> _Answer:
        """One HTTP exchange, answered whole within timeout_s: httpx's timeouts bound each read, so a server
        trickling a byte a second would hold a read loop forever. The exchange runs on a thread of its own and
        is given up at the deadline; that thread stops at its next byte (`_read`) or read timeout."""
        deadline = time.monotonic() + self.timeout_s
        outcome: list[_Answer | BaseException] = []
        done = threading.Event()

        def exchange() -> None:
            try:
                outcome.append(self._read(method, url, body, max_bytes, deadline))
            except BaseException as error:  # handed to the caller below
                outcome.append(error)
            finally:
                done.set()

        threading.Thread(target=exchange, name="rollout-request", daemon=True).start()
        if not done.wait(max(deadline - time.monotonic(), 0.0)):
            raise httpx.ReadTimeout(f"no whole answer within timeout_s={self.timeout_s:g} s")
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def _read(self, method: str, url: str, body: Any, max_bytes: int, deadline: float) -> _Answer:
        """The answer to one request, read until `deadline` and up to `max_bytes`."""
        with self._http.stream(method, url, json=body) as response:
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise RolloutError(f"{url}: the answer runs past {max_bytes} bytes, more than the request could "
                                       "need", status=response.status_code)
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout(f"no whole answer within timeout_s={self.timeout_s:g} s")
                chunks.append(chunk)
            return _Answer(response.status_code, response.headers, b"".join(chunks))

    def _local_server_died(self, url: str) -> bool:
        """Whether `url` is this client's own child service and that process has exited."""
        server = self.local_server
        return server is not None and server.url == url and not server.running

    def _restart_local_server(self, restarts_seen: int) -> Literal["restarted", "by_another", ""]:
        """Restarts the dead child service on the weights last pushed: "restarted"; "" when there is none to
        restart. One thread at a time (a round samples while the update loop pushes): a caller whose request
        failed before another thread restarted the child (`restarts_seen`: service_restarts before its request)
        gets "by_another", and must redo its request (a push, too: the child started on the weights pushed before)."""
        with self._restart_lock:
            server = self.local_server
            if server is not None and server.running:
                return "by_another" if self.service_restarts != restarts_seen else ""
            if server is None or self.service_restarts >= self.max_restarts:
                return ""
            self._restart(server)
            return "restarted"

    def _restart(self, server: LocalServer) -> None:
        self.service_restarts += 1
        old_url = server.url
        path, version = self._pushed or (server.model, server.weight_version)
        if self._pushed_segment is not None:  # the child starts on its first weights, then reloads the segment
            path, version = server.model, str(self._pushed_segment["weight_version"])
        log.warning("generation service %s died (exit code %s); restarting it on weight version %s (restart %d)",
                    old_url, server.returncode, version, self.service_restarts)
        server.stop()
        if self._pushed_segment is None and not is_remote(path):
            server.model, server.weight_version = path, str(version)
        new_url = server.start()
        self.urls = tuple(new_url if u == old_url else u for u in self.urls)
        if self._pushed_segment is not None:  # the last push came by shared memory: the segment is still there
            self._request("POST", new_url, "/update_weights_from_tensor", self._pushed_segment)
        elif server.weight_version != str(version):  # a bucket path: the child starts on local weights, then loads it
            self._request("POST", new_url, "/update_weights_from_disk",
                          {"model_path": path, "weight_version": str(version)})

    def generate(self, prompts: Sequence[Sequence[int]], group_size: int, *, max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop_token_ids: Sequence[int] = (), seed: int | None = None,
                 expected_version: str | int | None = None, max_staleness: int = 0, prompt_offset: int = 0,
                 first_url: int = 0, ignore_eos: bool = False, seeds: Sequence[int] | None = None,
                 return_routed_experts: RouterShape | None = None,
                 route_prefixes: Sequence[Sequence[int]] | None = None) -> Completions:
        """G completions of every prompt (token ids), with behaviour log-probs; checks the weight version.

        `prompt_offset`: the index of prompts[0] in the whole rollout, so that a host sampling its share
        draws the same per-prompt seeds as one client sampling everything. `route_prefixes`: per prompt, the
        prefix whose service it goes to (`routing.route_key`; an episode's turns give its opening, so the episode
        stays where its prefix is cached); without them, `first_url`: the URL that takes the first contiguous share
        (hosts start at different URLs to spread the load). `ignore_eos`: SGLang's
        sampling parameter, the model's EOS does not end a completion (stop_token_ids still do). `seeds`: each
        prompt's own sampling seed, in place of those drawn from `seed` and `prompt_offset`.
        `return_routed_experts` (the served mixture's shape): each completion also brings the experts its tokens
        were routed to (SGLang's `return_routed_experts`; a vLLM server must run with
        --enable-return-routed-experts), checked against that shape (`Completions.routed_experts`).
        """
        if group_size < 1 or max_new_tokens < 1:
            raise ValueError(f"group_size, max_new_tokens: must be >= 1, got {group_size}, {max_new_tokens}")
        if not prompts:
            raise ValueError("prompts: need at least one prompt")
        if seeds is None:
            seeds = prompt_seeds(unseeded() if seed is None else seed, len(prompts), prompt_offset)
        elif len(seeds) != len(prompts):
            raise ValueError(f"seeds: {len(seeds)} for {len(prompts)} prompts")
        if route_prefixes is not None and len(route_prefixes) != len(prompts):
            raise ValueError(f"route_prefixes: {len(route_prefixes)} for {len(prompts)} prompts")
        keys = None if route_prefixes is None else [route_key(prefix) for prefix in route_prefixes]
        self.check_engine()
        if return_routed_experts is not None:
            self._check_routed_experts()
        sampling = Sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            stop_token_ids=tuple(map(int, stop_token_ids)), ignore_eos=ignore_eos,
                            routed_experts=return_routed_experts is not None)
        tokens_per_row = max_new_tokens * ANSWER_BYTES_PER_TOKEN
        if return_routed_experts is not None:  # base64 of int32 ids for every token read (8 bytes: room for JSON)
            tokens_per_row += (max(map(len, prompts)) + max_new_tokens) * 8 * \
                return_routed_experts.layers * return_routed_experts.experts_per_token
        while True:
            restarts = self.service_restarts
            try:
                rows = self._gather(prompts, seeds, keys, first_url, sampling, group_size, tokens_per_row)
                break
            except RolloutError as error:  # the same prompts and seeds again: the redone request samples the same
                if not (retryable(error.status) and self._restart_local_server(restarts)):
                    raise
        completions = _to_completions(rows, group_size, max_new_tokens)
        if return_routed_experts is not None:
            completions = dataclasses.replace(completions, routed_experts=tuple(
                _named(source, decode_routed_experts, row.routed_experts, r, len(prompts[r // group_size]),
                       len(row.ids), return_routed_experts) for r, (source, row) in enumerate(rows)))
        if expected_version is not None:  # every token's version (a non-integer one is its row's)
            token_versions = np.unique(completions.token_versions[completions.token_versions >= 0])
            check_versions([*completions.weight_versions, *map(str, token_versions)], expected_version,
                           max_staleness)
        return completions

    def _gather(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], keys: Sequence[bytes] | None,
                first_url: int, sampling: Sampling, group_size: int,
                bytes_per_row: int) -> list[tuple[str, Completion]]:
        """Samples every prompt on the URL `routing` gives it (by `keys`, else contiguous shares from `first_url`), the
        URLs' calls in parallel; the prompts of a URL that fails `retryable` go again to the URLs left. The
        completions in prompt order, each checked (`Engine.read_completions`) and with the `url + path` that answered
        it."""
        answered: dict[int, list[tuple[str, Completion]]] = {}
        failed: dict[int, RolloutError] = {}  # URL index -> why it failed this call
        pending = list(range(len(prompts)))
        while pending:
            shares = self._router.shares(self.urls, pending, keys, first_url, failed)
            if not shares:
                raise RolloutError("every generation service failed: " + " | ".join(map(str, failed.values()))) \
                    from list(failed.values())[-1]
            calls = self._engine.generate_calls(prompts, seeds, [share for _, share in shares], group_size, sampling)
            futures = [self._pool.submit(self._request, "POST", self.urls[shares[call.share][0]], call.path, call.body,
                                         max(MIN_ANSWER_CAP, len(call.prompts) * group_size * bytes_per_row))
                       for call in calls]
            pending = []
            for call, future in zip(calls, futures):
                index = shares[call.share][0]
                url = self.urls[index]
                try:
                    answer = future.result()
                except RolloutError as error:
                    if not retryable(error.status):  # the request itself is bad: every server would refuse it
                        raise
                    failed[index] = error
                    self._router.failed(url)
                    pending += call.prompts
                    continue
                self._router.answered(url)
                source = f"{url}{call.path}"
                read = _named(source, self._engine.read_completions, answer, group_size, self._vocab_of(url))
                if len(read) != len(call.prompts) * group_size:
                    raise RolloutError(f"{source}: {len(read)} completions for {len(call.prompts)} prompts x "
                                       f"{group_size}", url=url)
                for k, prompt in enumerate(call.prompts):
                    answered[prompt] = [(source, row) for row in read[k * group_size:(k + 1) * group_size]]
            pending.sort()
        return [row for prompt in range(len(prompts)) for row in answered[prompt]]

    def _vocab_of(self, url: str) -> int | None:
        """The vocabulary the ids answered by `url` must be in: the trained model's, else the server's own report."""
        return self.vocab_size if self.vocab_size is not None else self._vocab_sizes.get(url)

    def check_engine(self) -> None:
        """Has the engine read once per URL what the server says of its start-up settings: ConfigError naming a
        setting it lacks (vLLM's routes and log-prob mode); `seeds_ignored_by` gains a server that ignores sampling
        seeds (SGLang without --enable-deterministic-inference), with a warning; and, without `vocab_size`, the
        vocabulary it reports."""
        for url in self.urls:
            if url in self._ready:
                continue
            if not self._engine.check_startup(url, self._request):
                self.seeds_ignored_by += (url,)
            if self.vocab_size is None:
                self._vocab_sizes[url] = self._engine.vocab_size(url, self._request)
            self._ready.add(url)

    def _check_routed_experts(self) -> None:
        """ConfigError (model.moe.router_replay) for a URL whose server does not return routed experts; once per URL."""
        for url in self.urls:
            if url not in self._returns_experts:
                self._engine.check_routed_experts(url, self._request)
                self._returns_experts.add(url)

    def update_weights(self, model_path: str, weight_version: str | int, *, rollback: bool = False) -> None:
        """Tells every service to load `model_path` as `weight_version`; raises naming every URL that refused.

        `rollback`: the services may go back to an older version (a run resumed from a checkpoint).

        Every URL is asked (in parallel) even when one fails, so no service is left on stale weights
        without being named.
        """
        model_path = os.fspath(model_path)
        if not is_remote(model_path):  # services refuse relative paths (they would resolve against their own cwd)
            model_path = os.path.abspath(model_path)
        elif not self._engine.traits.reads_buckets:
            raise RolloutError(f"{model_path}: {self._engine.traits.label} reloads weights from a folder on its own "
                               "disk, not a bucket")
        self.check_engine()

        def push(url: str) -> str | None:
            try:
                self._engine.push_weights(url, model_path, str(weight_version), rollback, self._request)
            except RolloutError as error:
                return str(error)
            return None

        restarts = self.service_restarts
        failures = [error for error in self._push_pool.map(push, self.urls) if error]
        if failures and self._local_server_died(self.urls[0]):
            # The restarted child starts on these very weights.
            self._pushed, self._pushed_segment = (model_path, str(weight_version)), None
            restarted = self._restart_local_server(restarts)
            if restarted:
                failures = [error for error in self._push_pool.map(push, self.urls) if error] \
                    if restarted == "by_another" else []
        if failures:
            raise RolloutError(f"weight version {weight_version} not loaded by {len(failures)} of {len(self.urls)} "
                               "service(s): " + " | ".join(failures))
        self._pushed, self._pushed_segment = (model_path, str(weight_version)), None

    def update_weights_from_segment(self, segment: str, tensors: list[dict[str, Any]], weight_version: str | int, *,
                                    rollback: bool = False) -> None:
        """Tells the trainer's own child service to load shared-memory segment `segment` (its index: `tensors`)
        as `weight_version`; RolloutError when it refuses. The segment must outlive the next push: a child
        that dies is restarted and reloads it (`drgrpo_jax.rollout.weight_push` keeps it until then).
        """
        if self.local_server is None or self.urls != (self.local_server.url,):
            raise RolloutError("update_weights_from_segment: only the trainer's own child service maps its memory")
        body: dict[str, Any] = {"segment": segment, "tensors": tensors, "weight_version": str(weight_version),
                                "allow_rollback": rollback}
        url, restarts = self.urls[0], self.service_restarts
        try:
            answer = self._request("POST", url, "/update_weights_from_tensor", body)
        except RolloutError:
            if not self._local_server_died(url):
                raise
            self._pushed_segment = body  # the restarted child reloads it
            restarted = self._restart_local_server(restarts)
            if not restarted:
                raise
            answer = {"success": True} if restarted == "restarted" else \
                self._request("POST", self.urls[0], "/update_weights_from_tensor", body)
        if not (isinstance(answer, dict) and answer.get("success") is True):
            message = answer.get("message") if isinstance(answer, dict) else "the answer is not an object"
            raise RolloutError(f"weight version {weight_version} not loaded by {url}: {described(message)}")
        self._pushed_segment = body

    def model_info(self, index: int = 0) -> dict:
        """The service's /get_model_info; RolloutError, asking nothing, when its engine has no such route."""
        url = self.urls[index]
        if not self._engine.traits.serves_model_info:
            raise RolloutError(f"{url}: {self._engine.traits.label} has no /get_model_info", url=url)
        return json_object(self._request("GET", url, "/get_model_info"), f"{url}/get_model_info: the answer")

    def prefix_cache_delta(self) -> PrefixCacheStats | None:
        """What the services' prefix caches did since the last call, summed (`PrefixCacheReadings.delta`): one
        request per URL whose engine reports a cache, not retried; None when none does."""
        return self._prefix_caches.delta(self._engine, self.urls, functools.partial(self._request, attempts=1))

    def healthy(self) -> list[bool]:
        """One health probe per URL, without retries."""
        out = []
        for url in self.urls:
            try:
                out.append(self._http.get(url + "/health", timeout=5.0).status_code == 200)
            except httpx.TransportError:
                out.append(False)
        return out


def _retry_after(headers: httpx.Headers) -> float:
    """Seconds from a Retry-After header (0 when absent or an HTTP date)."""
    try:
        return max(0.0, float(headers.get("retry-after", 0)))
    except ValueError:
        return 0.0


def _error_message(content: bytes) -> str:
    """The error text of an OpenAI-, SGLang- or FastAPI-style error body, on one line."""
    try:
        body = json.loads(content)
        if isinstance(body, dict):
            error = body.get("error")
            body = error.get("message") if isinstance(error, dict) else \
                body.get("message") or body.get("detail") or error or body
        text = str(body)
    except (ValueError, RecursionError):  # not JSON, or nested too deep to show
        text = content[:500].decode("utf-8", "replace")
    return " ".join(text[:500].split())


def _json(answer: _Answer, source: str, url: str) -> Any:
    """An answer's JSON (None when empty); RolloutError naming `source` for one that is not JSON, nests deeper than
    Python's reader goes (about 1,000 levels), or holds a number it cannot read."""
    if not answer.content:
        return None
    try:
        return json.loads(answer.content)
    except RecursionError:
        reason = "JSON nested deeper than the client reads"
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError, integers past Python's digit limit, bad UTF-8
        kind = answer.headers.get("content-type", "no content type").split(";")[0]
        reason = f"not JSON ({kind}, {len(answer.content)} bytes)"
    raise RolloutError(f"{source}: the answer is {reason}", status=answer.status, url=url)


def _named(source: str, read: Any, *args: Any) -> Any:
    """`read(*args)`, a RolloutError from it prefixed with the `url + path` whose answer it read."""
    try:
        return read(*args)
    except RolloutError as error:
        raise RolloutError(f"{source}: {error}", status=error.status, url=error.url) from None


def model_vocab_size(model_path: str) -> int | None:
    """The vocabulary of the model folder at `model_path` (its config.json): what the trainer's ids must be in;
    None for a GGUF file, whose vocabulary the trainer reads as it loads it."""
    return load_hf_config(model_path).vocab_size if os.path.isdir(model_path) else None


def decode_routed_experts(encoded: str | None, row: int, prompt_length: int, length: int,
                          shape: RouterShape) -> np.ndarray:
    """int32 [prompt_length + length - 1, L, k] from a completion's `meta_info.routed_experts` (SGLang's base64 of
    little-endian int32); RolloutError naming the completion when it is missing, of another shape or out of range."""
    if not isinstance(encoded, str):
        raise RolloutError(f"completion {row}: no meta_info.routed_experts (the service did not return the routed "
                           "experts: a dense model, or a server that does not support them)")
    try:
        flat = np.frombuffer(base64.b64decode(encoded, validate=True), "<i4")
    except ValueError:  # bad base64 (binascii.Error) or a byte count that is no whole int32
        raise RolloutError(f"completion {row}: meta_info.routed_experts is not base64 of int32 values") from None
    per_token = shape.layers * shape.experts_per_token
    tokens = max(prompt_length + length - 1, 0)
    if flat.size != tokens * per_token:
        raise RolloutError(f"completion {row}: meta_info.routed_experts holds {flat.size} ids, not the {tokens} "
                           f"tokens read (prompt {prompt_length} + completion {length} - 1) x {shape.layers} layers "
                           f"x {shape.experts_per_token} experts = {tokens * per_token}")
    if flat.size and not (flat.min() >= 0 and flat.max() < shape.num_experts):
        raise RolloutError(f"completion {row}: meta_info.routed_experts has expert ids in [{flat.min()}, "
                           f"{flat.max()}], outside the model's [0, {shape.num_experts})")
    return flat.astype(np.int32).reshape(tokens, shape.layers, shape.experts_per_token)


def _to_completions(sourced: list[tuple[str, Completion]], group_size: int, budget: int) -> Completions:
    """Pads checked completions (each with the `url + path` that answered it) into Completions; RolloutError for
    one longer than the budget."""
    rows = [row for _, row in sourced]
    response_ids = np.zeros((len(rows), budget), np.int32)
    behaviour_logprobs = np.zeros((len(rows), budget), np.float32)
    token_versions = np.full((len(rows), budget), -1, np.int32)
    for r, (source, row) in enumerate(sourced):
        if len(row.ids) > budget:
            raise RolloutError(f"{source}: completion {r}: {len(row.ids)} tokens exceed max_new_tokens={budget}")
        response_ids[r, :len(row.ids)] = row.ids
        behaviour_logprobs[r, :len(row.ids)] = row.logprobs
        token_versions[r, :len(row.ids)] = row.token_versions
    lengths = np.array([len(row.ids) for row in rows], np.int32)
    return Completions(response_ids=response_ids, behaviour_logprobs=behaviour_logprobs,
                       response_mask=np.arange(budget)[None, :] < lengths[:, None], lengths=lengths,
                       truncated=np.array([row.truncated for row in rows], bool),
                       weight_versions=tuple(row.weight_version for row in rows), token_versions=token_versions,
                       group_size=group_size)
