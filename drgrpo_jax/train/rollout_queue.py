"""K-step-off rollouts (rollout.async=true, K = rollout.max_staleness): a bounded queue of whole sampling rounds
between sampling and the update. A background thread samples and scores each step's first round (the HTTP call
and the scoring; the hosts' collectives stay on the main thread) while earlier steps update:

    take R_s (queued since step s-K) -> [its extra rounds, by version s] -> launch R_{s+K} (the service holds
    version s = the policy after s updates) -> update (version s+1) -> push version s+1 -> checkpoint

Round R_t is sampled by version max(0, t - K) (`sampler_version`), a function of the step alone, so which version
samples which round never depends on timing: a run is reproducible, and a resumed one re-draws the rounds in flight
at its checkpoint (`rounds_in_flight`) from their saved data positions with the saved params of their versions
(`collect.prime`) and equals the uninterrupted one. The thread runs its work in submission order, one job at a
time, so a round is sampled by one version alone. The push of version s+1 waits only for the rounds version s
samples (`push_waits_for`): with K = 1 (and on several hosts, or with a frozen LoRA base) the update loop waits for
them and pushes; with K > 1 on one host it queues the push on the thread behind them, from a copy of the params,
and goes on to the next step, whose round is ready (a deferred push). A round is trained only while its staleness
is at most K (`admits`, enforced by `check_fresh`), and whole: a group is never split across updates. The lag is
corrected by the capped or masked importance weight (algorithm.tis_cap, mis_high).

With rollout.inflight_updates the service takes each push at its next decode phase or pause, so the update loop
pushes version s+1 right after the update, while the thread's round samples: a round's tokens then carry the
versions that sampled them (its staleness is its oldest token's), which depends on timing. A resumed run can no
longer re-draw such a round, so a checkpoint waits for the queued rounds and holds their scored rows
(`held_contents`), and the resumed run queues them back as done rounds (`held_rounds`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from drgrpo_jax.algorithms import ALGORITHMS
from drgrpo_jax.config.derived import reward_weights
from drgrpo_jax.errors import ConfigError, StaleWeightsError
from drgrpo_jax.rollout.record import HostCounters, ScoredRollout
from drgrpo_jax.train.collect import Round, RoundSource, sample_share, taken_together

if TYPE_CHECKING:
    from drgrpo_jax.config.schema import Config
    from drgrpo_jax.step.train_step import TrainState

__all__ = ["Collected", "HeldRound", "InFlight", "PendingRound", "Prefetcher", "QueueRecord", "RolloutQueue", "admits",
           "busy_seconds", "check_fresh", "check_queue", "held_contents", "held_rounds", "in_flight",
           "push_waits_for", "queue_length", "resumed_stream_position", "rounds_in_flight", "sampled_ahead",
           "sampler_version", "saved_params", "snapshot"]


# ---------------------------------------------------------------------------------------------
# The schedule: pure functions of the step (the property tests drive them under random delays)
# ---------------------------------------------------------------------------------------------


def sampler_version(round_step: int, max_staleness: int) -> int:
    """The weight version that samples step `round_step`'s first round: K versions before it (version 0 samples
    the first K + 1 rounds)."""
    return max(0, round_step - max_staleness)


def rounds_in_flight(steps_done: int, max_staleness: int, steps: int) -> range:
    """The steps whose first rounds are queued after `steps_done` steps: launched, not yet trained on (what a
    checkpoint taken then must re-create)."""
    return range(steps_done, min(steps_done + max_staleness, steps))


def sampled_ahead(steps_done: int, max_staleness: int) -> range:
    """The K steps after `steps_done` whose first rounds a checkpoint taken then holds (rounds_in_flight, uncapped:
    a run resumed with more train.steps samples them)."""
    return range(steps_done, steps_done + max_staleness)


def admits(round_version: int, step: int, max_staleness: int) -> bool:
    """Whether step `step` (0-based: the policy is version `step`) may train on a round sampled by `round_version`."""
    return 0 <= step - round_version <= max_staleness


def push_waits_for(queued_versions: Sequence[int], service_version: int) -> list[int]:
    """The queued rounds (their indices) the push of version service_version + 1 must wait for: those the service's
    version samples (a round is sampled by one version, never by two)."""
    return [i for i, version in enumerate(queued_versions) if version == service_version]


def busy_seconds(intervals: Sequence[tuple[float, float]], start: float, stop: float) -> float:
    """Seconds of [start, stop] covered by the (non-overlapping) busy intervals."""
    return float(sum(max(0.0, min(b, stop) - max(a, start)) for a, b in intervals))


def check_fresh(versions: Sequence[int] | np.ndarray, step: int, max_staleness: int) -> int:
    """The rollout's staleness at step `step` (0-based: the policy is version `step`); StaleWeightsError when a
    completion is more than max_staleness versions old or from a version the trainer has not pushed yet."""
    oldest, newest = int(np.min(versions)), int(np.max(versions))
    if not (admits(oldest, step, max_staleness) and admits(newest, step, max_staleness)):
        raise StaleWeightsError(f"weight_version: step {step + 1} trains on versions {oldest}..{newest}; "
                                f"rollout.max_staleness = {max_staleness} allows {step - max_staleness}..{step}")
    return step - oldest


# ---------------------------------------------------------------------------------------------
# What a checkpoint holds of the queue
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HeldRound:
    """A queued round as a checkpoint holds it (rollout.inflight_updates): this process's scored rows by name
    (`ScoredRollout.row_arrays`) and its counters; its prompts are re-read from its data position."""

    rows: dict[str, np.ndarray]
    counters: HostCounters


@dataclasses.dataclass(frozen=True)
class QueueRecord:
    """What a checkpoint's host JSON says of the step, the data position and the queue (the keys are 0.2's, so its
    checkpoints resume): `host()` writes it, `from_host` reads it back."""

    step: int  # steps done
    data_position: int  # the prompt stream's position to resume from (rollout.async: the first queued round's)
    rollout_queue: int | None = None  # rounds the queue holds (`queue_length`); None: saved before 0.2 recorded it
    round_positions: tuple[int, ...] | None = None  # the queued rounds' data positions (None: data_position alone)
    stream_position: int | None = None  # the stream's position after every launched round (None: data_position)
    inflight_updates: bool = False  # the checkpoint holds the queued rounds' rows (`rounds`), not their params
    round_functions: tuple[tuple[str, ...], ...] = ()  # inflight_updates: each held round's reward functions
    round_errors: tuple[tuple[str, ...], ...] = ()  # ... and its reward errors
    optimizer_state: bool = True  # the checkpoint holds the optimizer's state (train.checkpoint_optimizer)

    def host(self) -> dict[str, Any]:
        """The host JSON: the step's weight version beside the fields set."""
        out: dict[str, Any] = {"step": self.step, "data_position": self.data_position, "weight_version": self.step,
                               "rollout_queue": self.rollout_queue, "optimizer_state": self.optimizer_state}
        if self.round_positions is not None:
            out.update(round_positions=list(self.round_positions), stream_position=self.stream_position)
        if self.inflight_updates:
            out.update(inflight_updates=True, round_functions=[list(f) for f in self.round_functions],
                       round_errors=[list(e) for e in self.round_errors])
        return out

    @classmethod
    def from_host(cls, host: dict[str, Any]) -> QueueRecord:
        positions = host.get("round_positions")
        saved = host.get("rollout_queue")
        return cls(int(host["step"]), int(host["data_position"]), None if saved is None else int(saved),
                   None if positions is None else tuple(int(p) for p in positions),
                   None if host.get("stream_position") is None else int(host["stream_position"]),
                   bool(host.get("inflight_updates", False)),
                   tuple(tuple(f) for f in host.get("round_functions", ())),
                   tuple(tuple(e) for e in host.get("round_errors", ())), bool(host.get("optimizer_state", True)))

    @property
    def positions(self) -> tuple[int, ...]:
        """The queued rounds' data positions (a one-step-off checkpoint of 0.1 holds its round's as data_position)."""
        return self.round_positions if self.round_positions is not None else (self.data_position,)

    @property
    def stream_resumes_at(self) -> int:
        return self.stream_position if self.stream_position is not None else self.data_position


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A checkpoint's queue: the data positions of the K rounds after its step (those not launched because the run
    ended: the stream's next positions, so a longer run can continue it) and the params of the versions that sample
    them, re-drawn on resume. With rollout.inflight_updates, the positions of the rounds launched and their scored
    rows (`held`) instead, queued back as they are."""

    positions: tuple[int, ...]
    params: tuple[Any, ...]
    stream_position: int  # the prompt stream's position at the save (after every launched round's prompts)
    held: tuple[HeldRound, ...] = ()


def saved_params(params: Sequence[Any], max_staleness: int) -> Any:
    """The queue's params as checkpointed: one-step-off saves one tree (0.2's format), K > 1 a tuple."""
    return params[0] if max_staleness == 1 else tuple(params)


def queue_length(async_: bool, max_staleness: int) -> int:
    """How many rounds a checkpoint's queue holds (its host JSON's `rollout_queue`): K with rollout.async, else 0."""
    return max_staleness if async_ else 0


def check_queue(record: QueueRecord, async_: bool, max_staleness: int, inflight: bool = False) -> None:
    """ConfigError when the checkpoint to resume from holds another queue than this run's rollout.async,
    max_staleness and inflight_updates make (its saved params would not fit, its rounds could not be re-drawn, or
    it holds rounds this run would re-draw). Checkpoints from before `rollout_queue` was saved are not checked."""
    saved = record.rollout_queue
    if saved is None:
        return
    if saved != queue_length(async_, max_staleness):
        was = f"rollout.async=true with max_staleness={saved}" if saved else "rollout.async=false"
        now = f"rollout.async=true with max_staleness={max_staleness}" if async_ else "rollout.async=false"
        raise ConfigError("rollout.max_staleness" if async_ and saved else "rollout.async",
                          f"the checkpoint at step {record.step} was saved with {was}, this run has {now}; "
                          "resume with the saved settings (its queue of rounds in flight is part of the checkpoint)")
    held = record.inflight_updates
    if async_ and held != inflight:
        how = "holds its queued rounds' rows" if held else "re-draws its queued rounds from their seeds"
        raise ConfigError("rollout.inflight_updates",
                          f"the checkpoint at step {record.step} was saved with rollout.inflight_updates="
                          f"{str(held).lower()}, this run has {str(inflight).lower()}; resume with the saved setting "
                          f"(the checkpoint {how})")


def held_contents(queue: Sequence[PendingRound]) -> tuple[dict[str, Any], dict[str, Any]]:
    """rollout.inflight_updates: the queued rounds as a checkpoint holds them, once each is done (a round's error is
    raised here): (the numpy tree saved as the checkpoint's `rounds`, the record's fields)."""
    done = [pending.future.result() for pending in queue]
    tree: dict[str, Any] = {"count": np.asarray(len(done), np.int64)}
    for i, (share, counters) in enumerate(done):
        tree[f"round{i}"] = {"rows": share.row_arrays(), "counters": counters.arrays()}
    fields = {"inflight_updates": True, "round_positions": tuple(pending.data_position for pending in queue),
              "round_functions": tuple(counters.reward_functions for _, counters in done),
              "round_errors": tuple(counters.error_messages for _, counters in done)}
    return tree, fields


def held_rounds(record: QueueRecord, tree: dict[str, Any]) -> InFlight:
    """The restored queue of a rollout.inflight_updates checkpoint: its rounds' positions and scored rows."""
    held = []
    for i in range(int(tree["count"])):
        saved = tree[f"round{i}"]["counters"]
        counters = HostCounters(record.round_functions[i], float(saved["seconds"][0]), float(saved["seconds"][1]),
                                saved["timeouts_F"], saved["errors_F"], record.round_errors[i])
        held.append(HeldRound(dict(tree[f"round{i}"]["rows"]), counters))
    return InFlight(record.positions, (), record.stream_resumes_at, tuple(held))


def in_flight(record: QueueRecord, saved: Any, max_staleness: int) -> InFlight:
    """The restored queue: its rounds' data positions and the saved params of the versions that sample them."""
    params = (saved,) if max_staleness == 1 else tuple(saved)
    return InFlight(record.positions, params, record.stream_resumes_at)


def resumed_stream_position(queue: InFlight, redrawn: int) -> int:
    """Where the prompt stream continues once the first `redrawn` queued rounds are re-drawn: after the last prompts
    drawn before the save, or after a re-drawn round the saved run did not launch (a run given more steps)."""
    return max([queue.stream_position] + [p + 1 for p in queue.positions[:redrawn]])


# ---------------------------------------------------------------------------------------------
# The producer thread
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PendingRound:
    """A sampling round on its way: its prompts and this process's (scored share, counters) to come."""

    round: Round
    future: concurrent.futures.Future  # -> this process's (ScoredRollout share, HostCounters)
    version: int = 0  # the weight version that samples it (sampler_version)

    @property
    def data_position(self) -> int:
        return self.round.data_position

    def wait(self) -> None:
        """Blocks until the round is done (its error, if any, is raised where the round is taken, on every host)."""
        concurrent.futures.wait([self.future])

    def share(self) -> tuple[Any, Any] | BaseException:
        """The finished round's share, or its error (raised on every host together by `taken_together`)."""
        error = self.future.exception()
        return error if error is not None else self.future.result()


class Prefetcher:
    """The one background thread that samples pending rounds, in launch order (a context manager); it records when
    it was busy (the producer's idle time is the rest)."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._lock = threading.Lock()
        self._busy: list[tuple[float, float]] = []  # finished rounds' (start, stop), perf_counter seconds
        self._running_since: float | None = None

    def _timed(self, work: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            self._running_since = time.perf_counter()
        try:
            return work(*args)
        finally:
            with self._lock:
                self._busy.append((self._running_since, time.perf_counter()))
                self._running_since = None

    def idle_seconds(self, start: float, stop: float) -> float:
        """Seconds of [start, stop] the thread had no round to sample; forgets the rounds that ended before it."""
        with self._lock:
            self._busy = [(a, b) for a, b in self._busy if b > start]
            intervals = self._busy + ([(self._running_since, stop)] if self._running_since is not None else [])
        return max(0.0, stop - start - busy_seconds(intervals, start, stop))

    def submit(self, work: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Queues `work(*args)` behind the work submitted so far (a round, a deferred weight push)."""
        return self._pool.submit(self._timed, work, *args)

    def close(self) -> None:
        """Waits for a round in flight (the run is ending on an error): the service must not be stopped under it,
        or the client would take it for dead and restart it."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def snapshot(params: Any) -> Any:
    """A copy of the params on their devices (the update donates the originals): a queued round's sampler, saved
    with a checkpoint taken while the round is in flight."""
    return jax.tree.map(jnp.copy, params)


# ---------------------------------------------------------------------------------------------
# The queue
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Collected:
    """A step's rollout as the queue hands it over: P scored groups, which carry a learning signal, every round's
    counters, the sampling metrics and how long the step waited for its first round."""

    rollout: ScoredRollout
    signal_P: np.ndarray  # bool [P]
    counters: HostCounters
    metrics: dict[str, Any]
    wait_seconds: float


class RolloutQueue:
    """The rounds each step trains on and the weight pushes between them, for every K (a context manager).

    K = 0 (rollout.async off): a step samples its rounds when it takes them and pushes after its update. K >= 1:
    the step's first round was launched K steps ahead on one background thread (the schedule above), and dynamic
    sampling's extra rounds queue on that thread too, behind the push of the step's version, so no two rounds ever
    sample at once. `checkpoint` writes what a checkpoint holds of it; `prime` rebuilds it on resume.
    """

    def __init__(self, config: Config, source: RoundSource, publish: Callable[..., None], *, frozen_base: bool,
                 checkpoint_due: Callable[[int], bool], resumed: InFlight | None = None):
        r = config.rollout
        self._resumed = resumed  # a checkpoint's queue, rebuilt by `prime`
        self._config, self._source, self._publish, self._due = config, source, publish, checkpoint_due
        self.k = r.max_staleness if r.async_ else 0
        self._inflight = r.inflight_updates  # a push reaches the rounds sampling, so it waits for none
        # K > 1 on one process without a frozen LoRA base (the update donates it): the pushes queue on the thread.
        # With K = 1 the next step needs the pushed version's round at once; on several processes a push is a
        # collective of every host, kept on the update loop.
        self._deferred = self.k > 1 and jax.process_count() == 1 and not frozen_base and not self._inflight
        self._thread = Prefetcher() if self.k else None
        self._queue: collections.deque[PendingRound] = collections.deque()
        self._params_of: dict[int, Any] = {}  # version -> a copy of its params while a checkpoint may save them
        self._pushes: list[concurrent.futures.Future] = []  # deferred, not yet checked

    # -- the step's side --------------------------------------------------------------------------

    def take(self, step: int) -> Collected:
        """Step `step`'s rollout: its first round (queued, or sampled now) and, with rollout.dynamic_sampling, up to
        rollout.max_resample_rounds more of P prompts until P groups carry a learning signal (the algorithm's test,
        `Algorithm.group_signal`); a batch still short is filled with dropped groups marked as padding (group_valid
        False: no loss, no statistics), so the step keeps its static shapes. Every process takes the same
        decisions from the shared rewards."""
        c, r = self._config, self._config.rollout
        started = time.perf_counter()
        pending = self._queue.popleft() if self._queue else None  # launched K steps ahead
        if pending is not None:
            pending.wait()
        wait_seconds = time.perf_counter() - started
        self._check_pushes()
        rounds: list[ScoredRollout] = []
        counters: list[HostCounters] = []
        signals: list[np.ndarray] = []
        while True:
            if pending is None:  # sampled now, by the version the service holds (this step's)
                pending = self._launch(self._source.next(step, len(rounds)), version=step)
            pending.wait()
            rollout, counted = taken_together(pending.round, pending.share(), c.run.log_every)
            pending = None
            rounds.append(rollout)
            counters.append(counted)
            signals.append(rollout.signal_P(ALGORITHMS[c.algorithm.name], reward_weights(c)))
            with_signal = int(sum(s.sum() for s in signals))
            if not r.dynamic_sampling or with_signal >= r.prompts_per_step or len(rounds) > r.max_resample_rounds:
                break
        signal = np.concatenate(signals)
        total = sum(counters[1:], counters[0])
        metrics: dict[str, Any] = {"zero_signal_fraction": float(1.0 - signal.mean())}
        if not r.dynamic_sampling:
            return Collected(rollout, signal, total, metrics, wait_seconds)
        keep = np.flatnonzero(signal)[:r.prompts_per_step].tolist()
        fill = np.flatnonzero(~signal)[:r.prompts_per_step - len(keep)].tolist()
        metrics.update({"sampling_rounds": len(rounds), "groups_drawn": len(signal),
                        "groups_dropped": int((~signal).sum()), "groups_padded": len(fill),
                        "groups_surplus": int(signal.sum()) - len(keep)})
        chosen = ScoredRollout.concat(rounds).take(keep + fill)
        chosen = dataclasses.replace(chosen, group_valid=np.asarray([True] * len(keep) + [False] * len(fill)))
        return Collected(chosen, chosen.group_valid, total, metrics, wait_seconds)  # padding groups: no signal

    def sample_ahead(self, state: TrainState, step: int) -> None:
        """Launches the round K steps ahead (the service holds version `step`) and keeps version `step`'s params
        while a checkpoint may need them: with K = 1 on checkpoint steps only, with K > 1 always (a preemption can
        save any step), the last K versions; with rollout.inflight_updates none (a checkpoint holds the rounds)."""
        if not self.k:
            return
        steps = self._config.train.steps
        keeps = self.k > 1 or self._due(step + 1)
        if not self._inflight and step not in self._params_of and keeps:
            self._params_of[step] = snapshot(state.params)
        for version in [v for v in self._params_of if v < sampler_version(step + 1, self.k)]:
            del self._params_of[version]  # no checkpoint after this step holds a round it samples
        if step + self.k < steps:
            self._queue.append(self._launch(self._source.next(step + self.k)))

    def push(self, state: TrainState, version: int) -> tuple[float, float]:
        """Pushes `version` (the state's params) to every service once the rounds the one before samples are done
        (K = 1), queued behind them (deferred), or at once: (seconds waiting for rounds, seconds pushing)."""
        start = time.perf_counter()
        if self.k and not (self._deferred or self._inflight):  # the service leaves the old version once the rounds
            # it samples are done (in flight: it takes the push between their decode phases)
            for i in push_waits_for([p.version for p in self._queue], version - 1):
                self._queue[i].wait()
        push_start = time.perf_counter()
        if self._deferred:  # queued behind those rounds, from a copy the next update cannot donate
            assert self._thread is not None
            params = self._params_of[version] = snapshot(state.params)
            self._pushes.append(self._thread.submit(self._publish, params, version, None))
        else:
            self._publish(state.params, version, state.frozen)
        return push_start - start, time.perf_counter() - push_start

    def drain(self) -> None:
        """Waits for every deferred push, and so for every round queued before the last (the service then holds the
        newest version), and raises a push's error here."""
        self._check_pushes(wait=True)

    def metrics(self, started: float, now: float, taken: Collected, push_wait: float) -> dict[str, Any]:
        """The queue's part of a step's row: the data position, the services' restarts and (rollout.async) its depth
        and who waited for whom."""
        row: dict[str, Any] = {"data_position": self._source.stream.state(),
               "service_restarts": self._source.actor.client.service_restarts}
        if self._thread is not None:
            row.update(queue_depth=len(self._queue), consumer_idle_seconds=taken.wait_seconds + push_wait,
                       producer_idle_seconds=self._thread.idle_seconds(started, now))
        return row

    def _check_pushes(self, *, wait: bool = False) -> None:
        if wait and self._pushes:
            concurrent.futures.wait(self._pushes)
        for push in [p for p in self._pushes if p.done()]:
            push.result()
            self._pushes.remove(push)

    def _launch(self, round_: Round, version: int | None = None) -> PendingRound:
        """The round's share sampled and scored: on the thread (K >= 1) or now (its error kept for the step)."""
        version = sampler_version(round_.step, self.k) if version is None else version
        actor = self._source.actor
        if self._thread is not None:
            return PendingRound(round_, self._thread.submit(sample_share, actor, self._config, round_), version)
        done: concurrent.futures.Future = concurrent.futures.Future()
        try:
            done.set_result(sample_share(actor, self._config, round_))
        except Exception as error:  # noqa: BLE001 - raised on every host together when the round is taken
            done.set_exception(error)
        return PendingRound(round_, done, version)

    # -- checkpoints ------------------------------------------------------------------------------

    def checkpoint(self, saved: TrainState, steps_done: int) -> tuple[Any, QueueRecord, Any]:
        """(the saved trees, the record, the held rounds or None) after `steps_done` steps, `saved` the state as a
        checkpoint holds it: with rollout.async also the queue's data positions and the params of the versions that
        sample its rounds, or with rollout.inflight_updates the rounds themselves, once done."""
        position = self._source.stream.state()
        record = QueueRecord(steps_done, position, queue_length(bool(self.k), self.k))
        if not self.k:
            return saved, record, None
        if self._inflight:
            rounds, held = held_contents(self._queue)
            return saved, dataclasses.replace(record, stream_position=position, **held), rounds
        positions = [p.data_position for p in self._queue]
        positions += range(position, position + self.k - len(positions))  # not launched (the run ends): the next
        params = [self._params_of[sampler_version(t, self.k)] for t in sampled_ahead(steps_done, self.k)]
        record = dataclasses.replace(record, data_position=positions[0], round_positions=tuple(positions),
                                     stream_position=position)
        return (saved, saved_params(params, self.k)), record, None

    def prime(self, state: TrainState, start_step: int) -> None:
        """Queues the rounds before the first step (`rounds_in_flight`). Fresh, version 0 samples them all; resumed,
        each is re-drawn from its saved data position by its saved version's params, pushed back for it (then the
        current ones), so the queue equals the uninterrupted run's; with rollout.inflight_updates the checkpoint
        holds the rounds themselves, queued back as done (those it had not launched are sampled now)."""
        resumed = self._resumed
        if not self.k:
            return
        steps = rounds_in_flight(start_step, self.k, self._config.train.steps)
        if resumed is None:
            self._queue.extend(self._launch(self._source.next(step)) for step in steps)
            return
        if self._inflight:
            for step, position, held in zip(steps, resumed.positions, resumed.held):
                self._queue.append(self._held(self._source.at(step, position), held))
            self._queue.extend(self._launch(self._source.next(step)) for step in steps[len(resumed.held):])
            return
        self._params_of = {sampler_version(step, self.k): params
                           for step, params in zip(sampled_ahead(start_step, self.k), resumed.params)}
        pushed = start_step
        for step, position in zip(steps, resumed.positions):
            version = sampler_version(step, self.k)
            if version != pushed:  # the round before is done: the service may move to this one's version
                self._publish(self._params_of[version], version, state.frozen, rollback=True)
                pushed = version
            self._queue.append(self._launch(self._source.at(step, position)))
            self._queue[-1].wait()
        if pushed != start_step:
            self._publish(state.params, start_step, state.frozen)

    @staticmethod
    def _held(round_: Round, held: HeldRound) -> PendingRound:
        """A round a checkpoint holds, queued back as done: its rows and counters as saved (one process: the share
        is the whole round)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result((ScoredRollout.from_prompts(round_.examples, round_.prompts, **held.rows), held.counters))
        return PendingRound(round_, done, int(np.min(held.rows["weight_versions"])))

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()

    def __enter__(self) -> RolloutQueue:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
