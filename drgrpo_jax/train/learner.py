"""The learner: what learns. A `Learner` holds the jitted training step and log-prob forward (built once at set-up,
`step/train_step.py`) and the mesh they run on; `update` turns a rollout's batch into the next train state."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from drgrpo_jax.algorithms import ALGORITHMS
from drgrpo_jax.config.derived import one_window_per_rollout
from drgrpo_jax.hosts import host_array
from drgrpo_jax.seeds import minibatch_permutation
from drgrpo_jax.sharding import batch_sharding, place
from drgrpo_jax.train.metrics import UpdateResult

if TYPE_CHECKING:
    from drgrpo_jax.config.schema import AlgorithmConfig
    from drgrpo_jax.step.batch import Batch
    from drgrpo_jax.step.train_step import TrainState

__all__ = ["Learner"]


@dataclasses.dataclass(frozen=True)
class Learner:
    """The jitted step and log-probs on their mesh, and the algorithm's windows: ppo_epochs x minibatches."""

    mesh: jax.sharding.Mesh
    train_step: Callable[[TrainState, Batch], tuple[TrainState, Any]]  # one optimizer window
    logprobs: Callable[..., jax.Array]  # (params, batch, frozen) -> the policy's log-probs of a whole rollout
    algorithm: AlgorithmConfig
    seed: int  # run.seed: the windows' row orders derive from it

    def update(self, state: TrainState, step: int, batch: Batch, signal_N: np.ndarray) -> tuple[TrainState,
                                                                                                 UpdateResult]:
        """Old log-probs (when several windows share the rollout), then ppo_epochs x minibatches_per_rollout
        optimizer windows: (new state, their report).

        Each window's advantages pass the algorithm's window step (`Algorithm.window_advantages`) on its own rows.
        A window's metrics are read on the host once the next window is dispatched, so the host never waits for
        the device between windows.
        """
        a, placed = self.algorithm, batch_sharding(self.mesh)
        start = time.perf_counter()
        if not one_window_per_rollout(a):  # else the step uses its own forward's log-probs (StepConfig.on_policy)
            old_logprobs = host_array(self.logprobs(state.params, place(batch, placed), state.frozen))
            batch = dataclasses.replace(batch, old_logprobs=old_logprobs)
        old_logprob_seconds = time.perf_counter() - start
        num = batch.row_valid.shape[0]
        size = num // a.minibatches_per_rollout
        window_step = ALGORITHMS[a.name].window_advantages
        dispatched, window_reports = [], []
        for epoch in range(a.ppo_epochs):
            order = minibatch_permutation(num, self.seed, step, epoch)
            for m in range(a.minibatches_per_rollout):
                rows = order[m * size:(m + 1) * size]
                window = jax.tree.map(lambda v, rows=rows: v[rows], batch)
                advantages, report = window_step(window.advantages, window.row_valid, signal_N[rows])
                window = dataclasses.replace(window, advantages=np.asarray(advantages, np.float32))
                window_reports.append({k: float(v) for k, v in report.items()})
                state, metrics = self.train_step(state, place(window, placed))
                dispatched.append(metrics)  # on the device: read below, after the last window is dispatched
        return state, UpdateResult(jax.device_get(dispatched), window_reports, old_logprob_seconds)
