"""Every random choice of a run derives from (run.seed, step, purpose): the purposes, each in one place.

A resumed run draws the same numbers as an uninterrupted one because nothing else feeds them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["eval_seed", "lora_init_key", "minibatch_seed", "rollout_seed", "step_seed"]

_ROLLOUT = 0  # a step's first sampling round
_MINIBATCH_ORDER = 1  # + epoch: the order the optimizer windows take the rollout's rows in
_EVAL = 999  # the evaluation's sampled completions
_RESAMPLE = 1000  # + round: dynamic sampling's extra rounds
_LORA_INIT = 0x10A  # fold_in(key(run.seed), this): the adapters' initial A


def step_seed(seed: int, step: int, purpose: int) -> int:
    """A uint32 seed for (run.seed, step, purpose)."""
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, step, purpose]).generate_state(1)[0])


def rollout_seed(seed: int, step: int, round_index: int = 0) -> int:
    """The sampler's seed for step `step`'s sampling round `round_index` (0: the first, >0: dynamic sampling's)."""
    return step_seed(seed, step, _RESAMPLE + round_index if round_index else _ROLLOUT)


def minibatch_seed(seed: int, step: int, epoch: int) -> int:
    """The seed of the row order of step `step`'s ppo epoch `epoch`."""
    return step_seed(seed, step, _MINIBATCH_ORDER + epoch)


def eval_seed(seed: int, step: int) -> int:
    """The seed of the sampled completions of the evaluation after `step` steps."""
    return step_seed(seed, step, _EVAL)


def lora_init_key(seed: int) -> Any:
    """The JAX key of the LoRA adapters' initial A."""
    import jax

    return jax.random.fold_in(jax.random.key(seed), _LORA_INIT)
