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

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from drgrpo_jax.errors import ConfigError, StaleWeightsError
from drgrpo_jax.rollout.record import HostCounters

if TYPE_CHECKING:
    from drgrpo_jax.data.examples import Example

__all__ = ["HeldRound", "InFlight", "PendingRound", "Prefetcher", "admits", "busy_seconds", "check_fresh",
           "check_queue", "held_contents", "held_rounds", "in_flight", "push_waits_for", "queue_length",
           "resumed_stream_position", "rounds_in_flight", "sampled_ahead", "sampler_version", "saved_params",
           "snapshot"]


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
class InFlight:
    """A checkpoint's queue: the data positions of the K rounds after its step (those not launched because the run
    ended: the stream's next positions, so a longer run can continue it) and the params of the versions that sample
    them; `collect.prime` re-draws them. With rollout.inflight_updates, the positions of the rounds launched and
    their scored rows (`held`) instead: `collect.prime` queues them back as they are."""

    positions: tuple[int, ...]
    params: tuple[Any, ...]
    stream_position: int  # the prompt stream's position at the save (after every launched round's prompts)
    held: tuple[HeldRound, ...] = ()


def saved_params(params: Sequence[Any], max_staleness: int) -> Any:
    """The queue's params as checkpointed: one-step-off saves one tree (the format it always had), K > 1 a tuple."""
    return params[0] if max_staleness == 1 else tuple(params)


def queue_length(async_: bool, max_staleness: int) -> int:
    """How many rounds a checkpoint's queue holds (its host JSON's `rollout_queue`): K with rollout.async, else 0."""
    return max_staleness if async_ else 0


def check_queue(host: dict[str, Any], async_: bool, max_staleness: int, inflight: bool = False) -> None:
    """ConfigError when the checkpoint to resume from holds another queue than this run's rollout.async,
    max_staleness and inflight_updates make (its saved params would not fit, its rounds could not be re-drawn, or
    it holds rounds this run would re-draw). Checkpoints from before `rollout_queue` was saved are not checked."""
    saved = host.get("rollout_queue")
    if saved is None:
        return
    if int(saved) != queue_length(async_, max_staleness):
        was = f"rollout.async=true with max_staleness={saved}" if saved else "rollout.async=false"
        now = f"rollout.async=true with max_staleness={max_staleness}" if async_ else "rollout.async=false"
        raise ConfigError("rollout.max_staleness" if async_ and saved else "rollout.async",
                          f"the checkpoint at step {host.get('step')} was saved with {was}, this run has {now}; "
                          "resume with the saved settings (its queue of rounds in flight is part of the checkpoint)")
    held = bool(host.get("inflight_updates", False))
    if async_ and held != inflight:
        how = "holds its queued rounds' rows" if held else "re-draws its queued rounds from their seeds"
        raise ConfigError("rollout.inflight_updates",
                          f"the checkpoint at step {host.get('step')} was saved with rollout.inflight_updates="
                          f"{str(held).lower()}, this run has {str(inflight).lower()}; resume with the saved setting "
                          f"(the checkpoint {how})")


def held_contents(queue: Sequence[PendingRound]) -> tuple[dict[str, Any], dict[str, Any]]:
    """rollout.inflight_updates: the queued rounds as a checkpoint holds them, once each is done (a round's error is
    raised here): (the numpy tree saved as the checkpoint's `rounds`, the host JSON's part)."""
    done = [pending.future.result() for pending in queue]
    tree: dict[str, Any] = {"count": np.asarray(len(done), np.int64)}
    for i, (share, counters) in enumerate(done):
        tree[f"round{i}"] = {"rows": share.row_arrays(), "counters": counters.arrays()}
    host = {"inflight_updates": True, "round_positions": [pending.data_position for pending in queue],
            "round_functions": [list(counters.reward_functions) for _, counters in done],
            "round_errors": [list(counters.error_messages) for _, counters in done]}
    return tree, host


def held_rounds(host: dict[str, Any], tree: dict[str, Any]) -> InFlight:
    """The restored queue of a rollout.inflight_updates checkpoint: its rounds' positions and scored rows."""
    held = []
    for i in range(int(tree["count"])):
        saved = tree[f"round{i}"]["counters"]
        counters = HostCounters(tuple(host["round_functions"][i]), float(saved["seconds"][0]),
                                float(saved["seconds"][1]), saved["timeouts_F"], saved["errors_F"],
                                tuple(host["round_errors"][i]))
        held.append(HeldRound(dict(tree[f"round{i}"]["rows"]), counters))
    return InFlight(tuple(int(p) for p in host["round_positions"]), (), int(host["stream_position"]), tuple(held))


def in_flight(host: dict[str, Any], saved: Any, max_staleness: int) -> InFlight:
    """The restored queue: from the host JSON and the saved params (a one-step-off checkpoint without
    round_positions holds the pending round's position as data_position)."""
    params = (saved,) if max_staleness == 1 else tuple(saved)
    position = int(host["data_position"])
    positions = tuple(int(p) for p in host.get("round_positions", [position]))
    return InFlight(positions, params, int(host.get("stream_position", position)))


def resumed_stream_position(queue: InFlight, redrawn: int) -> int:
    """Where the prompt stream continues once the first `redrawn` queued rounds are re-drawn: after the last prompts
    drawn before the save, or after a re-drawn round the saved run did not launch (a run given more steps)."""
    return max([queue.stream_position] + [p + 1 for p in queue.positions[:redrawn]])


# ---------------------------------------------------------------------------------------------
# The producer thread
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PendingRound:
    """A step's first sampling round, launched ahead of its step (dynamic sampling's extra rounds run at the step)."""

    step: int  # the step (0-based) that trains on it
    examples: tuple[Example, ...]
    prompts: list[list[int]]
    data_position: int  # the prompt stream's position of its prompts (what a checkpoint saves)
    future: concurrent.futures.Future  # -> this process's (ScoredRollout share, HostCounters)
    version: int = 0  # the weight version that samples it (sampler_version)


class Prefetcher:
    """The one background thread that samples pending rounds, in launch order (a context manager); it records when
    it was busy (the producer's idle time is the rest)."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._lock = threading.Lock()
        self._busy: list[tuple[float, float]] = []  # finished rounds' (start, stop), perf_counter seconds
        self._running_since: float | None = None

    def launch(self, step: int, examples: tuple[Example, ...], prompts: list[list[int]], data_position: int,
               work: Callable[..., Any], *args: Any, version: int = 0) -> PendingRound:
        """Starts `work(*args)` (this process's share: sample and score) for step `step`, sampled by `version`."""
        return PendingRound(step, examples, prompts, data_position, self._pool.submit(self._timed, work, *args),
                            version)

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
        """Queues `work(*args)` behind the rounds launched so far (a deferred weight push)."""
        return self._pool.submit(self._timed, work, *args)

    @staticmethod
    def wait(pending: PendingRound | None) -> None:
        """Blocks until the round is done (its error, if any, is raised where the round is taken, on every host)."""
        if pending is not None:
            concurrent.futures.wait([pending.future])

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
