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


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """An RL post-training algorithm as the trainer runs it."""

    name: str
    advantage_fn: Callable[..., jax.Array]  # [P, G] rewards (or [P, G, K] components) -> [P, G]
    aggregation: Aggregation  # loss aggregation over the optimizer window
    min_group_size: int  # the estimator is meaningless below this group size
    forbids: frozenset[str]  # options of _REASONS this algorithm rejects
    multi_reward: bool = False  # the estimator takes [P, G, K] components and weights
    policy_loss: PolicyLoss = "ppo_clip"  # the per-token surrogate (see drgrpo_jax.losses)


ALGORITHMS: types.MappingProxyType[str, Algorithm] = types.MappingProxyType(
    {
        "dr_grpo": Algorithm("dr_grpo", adv.dr_grpo, "fixed_budget", 2, frozenset(_REASONS)),
        "grpo": Algorithm("grpo", adv.grpo, "seq_mean_token_mean", 2, frozenset({"scale_rewards", "kl_in_reward"})),
        "dapo": Algorithm("dapo", adv.grpo, "token_mean", 2, frozenset({"scale_rewards", "kl_in_reward"})),
        "rloo": Algorithm("rloo", adv.rloo, "seq_mean_token_sum", 2, frozenset({"kl_in_reward"})),
        "gdpo": Algorithm("gdpo", adv.gdpo, "token_mean", 2, frozenset(_REASONS), multi_reward=True),
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


def compute_advantages(
    name: str,
    rewards: jax.Array,
    valid: jax.Array | None = None,
    *,
    weights: jax.Array | Sequence[float] | None = None,
    scale_rewards: bool = False,
    whiten_advantages: bool = False,
    axis_name: str | Sequence[str] | None = None,
) -> jax.Array:
    """The algorithm's advantages of [P, G] rewards ([P, G, K] components for gdpo) -> [P, G]."""
    check_algorithm_options(name, scale_rewards=scale_rewards, whiten_advantages=whiten_advantages)
    algorithm = _get(name)
    if algorithm.multi_reward:
        if weights is None:
            raise ValueError(f"reward.weights: {name} needs one weight per reward component")
        return algorithm.advantage_fn(rewards, weights, valid, axis_name=axis_name)
    result = algorithm.advantage_fn(rewards, valid)
    if scale_rewards:
        result = result / (adv.group_std(rewards, valid) + 1e-6)
    if whiten_advantages:
        result = adv.whiten(result, valid, eps=1e-6, axis_name=axis_name)
    return result


def group_signal(
    name: str,
    rewards: jax.Array,
    valid: jax.Array | None = None,
    *,
    weights: jax.Array | Sequence[float] | None = None,
) -> jax.Array:
    """bool [P]: groups that carry a learning signal, by the algorithm's own test.

    gdpo: the combined advantage before whitening is not all equal (components that cancel
    give no signal); the others: the scalar reward [P, G] varies within the group. Dynamic
    sampling keeps exactly the groups the optimiser would learn from.
    """
    algorithm = _get(name)
    if algorithm.multi_reward:
        if weights is None:
            raise ValueError(f"reward.weights: {name} needs one weight per reward component")
        signal_input = adv.gdpo_combined(rewards, weights, valid)
    else:
        signal_input = rewards
    return ~adv.zero_signal_groups(signal_input, valid)
