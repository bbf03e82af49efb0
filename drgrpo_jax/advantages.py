"""Advantage estimators: pure functions of [P, G] rewards (P prompts, G samples each).

Every function takes an optional `valid: bool[P, G]` (False = a padding slot added for
static shapes): padding slots are ignored by the statistics and get advantage 0. Inputs
are cast to float32; outputs are float32. A group whose valid rewards are all equal gets
exactly 0 (not a rounding residue that std-scaling would blow up).
"""

from __future__ import annotations

from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp

__all__ = [
    "dr_grpo", "grpo", "rloo", "gdpo", "gdpo_combined", "group_std", "whiten", "whiten_stats", "zero_signal_groups",
]

AxisName = str | Sequence[str] | None


def _prepare(rewards: jax.Array, valid: jax.Array | None, rank: int) -> tuple[jax.Array, jax.Array]:
    """Checks shapes and returns (float32 rewards, bool valid) with padding zeroed."""
    chex.assert_rank(rewards, rank)
    rewards = jnp.asarray(rewards, jnp.float32)
    if valid is None:
        valid = jnp.ones(rewards.shape[:2], bool)
    chex.assert_shape(valid, rewards.shape[:2])
    valid = jnp.asarray(valid, bool)
    mask = valid if rank == 2 else valid[..., None]
    return jnp.where(mask, rewards, 0.0), valid


def _group_stats(x_PG: jax.Array, valid_PG: jax.Array):
    """Per-group (count, mean, unbiased std, collapsed) over the valid slots, keepdims."""
    count = valid_PG.sum(axis=1, keepdims=True).astype(jnp.float32)
    mean = x_PG.sum(axis=1, keepdims=True) / jnp.maximum(count, 1.0)
    centred = jnp.where(valid_PG, x_PG - mean, 0.0)
    var = (centred**2).sum(axis=1, keepdims=True) / jnp.maximum(count - 1.0, 1.0)
    # Exact collapse test: floating-point mean of equal values can be off by an ulp.
    hi = jnp.where(valid_PG, x_PG, -jnp.inf).max(axis=1, keepdims=True)
    lo = jnp.where(valid_PG, x_PG, jnp.inf).min(axis=1, keepdims=True)
    collapsed = hi <= lo
    return count, mean, jnp.sqrt(var), collapsed


def dr_grpo(rewards: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """Dr.GRPO: `r - group_mean` (no division by the group's standard deviation)."""
    rewards, valid = _prepare(rewards, valid, 2)
    _, mean, _, collapsed = _group_stats(rewards, valid)
    return jnp.where(valid & ~collapsed, rewards - mean, 0.0)


def grpo(rewards: jax.Array, valid: jax.Array | None = None, *, eps: float = 1e-6) -> jax.Array:
    """GRPO: `(r - mean) / (std + eps)`, std with ddof=1; groups of fewer than 2 get 0."""
    rewards, valid = _prepare(rewards, valid, 2)
    count, mean, std, collapsed = _group_stats(rewards, valid)
    keep = valid & ~collapsed & (count >= 2)
    return jnp.where(keep, (rewards - mean) / (std + eps), 0.0)


def rloo(rewards: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """RLOO: `r_i - mean_{j != i} r_j` over the valid slots; groups of one get 0."""
    rewards, valid = _prepare(rewards, valid, 2)
    count, _, _, collapsed = _group_stats(rewards, valid)
    total = rewards.sum(axis=1, keepdims=True)
    leave_one_out = (total - rewards) / jnp.maximum(count - 1.0, 1.0)
    keep = valid & ~collapsed & (count >= 2)
    return jnp.where(keep, rewards - leave_one_out, 0.0)


def gdpo(
    components: jax.Array,
    weights: jax.Array | Sequence[float],
    valid: jax.Array | None = None,
    *,
    eps: float = 1e-4,
    axis_name: AxisName = None,
) -> jax.Array:
    """GDPO: per-component group z-scores, weighted sum over K, then batch whitening.

    components: [P, G, K]; weights: [K]. Each component is standardised within its group
    (ddof=1, + eps; a component constant in a group contributes 0), the weighted sum is
    whitened over every valid slot of the batch (ddof=1, + eps). With `axis_name`, the
    batch statistics are psum-reduced over that mesh axis, so a sharded batch gives the
    same advantages as the whole batch. A group with no signal (its combined advantage is
    identically 0) stays exactly 0: the batch mean it would be shifted by is 0 but for
    rounding, since every group's z-scores sum to 0.
    """
    combined, valid = gdpo_combined(components, weights, valid, eps=eps), _prepare(components, valid, 3)[1]
    signal = valid & ~_group_stats(combined, valid)[3]
    return jnp.where(signal, whiten(combined, valid, eps=eps, axis_name=axis_name), 0.0)


def gdpo_combined(
    components: jax.Array, weights: jax.Array | Sequence[float], valid: jax.Array | None = None, *, eps: float = 1e-4
) -> jax.Array:
    """GDPO before whitening: the weighted sum of per-component group z-scores, [P, G, K] -> [P, G].

    Float32 with care: two components that cancel (e.g. exact negatives after standardising,
    like correctness and 1 - correctness at equal weights) leave only a rounding residue,
    which batch whitening would blow up to +-1. A group where at least two components vary
    and the combined values spread no more than their float32 rounding bound
    (`_ROUNDING_ULPS` ulps of every term, inputs included) is therefore set to exactly 0, as
    float64 arithmetic on the same float32 inputs would give to within that bound.
    """
    components, valid = _prepare(components, valid, 3)
    weights = jnp.asarray(weights, jnp.float32)
    chex.assert_shape(weights, components.shape[2:])
    z_PGK, bound_PGK = jax.vmap(lambda c: _group_zscore(c, valid, eps), in_axes=2, out_axes=2)(components)
    combined = (z_PGK * weights[None, None, :]).sum(axis=2)
    varying_P1 = (bound_PGK[:, :1, :] > 0).sum(axis=2)
    tolerance_P1 = (bound_PGK[:, :1, :] * jnp.abs(weights)[None, None, :]).sum(axis=2)
    hi = jnp.where(valid, combined, -jnp.inf).max(axis=1, keepdims=True)
    lo = jnp.where(valid, combined, jnp.inf).min(axis=1, keepdims=True)
    cancelled = (varying_P1 >= 2) & (hi - lo <= tolerance_P1)
    return jnp.where(valid & ~cancelled, combined, 0.0)


_ROUNDING_ULPS = 16.0  # generous: centring, the sqrt and the division each round once or twice


def _group_zscore(x_PG: jax.Array, valid_PG: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """(z-scores, their float32 rounding bound broadcast over G; 0 where the component is constant)."""
    count, mean, std, collapsed = _group_stats(x_PG, valid_PG)
    keep = valid_PG & ~collapsed & (count >= 2)
    z = jnp.where(keep, (x_PG - mean) / (std + eps), 0.0)
    # An input rounded to float32 is off by ~ulp(max|x|); after centring and dividing that
    # is ulp(max|x|) / std in z units, plus the rounding of z itself.
    magnitude = jnp.where(valid_PG, jnp.abs(x_PG), 0.0).max(axis=1, keepdims=True)
    largest_z = jnp.abs(z).max(axis=1, keepdims=True)
    ulp = jnp.finfo(jnp.float32).eps * _ROUNDING_ULPS
    bound = jnp.where(~collapsed & (count >= 2), ulp * (magnitude / (std + eps) + largest_z), 0.0)
    return z, jnp.broadcast_to(bound, x_PG.shape)


def zero_signal_groups(advantages_PG: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """bool [P]: groups whose valid advantages are all equal (no learning signal; empty groups too)."""
    x_PG, valid_PG = _prepare(advantages_PG, valid, 2)
    return _group_stats(x_PG, valid_PG)[3][:, 0]


def group_std(rewards: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """Each group's standard deviation (ddof=1) over its valid slots, as [P, 1]."""
    rewards, valid = _prepare(rewards, valid, 2)
    return _group_stats(rewards, valid)[2]


def whiten_stats(
    x: jax.Array, valid: jax.Array | None = None, *, axis_name: AxisName = None
) -> tuple[jax.Array, jax.Array]:
    """(mean, unbiased std) over the valid slots of the whole batch, psum-reduced over `axis_name`."""
    x_PG, valid_PG = _prepare(x, valid, 2)

    def total(v):
        return v if axis_name is None else jax.lax.psum(v, axis_name)

    count = total(valid_PG.sum().astype(jnp.float32))
    mean = total(jnp.where(valid_PG, x_PG, 0.0).sum()) / jnp.maximum(count, 1.0)
    centred = jnp.where(valid_PG, x_PG - mean, 0.0)
    var = total((centred**2).sum()) / jnp.maximum(count - 1.0, 1.0)
    return mean, jnp.sqrt(var)


def whiten(x: jax.Array, valid: jax.Array | None = None, *, eps: float = 1e-6, axis_name: AxisName = None) -> jax.Array:
    """Batch whitening over valid slots (ddof=1, + eps); statistics psum-reduced over `axis_name`."""
    x_PG, valid_PG = _prepare(x, valid, 2)
    mean, std = whiten_stats(x_PG, valid_PG, axis_name=axis_name)
    count = valid_PG.sum().astype(jnp.float32)
    count = count if axis_name is None else jax.lax.psum(count, axis_name)
    return jnp.where(valid_PG & (count >= 2), (x_PG - mean) / (std + eps), 0.0)
