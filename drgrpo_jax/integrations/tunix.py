"""drgrpo_jax's losses and advantages inside Google's Tunix (`google-tunix`): one call, `register()`.

After `register()`, a Tunix `GRPOConfig` selects them by name:

    from drgrpo_jax.integrations import tunix as drgrpo_tunix
    drgrpo_tunix.register()
    config = GRPOConfig(policy_loss_fn="drgrpo_jax/dr_grpo", advantage_estimator="drgrpo_jax/dr_grpo",
                        num_generations=4, beta=0.0)

- policy losses `drgrpo_jax/<name>` for every algorithm of the table (`ALGORITHMS`): its aggregation and its
  surrogate, through `loss_fn`; the clip, KL and dual clip come from Tunix's config (`epsilon`, `epsilon_high`,
  `beta`, `kl_loss_mode`, `epsilon_c`) and the generation budget of `fixed_budget` is the width Tunix pads every
  completion to (the rollout config's `max_tokens_to_generate`).
- advantage estimators `drgrpo_jax/<name>` for every algorithm (Dr.GRPO, GRPO, RLOO, GDPO, ...), group by group.
- the reward manager `drgrpo_jax/per_reward`, which keeps one column per reward function ([B, K]) where Tunix's
  own sums them: GDPO normalises each reward within its group before weighting (`register(reward_weights=...)`).

Where Tunix differs from the trainer of this project, the adapter follows Tunix's batch as it is:
- Tunix's sampler cuts each completion before its EOS, so the EOS is not a response token (this project's trainer
  counts it: its probability is trained too), and a completion that was EOS at once is an empty row. An empty row
  counts in this library's N_w (a response the policy gave); Tunix's own aggregations skip it.
- A registered loss sees one micro-batch. With gradient accumulation (train_micro_batch_size < mini_batch_size)
  Tunix averages the micro-batch gradients: `fixed_budget` and the seq-mean aggregations stay exact (Tunix's
  micro-batches are equal), `token_mean` becomes the mean of the micro-batches' token means.
- Packed sequences (`segment_ids`) are refused: the loss needs one response per row.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from drgrpo_jax.algorithms import ALGORITHMS, compute_advantages
from drgrpo_jax.errors import FieldError
from drgrpo_jax.losses import KLEstimator, LossConfig, loss_fn

try:
    from flax import nnx
    from tunix.rl import common, function_registry, reward_manager
except ImportError as error:  # the host trainer is an optional extra
    raise ImportError("drgrpo_jax.integrations.tunix needs Google's Tunix: pip install 'drgrpo_jax[tunix]' "
                      f"(google-tunix); {error}") from error

__all__ = ["PREFIX", "PER_REWARD", "KL_ESTIMATORS", "loss_config", "policy_loss", "advantage_estimator",
           "PerRewardManager", "register"]

PREFIX = "drgrpo_jax/"
PER_REWARD = PREFIX + "per_reward"
# Tunix's `kl_loss_mode` names for Schulman's estimators (verl's likewise: kl, mse, low_var_kl).
KL_ESTIMATORS: types.MappingProxyType[str, KLEstimator] = types.MappingProxyType(
    {"kl": "k1", "mse_kl": "k2", "low_var_kl": "k3"})


def loss_config(algorithm: str, algo_config: Any, budget: int) -> LossConfig:
    """The `LossConfig` of `algorithm` under a Tunix algorithm config (GRPOConfig and its kin)."""
    entry = ALGORITHMS[algorithm]
    mode = getattr(algo_config, "kl_loss_mode", "kl")
    if mode not in KL_ESTIMATORS:
        raise FieldError("GRPOConfig", "kl_loss_mode", f"unknown {mode!r}; choose one of {sorted(KL_ESTIMATORS)}")
    if getattr(algo_config, "kl_clamp_value", None) is not None:
        raise FieldError("GRPOConfig", "kl_clamp_value", "drgrpo_jax's losses do not clamp the per-token KL; "
                                                          "leave it None")
    return LossConfig(
        aggregation=entry.aggregation,
        policy_loss=entry.policy_loss,
        budget=budget,
        clip_low=getattr(algo_config, "epsilon", 0.2),
        clip_high=getattr(algo_config, "epsilon_high", None),
        dual_clip=getattr(algo_config, "epsilon_c", None),
        kl_coef=getattr(algo_config, "beta", None) or 0.0,
        kl_estimator=KL_ESTIMATORS[mode],
        entropy_coef=getattr(algo_config, "entropy_coef", None) or 0.0,
    )


def _entropy(logits: jax.Array) -> jax.Array:
    """Per-token entropy of the sampling distribution [B, T] from its logits [B, T, V] (float32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -(jnp.exp(logp) * logp).sum(axis=-1)


def policy_loss(algorithm: str, model, train_example, algo_config, pad_id: int, eos_id: int,
                **unused) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A Tunix policy loss: `algorithm`'s loss of one Tunix `TrainExample`, and the aux metrics Tunix logs.

    Tunix's names for the metrics it requires: `kl` (our `kl`) and `pg_clipfrac` (our `clip_fraction`); our other
    metrics as `drgrpo_jax/<name>` (Tunix's `pg_loss` and `ppo_kl` mean other things).
    Sampler importance weights (`sampler_is_weights`, non-negative and detached) are folded into the per-token
    advantages: every surrogate is linear in the advantage for a positive weight, so it scales each token's
    policy-gradient loss as Tunix does, and leaves the KL term alone.
    """
    del unused
    if getattr(train_example, "segment_ids", None) is not None:
        raise ValueError("drgrpo_jax/" + algorithm + ": packed sequences (segment_ids) are not supported; the loss "
                         "needs one response per row")
    completion_ids, mask = train_example.completion_ids, train_example.completion_mask
    config = loss_config(algorithm, algo_config, budget=completion_ids.shape[1])
    graphdef, state = nnx.split(model)
    logprobs, logits = common.compute_per_token_logps(
        graphdef, state, prompt_tokens=train_example.prompt_ids, completion_tokens=completion_ids,
        pad_id=pad_id, eos_id=eos_id, stop_gradient=False, return_logits=True,
        temperature=getattr(algo_config, "temperature", 1.0))
    logprobs = logprobs.astype(jnp.float32)
    old = train_example.old_per_token_logps
    old = jax.lax.stop_gradient(logprobs) if old is None else old.astype(jnp.float32)
    advantages = jnp.asarray(train_example.advantages, jnp.float32)
    weights = getattr(train_example, "sampler_is_weights", None)
    if weights is not None:
        per_row = advantages[:, None] if advantages.ndim == 1 else advantages
        advantages = per_row * jax.lax.stop_gradient(jnp.asarray(weights, jnp.float32))
    entropy = _entropy(logits) if config.entropy_coef > 0 else None  # [B, T, V] work only where it is trained
    loss, metrics = loss_fn(logprobs, old, advantages, jnp.asarray(mask, bool), config=config,
                            ref_logprobs=train_example.ref_per_token_logps, entropy=entropy)
    # Tunix's names where the meaning is Tunix's; ours, token means over the batch, under names Tunix does not use.
    aux = {"kl": metrics["kl"], "pg_clipfrac": metrics["clip_fraction"]}
    aux |= {f"drgrpo_jax/{name}": metrics[name] for name in ("pg_loss", "approx_kl", "entropy")}
    return loss, aux


def advantage_estimator(algorithm: str, rewards, num_generations: int,
                        reward_weights: Sequence[float] | None = None) -> np.ndarray:
    """A Tunix advantage estimator: rewards [B] (or [B, K] from `PerRewardManager`) -> advantages [B].

    Rows come in groups of `num_generations` (Tunix repeats each prompt that many times, one after another).
    A multi-reward algorithm (gdpo) reads the K columns with `reward_weights` (default: all 1); the others read
    their sum, as Tunix's own reward manager gives it.
    """
    rewards = np.asarray(rewards, np.float32)
    columns = rewards.reshape(rewards.shape[0], -1)
    groups = columns.reshape(-1, num_generations, columns.shape[1])
    if ALGORITHMS[algorithm].multi_reward:
        weights = jnp.ones(columns.shape[1]) if reward_weights is None else jnp.asarray(reward_weights, jnp.float32)
        if weights.shape != (columns.shape[1],):
            raise FieldError("register", "reward_weights", f"one weight per reward function: {columns.shape[1]} "
                                                            f"columns, {weights.shape[0]} weights")
        result = compute_advantages(algorithm, groups, weights=weights)
    else:
        result = compute_advantages(algorithm, groups.sum(axis=-1))
    return np.asarray(result).reshape(-1)


class PerRewardManager(reward_manager.SequenceRewardManager):
    """Tunix's sequence-level reward manager keeping one column per reward function: rewards [B, K].

    Each function is scored by Tunix's own manager (its arguments and checks), one function at a time.
    """

    def __call__(self, prompts, completions, **kwargs) -> dict[str, Any]:
        columns = [reward_manager.SequenceRewardManager([fn], self.algo_config)(prompts, completions, **kwargs)
                   for fn in self.reward_fns]
        rewards = np.stack([column["rewards"] for column in columns], axis=1)
        return {"rewards": rewards, "log_metrics": self._prepare_log_metrics(prompts, completions, rewards)}


def register(reward_weights: Sequence[float] | None = None) -> dict[str, list[str]]:
    """Registers every table algorithm into Tunix's registries; returns the names, by registry category.

    `reward_weights`: GDPO's weight of each reward function, in the order given to the learner.
    """
    names: dict[str, list[str]] = {"policy_loss_fn": [], "advantage_estimator": [], "reward_manager": [PER_REWARD]}
    for algorithm in ALGORITHMS:
        name = PREFIX + algorithm

        def loss(model, train_example, algo_config, pad_id, eos_id, _algorithm=algorithm, **kwargs):
            return policy_loss(_algorithm, model, train_example, algo_config, pad_id, eos_id, **kwargs)

        def estimator(rewards, num_generations, _algorithm=algorithm, **kwargs):
            return advantage_estimator(_algorithm, rewards, num_generations, reward_weights)

        function_registry.register_policy_loss_fn(name)(loss)
        function_registry.register_advantage_estimator(name)(estimator)
        names["policy_loss_fn"].append(name)
        names["advantage_estimator"].append(name)
    function_registry.register_reward_manager(PER_REWARD)(PerRewardManager)
    return names
