"""From a scored rollout to the arrays of a training batch: pure host-side helpers of the trainer.

Seeds per (run, step), each host's share of a rollout and the merge of the hosts' rows,
correctness and length statistics, left padding of prompt groups, and the algorithm's
advantages with the per-window whitening GDPO needs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from drgrpo_jax.config import Config

__all__ = ["advantages_N", "correct_mask", "host_share", "left_pad", "merge_host_rows", "response_stats", "step_seed",
           "window_advantages"]

_CORRECTNESS = ("math_verify", "task")  # components that say whether the answer is right


def step_seed(seed: int, step: int, purpose: int) -> int:
    """A uint32 seed for (run.seed, step, purpose): 0 = rollout sampling, 1 = minibatch order."""
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, step, purpose]).generate_state(1)[0])


def host_share(num_prompts: int, num_hosts: int, host: int) -> tuple[int, int]:
    """[start, stop) of the prompts host `host` samples and scores: equal contiguous shares in host order."""
    if num_prompts % num_hosts:
        raise ValueError(f"rollout.prompts_per_step: {num_prompts} prompts do not split evenly over {num_hosts} hosts")
    if not 0 <= host < num_hosts:
        raise ValueError(f"host: {host} is not in [0, {num_hosts})")
    size = num_prompts // num_hosts
    return host * size, (host + 1) * size


def merge_host_rows(stacked: dict[str, np.ndarray], reductions: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Every host's arrays stacked on a leading host axis [H, rows, ...] -> the whole rollout [H * rows, ...].

    Host h's rows follow host h - 1's, which is the prompt order of a one-host rollout because the
    shares are contiguous (`host_share`). Arrays named in `reductions` are not per row: they are
    reduced over the hosts instead ("sum": counters, "max": wall-clock of the slowest host).
    """
    reductions = reductions or {}
    reducers = {"sum": np.sum, "max": np.max}
    out = {}
    for name, value in stacked.items():
        if name in reductions:
            out[name] = reducers[reductions[name]](value, axis=0)
        else:
            out[name] = value.reshape(value.shape[0] * value.shape[1], *value.shape[2:])
    return out


def correct_mask(names: tuple[str, ...], components_NK: np.ndarray) -> np.ndarray:
    """bool [N]: full credit on a correctness component (math_verify/task) if any, else a positive reward."""
    columns = [k for k, name in enumerate(names) if name in _CORRECTNESS]
    if columns:
        return (components_NK[:, columns] >= 1.0).any(axis=1)
    return components_NK.sum(axis=1) > 0


def _mean_or_none(values: np.ndarray) -> float | None:
    """The mean, or None (JSON null) when there is nothing to average: never a made-up 0."""
    return float(values.mean()) if values.size else None


def response_stats(lengths_N: np.ndarray, truncated_N: np.ndarray, correct_N: np.ndarray) -> dict[str, Any]:
    """Accuracy and response lengths split by correctness."""
    return {
        "accuracy": float(correct_N.mean()),
        "response_length_mean": float(lengths_N.mean()),
        "response_length_correct": _mean_or_none(lengths_N[correct_N]),
        "response_length_incorrect": _mean_or_none(lengths_N[~correct_N]),
        "truncated_fraction": float(truncated_N.mean()),
    }


def left_pad(prompts: list[list[int]], length: int, repeat: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt ids and mask [len(prompts) * repeat, length], left-padded with 0, each prompt repeated."""
    ids = np.zeros((len(prompts) * repeat, length), np.int32)
    for p, prompt in enumerate(prompts):
        ids[p * repeat:(p + 1) * repeat, length - len(prompt):] = prompt
    lengths = np.repeat([len(p) for p in prompts], repeat)
    return ids, np.arange(length)[None, :] >= length - lengths[:, None]


def advantages_N(config: Config, weights: tuple[float, ...], components_NK: np.ndarray,
                 valid_P: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float32 [N] advantages of prompt-major responses, bool [P] groups with a learning signal).

    gdpo's advantages come back before the batch whitening: each optimizer window whitens
    its own rows (`window_advantages`), never the concatenation of several windows.
    Padding groups (valid_P False) get 0 and no signal.
    """
    import jax.numpy as jnp

    from drgrpo_jax.advantages import gdpo_combined
    from drgrpo_jax.algorithms import ALGORITHMS, compute_advantages, group_signal

    a, num_prompts = config.algorithm, len(valid_P)
    group = components_NK.shape[0] // num_prompts
    valid = jnp.asarray(np.repeat(valid_P[:, None], group, axis=1))
    if ALGORITHMS[a.name].multi_reward:  # GDPO normalises each component on its own
        rewards = jnp.asarray(components_NK.reshape(num_prompts, group, -1))
        result = gdpo_combined(rewards, jnp.asarray(weights, jnp.float32), valid)
    else:
        rewards = jnp.asarray((components_NK @ np.asarray(weights, np.float32)).reshape(num_prompts, group))
        result = compute_advantages(a.name, rewards, valid, scale_rewards=a.scale_rewards,
                                    whiten_advantages=a.whiten_advantages)
    signal = group_signal(a.name, rewards, valid, weights=jnp.asarray(weights, jnp.float32))
    return np.asarray(result, np.float32).reshape(-1), np.asarray(signal, bool)


def window_advantages(advantages_N: np.ndarray, row_valid_N: np.ndarray,
                      signal_N: np.ndarray) -> tuple[np.ndarray, float, float]:
    """GDPO's batch whitening of one optimizer window: (advantages, mean, std) over its valid rows.

    Every process holds the whole window, so the statistics are the same on every shard
    without a collective. Rows of groups with no signal stay exactly 0 (see advantages.gdpo).
    """
    import jax.numpy as jnp

    from drgrpo_jax.advantages import whiten, whiten_stats

    x, valid = jnp.asarray(advantages_N)[None, :], jnp.asarray(row_valid_N)[None, :]
    mean, std = whiten_stats(x, valid)
    whitened = np.asarray(whiten(x, valid, eps=1e-4), np.float32)[0]
    return np.where(signal_N & row_valid_N, whitened, 0.0).astype(np.float32), float(mean), float(std)
