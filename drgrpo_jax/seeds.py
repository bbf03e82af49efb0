"""Every seed a run derives from `run.seed`, each purpose in one place, low enough for every layer to use.

One formula, `derive_seed(seed, *path)`, turns the root seed and a path of integers (step, purpose, prompt
index, turn, ...) into a uint32; a resumed run draws the same numbers as an uninterrupted one because nothing
else feeds them, and a prompt's seed depends on its global index, not on how the prompts were split over hosts.
The sampler turns each request's seed into per-token keys itself (sampler/draws.py).
"""

from __future__ import annotations

import secrets
from typing import Any

import jax
import numpy as np

__all__ = [
    "completion_seeds", "derive_seed", "epoch_permutation", "eval_seed", "init_key", "lora_init_key",
    "minibatch_permutation", "prompt_seeds", "rollout_seed", "shuffle_permutation", "step_seed", "turn_seed",
]

_ROLLOUT = 0  # a step's first sampling round
_MINIBATCH_ORDER = 1  # + epoch: the order the optimizer windows take the rollout's rows in
_EVAL = 999  # the evaluation's sampled completions
_RESAMPLE = 1000  # + round: dynamic sampling's extra rounds
_LORA_INIT = 0x10A  # fold_in(key(run.seed), this): the adapters' initial A


def unseeded() -> int:
    """A fresh 32-bit seed for a request that names none: its draws are not reproducible, as its caller asked."""
    return secrets.randbits(32)


def derive_seed(seed: int, *path: int) -> int:
    """A uint32 seed for (seed, *path): independent streams for distinct paths."""
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, *path]).generate_state(1)[0])


def step_seed(seed: int, step: int, purpose: int) -> int:
    """A uint32 seed for (run.seed, step, purpose)."""
    return derive_seed(seed, step, purpose)


def rollout_seed(seed: int, step: int, round_index: int = 0) -> int:
    """The sampler's seed for step `step`'s sampling round `round_index` (0: the first, >0: dynamic sampling's)."""
    return step_seed(seed, step, _RESAMPLE + round_index if round_index else _ROLLOUT)


def minibatch_permutation(num_rows: int, seed: int, step: int, epoch: int) -> np.ndarray:
    """The order the optimizer windows of step `step`'s ppo epoch `epoch` take the rollout's rows in."""
    return np.random.default_rng(step_seed(seed, step, _MINIBATCH_ORDER + epoch)).permutation(num_rows)


def eval_seed(seed: int, step: int) -> int:
    """The seed of the sampled completions of the evaluation after `step` steps."""
    return step_seed(seed, step, _EVAL)


def prompt_seeds(seed: int, num_prompts: int, offset: int = 0) -> list[int]:
    """One seed per prompt from (a request's seed, global prompt index): independent of how prompts are split."""
    return [derive_seed(seed, offset + i) for i in range(num_prompts)]


def completion_seeds(prompt_seed: int, group_size: int) -> list[int]:
    """One seed per completion g of a prompt's group, from (the prompt's seed, g): for an engine that samples each
    completion from its own request's seed (SGLang copies one request's seed into all n of its copies)."""
    return [derive_seed(prompt_seed, g) for g in range(group_size)]


def turn_seed(seed: int, turn: int) -> int:
    """The seed of a multi-turn rollout's turn `turn` (its episodes' seeds then follow prompt_seeds)."""
    return derive_seed(seed, turn)


def epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The training prompts' order in data epoch `epoch` (each epoch reshuffled, reproducibly)."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def shuffle_permutation(num_rows: int, seed: int) -> np.ndarray:
    """A dataset file's rows in the seeded order its held-out and training examples are cut from."""
    return np.random.default_rng(seed).permutation(num_rows)


def init_key(seed: int) -> Any:
    """The JAX key parameters are initialised from (the reference copy, shapes before a checkpoint restores)."""
    return jax.random.key(seed)


def lora_init_key(seed: int) -> Any:
    """The JAX key of the LoRA adapters' initial A."""
    return jax.random.fold_in(init_key(seed), _LORA_INIT)
