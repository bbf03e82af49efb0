"""The scheduler: the worker threads that batch requests into the sampler, each batch on the weights served when it
starts. The weights and their hot swap: weight_swap.py; what a batch may take on a device: batch_budget.py."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.errors import QueueFull
from drgrpo_jax.host_memory import mapped_fraction, return_freed_memory
from drgrpo_jax.models.precision import DTYPES
from drgrpo_jax.sampler.batch import RowRequest, bucket, distinct_prompts, make_batch, mesh_rows
from drgrpo_jax.sampler.generate import generate
from drgrpo_jax.sampler.programs import compiled_programs, drop_compiled_programs
from drgrpo_jax.serve.batch_budget import BatchBudget
from drgrpo_jax.serve.joining import Joining, joinable
from drgrpo_jax.serve.prefix_cache import Prefix, PrefixCache
from drgrpo_jax.serve.weight_swap import ServedWeights
from drgrpo_jax.serve.weights import Weights
from drgrpo_jax.sharding import parse_service_mesh, service_mesh

log = logging.getLogger("drgrpo_jax.serve")  # one logger name for the whole service, as before the split
__all__ = ["Scheduler", "RowResult"]


@dataclasses.dataclass(frozen=True)
class RowResult:
    """One completion."""

    output_ids: list[int]
    logprobs: list[float]
    stopped: bool  # ended on a stop/EOS token (the last of output_ids), else hit max_new_tokens
    weight_version: str  # the version the batch started on: the oldest that sampled any of its tokens
    aborted: bool = False  # the request's deadline passed before this row was sampled (output_ids: empty), or its
    # client left while it was sampled (output_ids: what was sampled until then; nobody reads it)
    # int32 [prompt + output - 1, L, k] (the row's `return_routed_experts`): the experts every layer chose for each
    # token the model read, the prompt's then the output's but its last (SGLang's routed_experts); else None
    routed_experts: np.ndarray | None = None
    # --inflight-updates: the version that sampled each of output_ids (a weight update can reach a running batch)
    token_versions: list[str] | None = None
    cached_tokens: int = 0  # leading prompt tokens read from the prefix cache instead of prefilled (SGLang's name)


def row_cost(row: RowRequest) -> int:
    """A row's share of the token budgets: its prompt plus the tokens it may generate."""
    return len(row.prompt_ids) + row.params.max_new_tokens


def _resolve(future: concurrent.futures.Future, result: Any = None, error: Exception | None = None) -> None:
    """Sets the future's outcome unless its handler cancelled it meanwhile (the client left)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


@dataclasses.dataclass(eq=False)
class _Lane:
    """One worker thread and the requests waiting for it."""

    name: str
    queue: queue.Queue = dataclasses.field(default_factory=queue.Queue)  # _Job, or None to stop
    pending: deque = dataclasses.field(default_factory=deque)  # (job, row index) gathered, not yet sampled
    worker: threading.Thread | None = None
    busy: bool = False  # has taken work since it last waited for some


@dataclasses.dataclass(eq=False)  # hashed by identity: the worker groups a failed batch's rows by request
class _Job:
    """A request's rows and the future its handler awaits (cancelled by the handler when its client is gone)."""

    rows: list[RowRequest]
    future: concurrent.futures.Future
    results: list[RowResult | None]
    remaining: int
    taken: int = 0  # rows taken into batches so far: the least served request goes first (`_take_rows`)


class Scheduler:
    """Owns the served weights (`served`: pushes swap them), the request queues and the worker threads that run
    the sampler.

    Requests from concurrent clients are cut into batches (rows = prompts x n), each taking the rows of the
    requests least served so far first, so a request of many batches takes turns with later ones. Each batch runs
    on the weights current when it starts, so a weight update swaps atomically between batches: batches in flight
    finish on the old weights, and every completion reports the `weight_version` it was sampled with. With
    --inflight-updates a batch in flight takes a newer version at its next decode phase or pause instead (the
    sampler's `weights_now`), and every completion reports the version of each of its tokens. Short requests
    (`short_request_tokens`) have their own worker, so a health probe's or a one-token request's wait does not
    depend on a long batch running meanwhile; a row's tokens depend only on its seed, not on its lane or batch.
    """

    def __init__(self, config: ServeConfig):
        self.config = config
        # The devices' count is checked before anything loads, the model's heads against the mesh before it compiles.
        self.mesh = service_mesh(parse_service_mesh(config.mesh, "--mesh"), "--mesh")
        self.data_ways = 1 if self.mesh is None else self.mesh.shape["data"]
        self.served = ServedWeights(config, self.mesh)  # the routes push weights through it
        self.max_context = config.max_context or self.weights.config.max_position_embeddings
        self.budget = BatchBudget.of(config, self.weights.config, self.mesh)
        cache_bytes = self.batch_budget // 4 if config.prefix_cache_bytes < 0 else config.prefix_cache_bytes
        self.prefix_cache = PrefixCache(self.weights.config, cache_bytes, DTYPES[config.dtype],
                                        self.mesh) if cache_bytes else None
        self._lanes = (_Lane("sampler"),) + ((_Lane("sampler-short"),) if config.short_request_tokens else ())
        self._jobs: dict[concurrent.futures.Future, _Job] = {}  # requests not answered yet (see `abandon`)
        self._budget_lock = threading.Lock()
        # Guards the compiled programs: a lane marks itself busy (about to sample) under it, and the idle drop of
        # every program happens under it once no lane is busy, so no batch runs while its programs are dropped.
        self._programs_lock = threading.Lock()
        self._outside_users = 0  # callers outside the lanes running compiled programs now (`programs_in_use`)
        # A row's decoding speed: new tokens a second of the fastest batch that compiled nothing (0: none yet).
        self.fastest_row_rate = 0.0
        self.queued_tokens = 0  # row_cost of every row submitted and not yet finished or dropped
        self.tokens_per_second = 0.0  # a running estimate of row_cost served per second (for Retry-After)
        self.batches_run = 0
        self.rows_dropped = 0  # rows of requests whose client went away, dropped before they were sampled
        self.rows_cut = 0  # rows whose client went away while they were sampled, finished at the next check
        self.batches_stopped = 0  # batches that ended early because no client of theirs was left
        self.phase_checks = 0  # times a running batch asked whether its clients are still there
        self.phases_run = 0  # decode phases run by every batch so far
        self.rows_joined = 0  # rows that joined a running batch (--continuous-admission)
        self.programs_dropped = 0  # compiled sampler programs dropped while idle (max_kept_programs)
        for lane in self._lanes:
            lane.worker = threading.Thread(target=self._run, args=(lane,), name=lane.name, daemon=True)
            lane.worker.start()

    @property
    def weights(self) -> Weights:
        """What a batch starting now samples with: the served weights, swapped whole by each push."""
        return self.served.current

    @property
    def batch_budget(self) -> int:
        """The memory one batch may take on a device beside the weights (`budget`)."""
        return self.budget.limit

    def batch_bytes(self, rows: int, longest_prompt: int, most_new_tokens: int, record: bool = False) -> int:
        """A batch's memory on one device beside the weights (`BatchBudget.batch_bytes`)."""
        return self.budget.batch_bytes(rows, longest_prompt, most_new_tokens, record)

    @property
    def alive(self) -> bool:
        """Whether every worker thread is still serving."""
        return all(lane.worker is not None and lane.worker.is_alive() for lane in self._lanes)

    def _lane_of(self, rows: Sequence[RowRequest]) -> _Lane:
        """The short lane for a request that fits one batch and asks for few tokens, else the main one."""
        short = self.config.short_request_tokens
        if len(self._lanes) > 1 and len(rows) <= self.config.max_batch_size and all(
                r.params.max_new_tokens <= short for r in rows):
            return self._lanes[1]
        return self._lanes[0]

    def row_rate(self) -> float:
        """New tokens a second one row decodes at: --admission-tokens-per-second, else the fastest seen (0: unknown)."""
        return self.config.admission_tokens_per_second or self.fastest_row_rate

    def batch_seconds(self, new_tokens: int) -> float | None:
        """About how long a batch whose rows ask for up to `new_tokens` new tokens runs: what a request holds
        the workers for at a time (its rows take turns with other requests' a batch at a time: `_take_rows`);
        None while the decoding speed is unknown."""
        rate = self.row_rate()
        return new_tokens / rate if rate else None

    def submit(self, rows: Sequence[RowRequest]) -> concurrent.futures.Future:
        """Queues rows; the future resolves to their RowResults in order. QueueFull when the queue is full.

        Cancelling the future drops the rows not yet sampled at the next batch boundary.
        """
        cost = sum(row_cost(r) for r in rows)
        with self._budget_lock:
            if self.queued_tokens and self.queued_tokens + cost > self.config.max_queued_tokens:
                rate = self.tokens_per_second or 1000.0
                raise QueueFull(min(60, max(1, math.ceil(self.queued_tokens / rate))))
            self.queued_tokens += cost
        future: concurrent.futures.Future = concurrent.futures.Future()
        job = _Job(list(rows), future, [None] * len(rows), len(rows))
        self._jobs[future] = job
        future.add_done_callback(lambda done: self._jobs.pop(done, None))
        self._lane_of(rows).queue.put(job)
        return future

    def abandon(self, future: concurrent.futures.Future) -> list[RowResult | None]:
        """Cancels a request (its rows not yet sampled are dropped at the next batch boundary) and returns the
        results of its rows that were sampled already (None for the others)."""
        job = self._jobs.get(future)  # before cancelling: the future's done-callback forgets it
        future.cancel()
        return list(job.results) if job is not None else []

    def flush_cache(self) -> bool:
        """Empties the prefix cache, as SGLang's /flush_cache: refused (False) while any request is queued or
        running, whose batches may be reading or writing it."""
        with self._programs_lock:
            if self._jobs or any(lane.busy or lane.pending for lane in self._lanes):
                return False
            if self.prefix_cache is not None:
                self.prefix_cache.flush()
            return True

    def prefix_stats(self) -> dict[str, int]:
        """The prefix cache's counters (zeros, budget 0, when it is off)."""
        if self.prefix_cache is None:
            return {"hit_tokens": 0, "miss_tokens": 0, "evicted_blocks": 0, "cached_blocks": 0, "budget_bytes": 0,
                    "pool_bytes": 0}
        return self.prefix_cache.stats()

    def _release(self, rows: Sequence[RowRequest]) -> None:
        with self._budget_lock:
            self.queued_tokens -= sum(row_cost(r) for r in rows)

    def close(self) -> None:
        """Stops the workers after the batches they are running."""
        for lane in self._lanes:
            lane.queue.put(None)
        for lane in self._lanes:
            if lane.worker is not None:
                lane.worker.join(timeout=60)

    def _drop_cancelled(self, lane: _Lane) -> None:
        """Forgets the rows of requests whose client went away (their handler cancelled the future)."""
        dropped = [(job, i) for job, i in lane.pending if job.future.cancelled()]
        if dropped:
            lane.pending = deque((job, i) for job, i in lane.pending if not job.future.cancelled())
            self._release([job.rows[i] for job, i in dropped])
            with self._budget_lock:
                self.rows_dropped += len(dropped)

    def _take_rows(self, lane: _Lane) -> list[tuple[_Job, int]] | None:
        """Blocks for work, then gathers up to max_batch_size rows of live requests, as many as fit the memory
        budget (None = shut down)."""
        while True:
            while not lane.pending:
                if lane.busy and lane.queue.empty():  # about to wait for work, after some
                    self._when_idle(lane)
                job = lane.queue.get()
                if job is None:
                    return None
                lane.pending.extend((job, i) for i in range(len(job.rows)))
            deadline = time.monotonic() + self.config.batch_wait_ms / 1000
            while len(lane.pending) < self.config.max_batch_size:
                try:
                    job = lane.queue.get(timeout=max(deadline - time.monotonic(), 0))
                except queue.Empty:
                    break
                if job is None:
                    lane.queue.put(None)  # finish this batch, then stop
                    break
                lane.pending.extend((job, i) for i in range(len(job.rows)))
            _gather_queued(lane)  # behind a request of many batches too: every request waiting takes its turn
            self._drop_cancelled(lane)  # the batch boundary: rows of clients gone are never sampled
            if lane.pending:
                break
        with self._programs_lock:  # waits out a drop another lane started
            lane.busy = True
        # The least served request first (stable: arrival order among equals), so a request of many batches takes
        # turns with the ones that came after it instead of holding them for all its batches.
        lane.pending = deque(sorted(lane.pending, key=lambda item: item[0].taken))
        fit = self.budget.rows_that_fit(job.rows[i] for job, i in lane.pending)
        taken = [lane.pending.popleft() for _ in range(fit)]
        for job, _ in taken:
            job.taken += 1
        return taken

    def _run(self, lane: _Lane) -> None:
        """Worker loop: batch, sample, hand results back; a failing row fails only its own request."""
        while (taken := self._take_rows(lane)) is not None:
            weights = self.weights  # one read: the version the batch starts on (its only one: see run_batch)
            start, programs = time.perf_counter(), compiled_programs()
            sampled = self._sample(weights, taken, lane)
            if compiled_programs() == programs:  # a batch that compiled says nothing about decoding speed
                self._note_row_rate(sampled, time.perf_counter() - start)
            for part, outcome in sampled:
                for (job, i), result in zip(part, outcome if isinstance(outcome, list) else [None] * len(part)):
                    if isinstance(outcome, Exception):
                        _resolve(job.future, error=outcome)
                        continue
                    _deliver(job, i, result)
            # Rows of clients gone may have been cut short: their budget was not served, so it does not count.
            cost = sum(row_cost(job.rows[i]) for job, i in taken if not job.future.cancelled())
            self._release([job.rows[i] for job, i in taken])
            if cost:
                rate = cost / max(time.perf_counter() - start, 1e-6)
                with self._budget_lock:
                    self.tokens_per_second = rate if not self.tokens_per_second else (
                        0.8 * self.tokens_per_second + 0.2 * rate)

    def _note_row_rate(self, sampled: list[tuple[list[tuple[_Job, int]], list[RowResult] | Exception]],
                       seconds: float) -> None:
        """Keeps the fastest decoding speed seen: the longest row's tokens over the batch's time (its prefill
        included), so the admission check (`batch_seconds`) refuses only what could not be done even at that speed."""
        longest = max((len(r.output_ids) for _, outcome in sampled if isinstance(outcome, list) for r in outcome),
                      default=0)
        if longest:
            with self._budget_lock:
                self.fastest_row_rate = max(self.fastest_row_rate, longest / max(seconds, 1e-6))

    @contextlib.contextmanager
    def programs_in_use(self) -> Iterator[None]:
        """Marks a caller outside the lanes (log-prob scoring) busy while it runs compiled programs, as a lane
        marks itself before a batch: the idle drop of every program waits for it, and runs after it when the
        lanes are idle."""
        with self._programs_lock:  # waits out a drop a lane started
            self._outside_users += 1
        try:
            yield
        finally:
            with self._programs_lock:
                self._outside_users -= 1
            self._when_idle(None)

    def _when_idle(self, lane: _Lane | None) -> None:
        """`lane` (None: a caller of `programs_in_use`) ran out of work: when no lane has any, the service sheds
        what a burst left behind. Each new batch shape compiles programs the service keeps, each holding host memory
        and memory mappings: beyond max_kept_programs sampler programs, or past half the process's mapping limit
        (where a compile would segfault), every compiled program is dropped. A batch's host buffers are freed into
        glibc's arenas, which keep them: they go back to the OS."""
        with self._programs_lock:  # held through the drop: no lane starts a batch until it is done
            if lane is not None:
                lane.busy = False
            if self._outside_users or any(other.busy for other in self._lanes):
                return
            cap = self.config.max_kept_programs
            if (cap and compiled_programs() > cap) or mapped_fraction() > 0.5:
                # every compiled program: the sampler's, the scorer's and the small ones beside them
                dropped = drop_compiled_programs()
                with self._budget_lock:
                    self.programs_dropped += dropped
        return_freed_memory()

    def _sample(self, weights: Weights, taken: list[tuple[_Job, int]], lane: _Lane
                ) -> list[tuple[list[tuple[_Job, int]], list[RowResult] | Exception]]:
        """(rows, results or the error) for the batch; when it fails, each request's rows again on their own.
        With --continuous-admission, rows that join the batch are appended to `taken`."""
        # Only with the flag: the sampler's hooks for joining rows (and run_batch's keywords for them).
        joining: dict[str, Any] = {"lane": lane, "taken": taken} if self.config.continuous_admission else {}
        try:
            return [(taken, self.run_batch(weights, [job.rows[i] for job, i in taken], unwanted=_clients_gone(taken),
                                           **joining))]
        except Exception as error:  # reported to the failing requests (and logged); the service goes on
            log.exception("batch failed")
            jobs = list(dict.fromkeys(job for job, _ in taken))
            if len(jobs) == 1:
                return [(taken, error)]
        out: list[tuple[list[tuple[_Job, int]], list[RowResult] | Exception]] = []
        for job in jobs:  # one bad request must not fail its batch-mates
            part = [(j, i) for j, i in taken if j is job]
            try:
                out.append((part, self.run_batch(weights, [job.rows[i] for _, i in part],
                                                 unwanted=_clients_gone(part))))
            except Exception as error:  # noqa: BLE001
                out.append((part, error))
        return out

    def run_batch(self, weights: Weights, rows: list[RowRequest], unwanted: Callable[[], list[bool]] | None = None,
                  *, lane: _Lane | None = None, taken: list[tuple[_Job, int]] | None = None) -> list[RowResult]:
        """Samples one batch of rows on `weights`, padded to bucketed static shapes (that divide over --mesh's data).

        `unwanted` (asked every --cancel-check-steps decode steps) names the rows whose clients are gone: they
        finish there (`aborted`), and the batch ends there when none is left.
        `lane` and `taken` (--continuous-admission; `taken`: the requests' rows `rows` are): rows queued on `lane`
        join the batch at its boundaries (appended to `taken` and `rows`, answered like them), and every row is
        answered at the boundary after it finishes.
        """
        prompts = distinct_prompts(rows)
        num_prompts = mesh_rows(len(prompts), self.data_ways)
        record = any(r.return_routed_experts for r in rows)
        # A batch that records routed experts reads and keeps no cached prefix: the cache keeps no experts.
        prefix = None if self.prefix_cache is None or record else self.prefix_cache.take(weights, prompts,
                                                                                        num_prompts)
        batch = make_batch(
            rows, weights.config.eos_token_ids, batch_size=mesh_rows(len(rows), self.data_ways),
            prompt_len=bucket(max(len(r.prompt_ids) for r in rows)) if prefix is None else prefix.prompt_len,
            num_prompts=num_prompts, cached=None if prefix is None else prefix.cached)
        gone = [False] * len(rows)  # the last answer the sampler acted on
        started = len(rows)  # rows may join: `rows` grows
        joining = None if lane is None or taken is None or record else Joining.start(taken, rows,
                                                                                     len(batch.rows.live_B))

        def ask() -> list[bool]:
            if unwanted is not None:
                gone[:] = unwanted()
            with self._budget_lock:
                self.phase_checks += 1
            return gone if joining is None else joining.by_id(gone)

        seen = [weights]  # every version this batch sampled with, by the sampler's index

        def weights_now() -> tuple[Any, int]:
            served = self.weights  # one read: swapped whole by the updates (their checks made it fit the batch's)
            if served is not seen[-1] and served.graphdef is weights.graphdef:
                seen.append(served)
            return seen[-1].state, len(seen) - 1

        out = generate(weights.graphdef, weights.state, batch,
                       max_new_tokens=bucket(max(r.params.max_new_tokens for r in rows)),
                       cache_dtype=DTYPES[self.config.dtype], unwanted=ask,
                       check_every=self.config.cancel_check_steps, mesh=self.mesh, record_experts=record,
                       weights_now=weights_now if self.config.inflight_updates else None,
                       prefix=None if prefix is None else prefix.cache, keep_prompts=self._keeper(prefix, batch),
                       **self._joining_hooks(lane, joining, weights, seen, gone, batch))
        tokens, logprobs, lengths, stopped = jax.device_get(
            (out.tokens_BT, out.logprobs_BT, out.lengths_B, out.stopped_B))
        if joining is not None:  # the sampler's outputs by id, in `rows` order
            ids = [joining.row_of_id.index(b) for b in range(len(rows))]
            tokens, logprobs, lengths, stopped = (x[ids] for x in (tokens, logprobs, lengths, stopped))
        names = [w.version for w in seen]
        versions_BT = None if out.versions_BT is None else jax.device_get(out.versions_BT)
        if versions_BT is not None and joining is not None:
            versions_BT = versions_BT[ids]
        versions = None if versions_BT is None else [
            [names[v] for v in row[:lengths[b]]] for b, row in enumerate(versions_BT)]
        routed: list[np.ndarray | None] = [None] * len(rows)
        if record:
            prompt_experts, experts = jax.device_get((out.prompt_experts_PULk, out.experts_BTLk))
            for b, row in enumerate(rows):
                if row.return_routed_experts:  # the prompt's (left-padded) then the output's, but its last
                    read = np.concatenate([prompt_experts[batch.rows.prompt_index_B[b], -len(row.prompt_ids):],
                                           experts[b, :max(int(lengths[b]) - 1, 0)]])
                    routed[b] = read[:len(row.prompt_ids) + int(lengths[b]) - 1]
        # Python bools (not numpy's): the counters below are served as JSON by /get_model_info.
        cut = [bool(gone[b] and not stopped[b] and lengths[b] < rows[b].params.max_new_tokens)
               for b in range(len(rows))]
        with self._budget_lock:
            self.batches_run += 1
            self.phases_run += len(out.phases)
            self.rows_cut += sum(cut)
            self.batches_stopped += all(gone) and any(cut)
        cached = [0] * started if prefix is None else [prefix.cached[i] for i in batch.rows.prompt_index_B[:started]]
        cached += [0] * (len(rows) - started)  # rows that joined prefilled their prompts whole
        first = {} if joining is None else joining.first_version
        return [RowResult(tokens[b, :lengths[b]].tolist(), logprobs[b, :lengths[b]].tolist(), bool(stopped[b]),
                          first.get(b, weights.version), aborted=cut[b], routed_experts=routed[b],
                          token_versions=None if versions is None else versions[b], cached_tokens=cached[b])
                for b in range(len(rows))]

    def _joining_hooks(self, lane: _Lane | None, joining: Joining | None, weights: Weights, seen: list[Weights],
                       gone: list[bool], batch: Any) -> dict[str, Any]:
        """`generate`'s `admit_rows` and `finished` for a batch that rows may join (none: {})."""
        if lane is None or joining is None:
            return {}
        # The batch's widths, as run_batch bucketed them (a cached prefix's slots included), before any row joins.
        prompt_slots = bucket(max(len(r.prompt_ids) for r in joining.rows))
        new_tokens = bucket(max(r.params.max_new_tokens for r in joining.rows))
        def admit_rows(free: int, step: int, device_rows: int) -> Any:
            if self.weights is not seen[-1]:  # newer weights are served: new rows wait for a batch on them
                return None
            _gather_queued(lane)
            self._drop_cancelled(lane)
            picked = joinable(lane.pending, free, prompt_slots, new_tokens)
            # The cache grows for the joining rows' budgets from this step, and the rows may grow by them: the batch
            # must still fit the budget (as if every joining row needed a new row).
            rows = min(mesh_rows(self.config.max_batch_size, self.data_ways),
                       mesh_rows(device_rows + len(picked), self.data_ways))
            if not picked or self.budget.batch_bytes(rows, prompt_slots, step + new_tokens) > self.budget.limit:
                return None
            for item in picked:
                lane.pending.remove(item)
            for job, _ in picked:
                job.taken += 1
            with self._budget_lock:
                self.rows_joined += len(picked)
            joining.join(picked, seen[-1].version)
            gone.extend([False] * len(picked))
            joined = [job.rows[i] for job, i in picked]
            return make_batch(joined, weights.config.eos_token_ids, batch_size=mesh_rows(len(joined), self.data_ways),
                              prompt_len=prompt_slots,
                              num_prompts=mesh_rows(len(distinct_prompts(joined)), self.data_ways))

        def finished(ids: np.ndarray, out: Any) -> None:
            tokens, logprobs, lengths, stopped = jax.device_get(
                (out.tokens_BT, out.logprobs_BT, out.lengths_B, out.stopped_B))
            versions = None if out.versions_BT is None else jax.device_get(out.versions_BT)
            names = [w.version for w in seen]
            for k, row_id in enumerate(ids):
                b = joining.row_of_id[int(row_id)]
                if b is None:
                    continue
                row, n = joining.rows[b], int(lengths[k])
                cut = bool(gone[b] and not stopped[k] and n < row.params.max_new_tokens)
                job, i = joining.taken[b]
                _deliver(job, i, RowResult(
                    tokens[k, :n].tolist(), logprobs[k, :n].tolist(), bool(stopped[k]),
                    joining.first_version.get(b, weights.version), aborted=cut,
                    token_versions=None if versions is None else [names[v] for v in versions[k, :n]]))

        return {"admit_rows": admit_rows, "finished": finished,
                "max_rows": mesh_rows(self.config.max_batch_size, self.data_ways)}

    def _keeper(self, prefix: Prefix | None, batch: Any) -> Callable[[Any], None] | None:
        """The sampler's `keep_prompts` hook: the prefix cache copies the batch's prompt blocks after its prefill."""
        if prefix is None or self.prefix_cache is None:
            return None
        cache = self.prefix_cache
        first_row = {int(p): b for b, p in reversed(list(enumerate(batch.rows.prompt_index_B)))}
        row_of_prompt = [first_row[p] for p in range(len(prefix.prompts))]
        return lambda rows_cache: cache.keep(prefix, rows_cache, row_of_prompt)


def _deliver(job: _Job, i: int, result: RowResult | None) -> None:
    """Row i's result to its request (once: a row answered at a boundary is not answered again at the batch's end);
    the request is answered when its last row is."""
    if job.results[i] is not None:
        return
    job.results[i] = result
    job.remaining -= 1
    if job.remaining == 0:
        _resolve(job.future, result=job.results)


def _gather_queued(lane: _Lane) -> None:
    """Moves the rows of every request already queued to the lane's pending rows, without waiting."""
    while True:
        try:
            job = lane.queue.get_nowait()
        except queue.Empty:
            return
        if job is None:
            lane.queue.put(None)  # finish this batch, then stop
            return
        lane.pending.extend((job, i) for i in range(len(job.rows)))


def _clients_gone(taken: list[tuple[_Job, int]]) -> Callable[[], list[bool]]:
    """For each row of a batch, whether its request's client is gone (disconnected or past its deadline: the
    handler cancelled the future), asked by the sampler every --cancel-check-steps decode steps."""
    return lambda: [job.future.cancelled() for job, _ in taken]
