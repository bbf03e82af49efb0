"""The one-step-off prefetch (rollout.async=true): step s+1's first sampling round runs in a background thread (the
HTTP call and the scoring; the hosts' collectives stay on the main thread) while step s's update runs:

    collect R_s (pending since step s-1) -> launch R_{s+1} (the service holds version s = the policy after s
    updates) -> update (version s+1) -> wait for R_{s+1} -> push version s+1 -> checkpoint

The push waits for the round, so R_{s+1} comes wholly from version s: one version stale, never a race, corrected
by the capped or masked importance weight (algorithm.tis_cap, mis_high) and bounded by `check_fresh`. A
checkpoint keeps the round's sampler params and data position, and `collect.prime` regenerates it on resume.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from drgrpo_jax.errors import StaleWeightsError

if TYPE_CHECKING:
    from drgrpo_jax.data.examples import Example

__all__ = ["PendingRound", "Prefetcher", "check_fresh", "snapshot"]


@dataclasses.dataclass(frozen=True)
class PendingRound:
    """A step's first sampling round, launched ahead of its step (dynamic sampling's extra rounds run at the step)."""

    step: int  # the step (0-based) that trains on it
    examples: tuple[Example, ...]
    prompts: list[list[int]]
    data_position: int  # the prompt stream's position before its prompts were drawn (what a checkpoint saves)
    future: concurrent.futures.Future  # -> this process's (ScoredRollout share, HostCounters)


class Prefetcher:
    """The one background thread that samples pending rounds (a context manager)."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")

    def launch(self, step: int, examples: tuple[Example, ...], prompts: list[list[int]], data_position: int,
               work: Any, *args: Any) -> PendingRound:
        """Starts `work(*args)` (this process's share: sample and score) for step `step`."""
        return PendingRound(step, examples, prompts, data_position, self._pool.submit(work, *args))

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


def check_fresh(versions: Sequence[int] | np.ndarray, step: int, max_staleness: int) -> int:
    """The rollout's staleness at step `step` (0-based: the policy is version `step`); StaleWeightsError when a
    completion is more than max_staleness versions old or from a version the trainer has not pushed yet."""
    oldest, newest = int(np.min(versions)), int(np.max(versions))
    if step - oldest > max_staleness or newest > step:
        raise StaleWeightsError(f"weight_version: step {step + 1} trains on versions {oldest}..{newest}; "
                                f"rollout.max_staleness = {max_staleness} allows {step - max_staleness}..{step}")
    return step - oldest


def snapshot(params: Any) -> Any:
    """A copy of the params on their devices (the update donates the originals): the pending round's
    sampler, saved with the step's checkpoint."""
    return jax.tree.map(jnp.copy, params)
