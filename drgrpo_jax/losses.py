"""Policy-gradient loss with window-exact aggregation: the heart of Dr.GRPO.

Shape letters (docs/shape_letters.md): N responses (rows), T token positions. The *window*
is everything one optimizer step consumes (all data-parallel shards, all micro-batches).
Each aggregation divides a sum over tokens by a fact of the window, so slices of a window
and shards of a mesh add up to exactly the window's loss. `LossConfig` tables the
aggregations and the policy-gradient surrogates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, NamedTuple, get_args

import chex
import jax
import jax.numpy as jnp
import numpy as np

from drgrpo_jax.errors import FieldError, FieldTypeError

__all__ = ["Aggregation", "KLEstimator", "PolicyLoss", "LossConfig", "WindowStats", "window_stats", "loss_fn",
           "kl_divergence", "clip_ratio", "sequence_log_ratio"]

Aggregation = Literal["fixed_budget", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KLEstimator = Literal["k1", "k2", "k3"]
PolicyLoss = Literal["ppo_clip", "gspo", "gspo_token", "cispo"]
AxisName = str | Sequence[str] | None


def _python_number(value: object, *, integer: bool) -> int | float:
    """`value` as a Python int (integer) or number: a foreign trainer's config hands over numpy and JAX scalars.

    Python numbers keep `LossConfig` hashable and equal by value, so it stays a static jit argument. Raises
    TypeError with the reason for booleans (a flag is not a number), arrays, traced values and, for an integer,
    any float (a budget of 8.0 is a mistake somewhere upstream, not a count).
    """
    wanted = "an int" if integer else "a number"
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"must be {wanted}, got the boolean {value!r}")
    if isinstance(value, int) or (isinstance(value, float) and not integer):
        return value
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"must be {wanted} known before tracing (LossConfig is a static argument), got a traced value")
    if not isinstance(value, (np.generic, np.ndarray, jax.Array)):
        raise TypeError(f"must be {wanted}, got {type(value).__name__} {value!r}")
    if np.shape(value) != ():
        raise TypeError(f"must be {wanted}, got an array of shape {np.shape(value)}")
    kinds = "iu" if integer else "iuf"
    if np.dtype(value.dtype).kind not in kinds:
        raise TypeError(f"must be {wanted}, got a {value.dtype} scalar {value!r}")
    return value.item()


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """How per-token losses are formed and aggregated; validated at construction (FieldError naming the field).

    `aggregation`, with N_w the window's valid rows (a fully masked valid row counts; padding rows do not) and
    T_w its response tokens:

      fixed_budget         sum(l * mask) / (N_w * budget)             Dr.GRPO
      token_mean           sum(l * mask) / T_w                        DAPO
      seq_mean_token_mean  sum_i(sum_t l * mask / max(1, len_i)) / N_w  original GRPO
      seq_mean_token_sum   sum(l * mask) / N_w

    `policy_loss`, with r_it = pi/pi_old per token and s_i = exp(mean_t log r_it) the geometric mean over
    response i (a fact of one row, so every micro-batch split by rows and every mesh keeps it exact):

      ppo_clip    -min(r_it A, clip(r_it) A)                        PPO / GRPO / Dr.GRPO / DAPO
      gspo        -min(s_i A, clip(s_i) A) on every token of row i   GSPO (Zheng et al. 2025)
      gspo_token  as gspo, ratio sg(s_i) * r_it / sg(r_it): value s_i, gradient per token   GSPO-token
      cispo       -sg(clip(r_it)) A log pi_it (value -sg(clip(r_it)) A r_it / sg(r_it))   CISPO (MiniMax-M1)

    Clipping has derivative 1 on the bounds themselves (torch.clamp's convention, as TRL and verl).
    """

    aggregation: Aggregation = "fixed_budget"  # see the class docstring
    budget: int | None = None  # generation budget B (max response tokens); fixed_budget needs it
    clip_low: float = 0.2  # ratio clipped below at 1 - clip_low
    clip_high: float | None = None  # ratio clipped above at 1 + clip_high; None = clip_low
    dual_clip: float | None = None  # c > 1 bounds the loss of negative advantages at c * |A|
    kl_coef: float = 0.0  # weight of KL(policy || reference) in the loss
    kl_estimator: KLEstimator = "k3"  # Schulman's k1, k2 or k3
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss)
    policy_loss: PolicyLoss = "ppo_clip"  # the policy-gradient surrogate; see the class docstring

    def __post_init__(self):
        def bad(name: str, reason: str, kind: type[FieldError] = FieldError) -> FieldError:
            return kind("LossConfig", name, reason)

        if self.aggregation not in get_args(Aggregation):
            raise bad("aggregation", f"unknown {self.aggregation!r}; choose one of {get_args(Aggregation)}")
        if self.policy_loss not in get_args(PolicyLoss):
            raise bad("policy_loss", f"unknown {self.policy_loss!r}; choose one of {get_args(PolicyLoss)}")
        if self.kl_estimator not in get_args(KLEstimator):
            raise bad("kl_estimator", f"unknown {self.kl_estimator!r}; choose one of {get_args(KLEstimator)}")
        for name in ("budget", "clip_low", "clip_high", "dual_clip", "kl_coef", "entropy_coef"):
            value = getattr(self, name)
            if value is None and name in ("budget", "clip_high", "dual_clip"):
                continue
            try:
                object.__setattr__(self, name, _python_number(value, integer=name == "budget"))
            except TypeError as error:
                raise bad(name, str(error), FieldTypeError) from None
        if self.budget is not None and self.budget <= 0:
            raise bad("budget", f"must be a positive int, got {self.budget}")
        if self.aggregation == "fixed_budget" and self.budget is None:
            raise bad("budget", "fixed_budget needs the generation budget (max response tokens)")
        for name in ("clip_low", "clip_high", "dual_clip", "kl_coef", "entropy_coef"):
            value = getattr(self, name)
            if value is None and name in ("clip_high", "dual_clip"):
                continue
            if not value >= 0 or value == float("inf"):
                raise bad(name, f"must be finite and >= 0, got {value}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise bad("dual_clip", f"must be > 1 (a bound above the clipped loss), got {self.dual_clip}")
        if self.dual_clip is not None and self.policy_loss == "cispo":
            raise bad("dual_clip", "cispo's loss is linear in log pi with a bounded weight: there is no unbounded "
                                   "ratio for a dual clip to bound")

    @property
    def upper_clip(self) -> float:
        return self.clip_low if self.clip_high is None else self.clip_high


class WindowStats(NamedTuple):
    """Facts of one optimizer window: valid responses N_w and response tokens T_w (float32).

    Scalars, or (`window_stats(..., per_row=True)`) the same two numbers repeated on every row [N], as columns
    a host trainer splits into micro-batches with the rest of the batch.
    """

    num_responses: jax.Array
    num_tokens: jax.Array


def _psum(x: jax.Array, axis_name: AxisName) -> jax.Array:
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def _row_valid_or_ones(mask_NT: jax.Array, row_valid_N: jax.Array | None) -> jax.Array:
    if row_valid_N is None:
        return jnp.ones(mask_NT.shape[:1], bool)
    chex.assert_shape(row_valid_N, mask_NT.shape[:1])
    return jnp.asarray(row_valid_N, bool)


def window_stats(mask: jax.Array, row_valid: jax.Array | None = None, *, axis_name: AxisName = None,
                 per_row: bool = False) -> WindowStats:
    """Counts valid rows and masked tokens, psum-reduced over `axis_name` when given.

    `per_row=True` gives each count as a column [N] (the window's number on every row), for a host trainer that
    cuts micro-batches itself: compute them on the whole window, put them in the batch beside the advantages, and
    pass each micro-batch's rows back as `window=WindowStats(*columns)`.
    """
    chex.assert_rank(mask, 2)
    row_valid = _row_valid_or_ones(mask, row_valid)
    tokens = jnp.where(row_valid[:, None], jnp.asarray(mask, bool), False)
    stats = WindowStats(
        num_responses=_psum(row_valid.sum(dtype=jnp.float32), axis_name),
        num_tokens=_psum(tokens.sum(dtype=jnp.float32), axis_name),
    )
    if not per_row:
        return stats
    return WindowStats(*(jnp.broadcast_to(count, mask.shape[:1]) for count in stats))


def kl_divergence(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: KLEstimator) -> jax.Array:
    """Per-token estimate of KL(policy || reference) from samples of the policy (Schulman)."""
    log_ratio = ref_logprobs - logprobs  # log(p_ref / p)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return jnp.expm1(log_ratio) - log_ratio  # k3: unbiased and non-negative


def _safe_divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """numerator / denominator, exactly 0 (with 0 gradient) where the denominator is 0."""
    ok = denominator > 0
    return jnp.where(ok, numerator / jnp.where(ok, denominator, 1.0), 0.0)


def clip_ratio(ratio: jax.Array, low: float, high: float) -> jax.Array:
    """clip(ratio, low, high) with derivative 1 on the bounds themselves (torch.clamp's; jnp.clip's is 0.5)."""
    inside = (ratio >= low) & (ratio <= high)
    return jnp.where(inside, ratio, jnp.clip(ratio, low, high))


def sequence_log_ratio(log_ratio_NT: jax.Array, tok_NT: jax.Array) -> jax.Array:
    """[N]: mean over each response's tokens of log(pi / pi_old), i.e. log of GSPO's s_i (0 for an empty row)."""
    return (log_ratio_NT * tok_NT).sum(axis=1) / jnp.maximum(tok_NT.sum(axis=1), 1.0)


def _policy_gradient(log_ratio_NT, adv_NT, tok_NT, config: LossConfig) -> tuple[jax.Array, jax.Array]:
    """Per-token policy-gradient loss and the tokens its clip acts on (`clip_fraction`)."""
    low, high = 1.0 - config.clip_low, 1.0 + config.upper_clip
    if config.policy_loss in ("gspo", "gspo_token"):
        seq_NT = jnp.broadcast_to(sequence_log_ratio(log_ratio_NT, tok_NT)[:, None], log_ratio_NT.shape)
        if config.policy_loss == "gspo_token":  # value s_i, gradient s_i * grad log pi_it
            seq_NT = jax.lax.stop_gradient(seq_NT) + log_ratio_NT - jax.lax.stop_gradient(log_ratio_NT)
        log_ratio_NT = seq_NT
    ratio = jnp.exp(log_ratio_NT)
    if config.policy_loss == "cispo":
        # Every token keeps its gradient; only its (stop-gradient) importance weight is clipped.
        weight = jax.lax.stop_gradient(jnp.clip(ratio, low, high))
        pg_NT = -weight * adv_NT * jnp.exp(log_ratio_NT - jax.lax.stop_gradient(log_ratio_NT))
        return pg_NT, (ratio < low) | (ratio > high)
    pg_NT = -jnp.minimum(ratio * adv_NT, clip_ratio(ratio, low, high) * adv_NT)
    if config.dual_clip is not None:
        pg_NT = jnp.where(adv_NT < 0, jnp.minimum(pg_NT, -config.dual_clip * adv_NT), pg_NT)
    # Tokens whose gradient the clip removes (the ratio left the trust region on the side the advantage pushes it).
    return pg_NT, ((ratio < low) & (adv_NT < 0)) | ((ratio > high) & (adv_NT > 0))


def _share(numerator_N: jax.Array, denominator: jax.Array, axis_name: AxisName) -> jax.Array:
    """sum(numerator_N) / denominator over the slice's rows (global over `axis_name`).

    A per-row denominator (the window's counts as columns) divides row by row: its rows all hold the same number,
    so the sum is the same, and a micro-batch cut from the rows carries its own denominator.
    """
    if denominator.ndim == 0:
        return _safe_divide(_psum(numerator_N.sum(), axis_name), denominator)
    return _psum(_safe_divide(numerator_N, denominator).sum(), axis_name)


def _aggregate(loss_NT, mask_NT, config: LossConfig, window: WindowStats, axis_name: AxisName) -> jax.Array:
    """This slice's share of the window's aggregated loss (global over `axis_name`)."""
    if config.aggregation == "seq_mean_token_mean":
        lengths = mask_NT.sum(axis=1)
        numerator_N = loss_NT.sum(axis=1) / jnp.maximum(lengths, 1.0)
    else:
        numerator_N = loss_NT.sum(axis=1)
    def fixed_budget() -> jax.Array:
        if config.budget is None:  # LossConfig already refuses this; the check narrows budget to int
            raise FieldError("LossConfig", "budget", "fixed_budget needs the generation budget (max response tokens)")
        return window.num_responses * config.budget

    denominator = {
        "fixed_budget": fixed_budget,
        "token_mean": lambda: window.num_tokens,
        "seq_mean_token_mean": lambda: window.num_responses,
        "seq_mean_token_sum": lambda: window.num_responses,
    }[config.aggregation]()
    # No response token anywhere: the loss is exactly 0 whatever the aggregation.
    denominator = jnp.where(window.num_tokens > 0, denominator, 0.0)
    return _share(numerator_N, denominator, axis_name)


def loss_fn(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    config: LossConfig,
    ref_logprobs: jax.Array | None = None,
    entropy: jax.Array | None = None,
    window: WindowStats | None = None,
    row_valid: jax.Array | None = None,
    axis_name: AxisName = None,
    averaged_over: int = 1,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped policy-gradient loss of one slice of an optimizer window.

    logprobs, old_logprobs, ref_logprobs, entropy, mask: [N, T]; advantages: [N] or [N, T];
    row_valid: [N] (False = padding row). With `window=None` this batch is the window; with
    a window given (scalars, or `window_stats(..., per_row=True)` columns cut with the rows),
    the result is this slice's share (slices sum to the window's loss).
    `averaged_over=k`: the host trainer averages the gradients of k slices (optax.MultiSteps,
    Tunix's gradient accumulation), so each share is multiplied by k and the mean of the k
    results is the window's loss and gradient; it needs the window.
    With `axis_name`, sums are psum-reduced and the loss is the global value on every shard.
    Metrics are token means over the window (the slice's share likewise, times k), one
    definition for every aggregation so runs with different aggregations compare.
    """
    if isinstance(averaged_over, bool) or not isinstance(averaged_over, int) or averaged_over < 1:
        raise ValueError(f"loss_fn: averaged_over must be a positive int (slices the host averages), "
                         f"got {averaged_over!r}")
    if averaged_over > 1 and window is None:
        raise ValueError("loss_fn: averaged_over > 1 needs the window's stats (window=window_stats(..., "
                         "per_row=True) on the whole window, its columns cut with the rows); without them "
                         "each slice is taken for the whole window")
    chex.assert_rank([logprobs, old_logprobs, mask], 2)
    chex.assert_equal_shape([logprobs, old_logprobs, mask])
    chex.assert_type([logprobs, old_logprobs], float)
    chex.assert_rank(advantages, {1, 2})
    chex.assert_shape(advantages, logprobs.shape[: advantages.ndim])
    for optional in (ref_logprobs, entropy):
        if optional is not None:
            chex.assert_equal_shape([optional, logprobs])
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("loss_fn: config.kl_coef > 0 needs ref_logprobs")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("loss_fn: config.entropy_coef > 0 needs entropy")

    row_valid = _row_valid_or_ones(mask, row_valid)
    token = jnp.asarray(mask, bool) & row_valid[:, None]
    if window is None:
        window = window_stats(mask, row_valid, axis_name=axis_name)
    for count in window:
        if jnp.ndim(count) != 0:
            chex.assert_shape(count, mask.shape[:1])

    # Sanitise masked slots first so padding garbage (inf, NaN) cannot reach a gradient.
    def clean(x):
        return jnp.where(token, jnp.asarray(x, jnp.float32), 0.0)

    logprobs, old_logprobs = clean(logprobs), clean(old_logprobs)
    adv = advantages if advantages.ndim == 2 else advantages[:, None]
    adv = clean(jnp.broadcast_to(jnp.asarray(adv, jnp.float32), logprobs.shape))

    log_ratio = logprobs - old_logprobs
    tok = token.astype(jnp.float32)
    pg_NT, clipped_NT = _policy_gradient(log_ratio, adv, tok, config)

    if ref_logprobs is None:
        kl_NT = jnp.zeros_like(logprobs)
    else:
        kl_NT = kl_divergence(logprobs, clean(ref_logprobs), config.kl_estimator)
    entropy_NT = jnp.zeros_like(logprobs) if entropy is None else clean(entropy)
    loss_NT = pg_NT + config.kl_coef * kl_NT - config.entropy_coef * entropy_NT

    loss = averaged_over * _aggregate(loss_NT * tok, tok, config, window, axis_name)

    def token_mean(x_NT):
        return averaged_over * _share((x_NT * tok).sum(axis=1), window.num_tokens, axis_name)

    metrics = {
        "pg_loss": token_mean(pg_NT),
        "kl": token_mean(kl_NT),
        "entropy": token_mean(entropy_NT),
        "clip_fraction": token_mean(clipped_NT.astype(jnp.float32)),
        "approx_kl": token_mean(0.5 * log_ratio**2),  # k2 of old vs current policy
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)
