"""One explicit table: algorithm name -> advantage estimator, loss aggregation, what it forbids.

`dr_grpo` is one switch for both halves of the method: group-centred advantages AND the
fixed-budget loss (peers need two knobs, and users set one without the other). Each entry
also binds its policy-gradient surrogate (`LossConfig.policy_loss`): GSPO's sequence-level
ratio and clip (Zheng et al. 2025; its paper clips at 3e-4 / 4e-4: set algorithm.clip_low and
algorithm.clip_high), GSPO-token, and CISPO's clipped stop-gradient weights (MiniMax-M1).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from drgrpo_jax import advantages as adv
from drgrpo_jax.errors import FieldError, FieldTypeError
from drgrpo_jax.losses import Aggregation, LossConfig, PolicyLoss

__all__ = ["Algorithm", "ALGORITHMS", "check_algorithm_options", "compute_advantages", "group_signal"]

# Why each option can be forbidden; the message a user sees names the option and this reason.
_REASONS = {
    "scale_rewards": "dividing by the group std over-weights too-easy and too-hard questions",
    "whiten_advantages": "a batch-wide whitening on top rescales what the estimator defines",
    "kl_in_reward": "the KL penalty belongs in the loss (algorithm.kl_coef), not in the reward",
}

Values = jax.Array | np.ndarray  # the table takes the host's numpy arrays and jitted code's alike
Weights = jax.Array | np.ndarray | Sequence[float]
AxisName = str | Sequence[str] | None


def _as_array(x: Values | None) -> jax.Array | None:
    return None if x is None else jnp.asarray(x)


def _gdpo_window(advantages: Values, valid: Values, signal: Values, *,
                 axis_name: AxisName = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GDPO's batch whitening over the window's valid rows; rows of groups without signal stay exactly 0.

    Any shape ([N] rows of one window, [P, G] groups); the statistics are psum-reduced over `axis_name`.
    """
    advantages, valid = jnp.asarray(advantages), jnp.asarray(valid)
    x, valid_x = advantages.reshape(1, -1), valid.reshape(1, -1)
    mean, std = adv.whiten_stats(x, valid_x, axis_name=axis_name)
    whitened = adv.whiten(x, valid_x, eps=1e-4, axis_name=axis_name).reshape(advantages.shape)
    return jnp.where(signal & valid, whitened, 0.0), {"whiten_mean": mean, "whiten_std": std}


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """An RL post-training algorithm as the trainer runs it: its whole data path from rewards to the loss.

    Advantages come in two stages: `advantage_fn` within each group of the rollout, then, where the
    algorithm has one, `window_fn` over each optimizer window (GDPO whitens each window on its own rows,
    never the concatenation of several windows). For a batch that is one window the two stages are the
    whole estimator (`compute_advantages`).
    """

    name: str
    advantage_fn: Callable[..., jax.Array]  # [P, G] rewards (multi_reward: [P, G, K] components, [K] weights) -> [P, G]
    aggregation: Aggregation  # loss aggregation over the optimizer window
    min_group_size: int  # the estimator is meaningless below this group size
    forbids: frozenset[str]  # options of _REASONS this algorithm rejects
    multi_reward: bool = False  # the estimator takes [P, G, K] components and weights
    policy_loss: PolicyLoss = "ppo_clip"  # the per-token surrogate (see drgrpo_jax.losses)
    window_fn: Callable[..., tuple[jax.Array, dict[str, jax.Array]]] | None = None  # per optimizer window

    def rewards(self, components_PGK: Values, weights_K: Weights) -> jax.Array:
        """What `advantage_fn` reads: the components themselves (multi_reward) or their weighted sum [P, G]."""
        components = jnp.asarray(components_PGK, jnp.float32)
        return components if self.multi_reward else components @ jnp.asarray(weights_K, jnp.float32)

    def group_advantages(self, components_PGK: Values, weights_K: Weights, valid_PG: Values | None = None, *,
                         scale_rewards: bool = False, whiten_advantages: bool = False,
                         axis_name: AxisName = None) -> jax.Array:
        """[P, G] advantages of the rollout's reward components, before any per-window step."""
        check_algorithm_options(self.name, scale_rewards=scale_rewards, whiten_advantages=whiten_advantages)
        rewards, valid_PG = self.rewards(components_PGK, weights_K), _as_array(valid_PG)
        if self.multi_reward:
            return self.advantage_fn(rewards, jnp.asarray(weights_K, jnp.float32), valid_PG)
        result = self.advantage_fn(rewards, valid_PG)
        if scale_rewards:
            result = result / (adv.group_std(rewards, valid_PG) + 1e-6)
        if whiten_advantages:
            result = adv.whiten(result, valid_PG, eps=1e-6, axis_name=axis_name)
        return result

    def group_signal(self, components_PGK: Values, weights_K: Weights, valid_PG: Values | None = None) -> jax.Array:
        """bool [P]: groups that carry a learning signal, by this algorithm's own test.

        The group-stage advantages are not all equal: for gdpo, components that cancel give no signal; for
        the others, the scalar reward varies within the group. Dynamic sampling keeps exactly the groups the
        optimiser would learn from.
        """
        rewards, valid_PG = self.rewards(components_PGK, weights_K), _as_array(valid_PG)
        if self.multi_reward:
            rewards = self.advantage_fn(rewards, jnp.asarray(weights_K, jnp.float32), valid_PG)
        return ~adv.zero_signal_groups(rewards, valid_PG)

    def window_advantages(self, advantages: Values, valid: Values, signal: Values, *,
                          axis_name: AxisName = None) -> tuple[Values, dict[str, jax.Array]]:
        """One optimizer window's advantages from the group stage's, and what the window step reports.

        `valid`: real rows; `signal`: rows whose group carries a signal. Unchanged (and no report) for
        algorithms without a window step.
        """
        if self.window_fn is None:
            return advantages, {}
        return self.window_fn(advantages, valid, signal, axis_name=axis_name)


ALGORITHMS: types.MappingProxyType[str, Algorithm] = types.MappingProxyType(
    {
        "dr_grpo": Algorithm("dr_grpo", adv.dr_grpo, "fixed_budget", 2, frozenset(_REASONS)),
        "grpo": Algorithm("grpo", adv.grpo, "seq_mean_token_mean", 2, frozenset({"scale_rewards", "kl_in_reward"})),
        "dapo": Algorithm("dapo", adv.grpo, "token_mean", 2, frozenset({"scale_rewards", "kl_in_reward"})),
        "rloo": Algorithm("rloo", adv.rloo, "seq_mean_token_sum", 2, frozenset({"kl_in_reward"})),
        "gdpo": Algorithm("gdpo", adv.gdpo_combined, "token_mean", 2, frozenset(_REASONS), multi_reward=True,
                          window_fn=_gdpo_window),
        # GSPO's objective: 1/G sum_i min(s_i A_i, clip(s_i) A_i), one term per response (seq-mean).
        "gspo": Algorithm("gspo", adv.grpo, "seq_mean_token_mean", 2, frozenset({"scale_rewards", "kl_in_reward"}),
                          policy_loss="gspo"),
        "gspo_token": Algorithm("gspo_token", adv.grpo, "seq_mean_token_mean", 2,
                                frozenset({"scale_rewards", "kl_in_reward"}), policy_loss="gspo_token"),
        # CISPO's objective: sum over the batch's tokens / their number (token-mean).
        "cispo": Algorithm("cispo", adv.grpo, "token_mean", 2, frozenset({"scale_rewards", "kl_in_reward"}),
                           policy_loss="cispo"),
    }
)


def _get(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise FieldError("algorithm", "name", f"unknown {name!r}; choose one of {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]


def check_algorithm_options(
    name: str,
    *,
    scale_rewards: bool = False,
    whiten_advantages: bool = False,
    kl_in_reward: bool = False,
    budget: int | None = None,
    group_size: int | None = None,
) -> None:
    """Raises a one-line FieldError (a ValueError) naming the first option `name` cannot take.

    FieldTypeError (also a TypeError) for a wrong type. The budget is checked by building the algorithm's
    LossConfig (that rule lives there, so the error names `LossConfig.budget`); None is not checked.
    """
    algorithm = _get(name)
    options = {"scale_rewards": scale_rewards, "whiten_advantages": whiten_advantages, "kl_in_reward": kl_in_reward}
    for option, value in options.items():
        if not isinstance(value, bool):
            raise FieldTypeError("algorithm", option, f"must be true or false, got {value!r}")
        if value and option in algorithm.forbids:
            divides = option == "scale_rewards" and algorithm.advantage_fn is adv.grpo
            already = " (grpo already divides by it)" if divides else ""
            raise FieldError("algorithm", option, f"{name} forbids it: {_REASONS[option]}{already}")
    if budget is not None:
        LossConfig(aggregation=algorithm.aggregation, budget=budget, policy_loss=algorithm.policy_loss)
    if group_size is not None and group_size < algorithm.min_group_size:
        raise FieldError("algorithm", "group_size",
                         f"{name} needs at least {algorithm.min_group_size} samples per prompt, got {group_size}")


def _components(algorithm: Algorithm, rewards: Values, weights: Weights | None) -> tuple[Values, Weights]:
    """The public functions' rewards as the table's components: [P, G, K] as given, or [P, G] as one component."""
    if not algorithm.multi_reward:
        return jnp.asarray(rewards)[..., None], [1.0]
    if weights is None:
        raise ValueError(f"reward.weights: {algorithm.name} needs one weight per reward component")
    return rewards, weights


def compute_advantages(
    name: str,
    rewards: jax.Array,
    valid: jax.Array | None = None,
    *,
    weights: jax.Array | Sequence[float] | None = None,
    scale_rewards: bool = False,
    whiten_advantages: bool = False,
    axis_name: AxisName = None,
) -> jax.Array:
    """The algorithm's advantages of a batch that is one window: [P, G] rewards ([P, G, K] components with
    `weights` for a multi-reward algorithm) -> [P, G]. With `axis_name` the batch statistics are psum-reduced."""
    algorithm = _get(name)
    components, weights_K = _components(algorithm, rewards, weights)
    grouped = algorithm.group_advantages(components, weights_K, valid, scale_rewards=scale_rewards,
                                         whiten_advantages=whiten_advantages, axis_name=axis_name)
    if algorithm.window_fn is None:
        return grouped
    valid_PG = jnp.ones(grouped.shape, bool) if valid is None else jnp.asarray(valid, bool)
    signal_PG = algorithm.group_signal(components, weights_K, valid_PG)[:, None] & valid_PG
    return jnp.asarray(algorithm.window_advantages(grouped, valid_PG, signal_PG, axis_name=axis_name)[0])


def group_signal(
    name: str,
    rewards: jax.Array,
    valid: jax.Array | None = None,
    *,
    weights: jax.Array | Sequence[float] | None = None,
) -> jax.Array:
    """bool [P]: groups that carry a learning signal, by the algorithm's own test (`Algorithm.group_signal`)."""
    algorithm = _get(name)
    components, weights_K = _components(algorithm, rewards, weights)
    return algorithm.group_signal(components, weights_K, valid)
