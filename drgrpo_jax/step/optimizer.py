"""AdamW for the training step: warmup then decay, after global-norm clipping, with float32 state.

`make_optimizer` returns optax's transformation (`init`, `update`: any optax code takes it) that also offers
`update_or_keep`, the same update applied to params and state per leaf in one pass, written over the donated
buffers in place: `update` then `apply_updates` then "keep the old where the window was skipped" would hold the
new moments beside the old ones, two more params-sized arrays at the point where the trainer's memory peaks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["AdamW", "in_float32", "make_optimizer"]


def make_optimizer(
    learning_rate: float,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    decay: str = "constant",
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    max_grad_norm: float | None = 1.0,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup then constant/cosine/linear decay, after global-norm clipping."""
    decay_steps = max(total_steps - warmup_steps, 1)
    after_warmup = {
        "constant": lambda: optax.constant_schedule(learning_rate),
        "cosine": lambda: optax.cosine_decay_schedule(learning_rate, decay_steps),
        "linear": lambda: optax.linear_schedule(learning_rate, 0.0, decay_steps),
    }
    if decay not in after_warmup:
        raise ValueError(f"optimizer.decay: unknown {decay!r}; choose one of {sorted(after_warmup)}")
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps) if warmup_steps else None
    schedule = (
        optax.join_schedules([warmup, after_warmup[decay]()], [warmup_steps]) if warmup else after_warmup[decay]()
    )
    clip = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []
    adamw = in_float32(optax.chain(*clip, optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)))
    optimizer = AdamW(adamw.init, adamw.update)
    optimizer.hyper = _Hyper(schedule, b1, b2, eps, weight_decay, max_grad_norm or None)
    return optimizer, schedule


@dataclasses.dataclass(frozen=True)
class _Hyper:
    schedule: optax.Schedule
    b1: float
    b2: float
    eps: float
    weight_decay: float
    max_grad_norm: float | None


class AdamW(optax.GradientTransformation):
    """`make_optimizer`'s transformation: optax's (clip, adamw) in float32, and `update_or_keep`."""

    hyper: _Hyper  # set by make_optimizer (a NamedTuple's subclass takes attributes, not fields)

    def update_or_keep(self, grads: Any, state: Any, params: Any, keep: jax.Array) -> tuple[Any, Any]:
        """(params, state) after `update` and `apply_updates` of `grads`, or both as they were where `keep`.

        optax's float operations, leaf by leaf (clipping scales by max_norm / norm: one rounding apart); the new
        moments overwrite the old in place and the step reads them back (where `keep`, the old ones, and the
        params stay), so no moment exists twice.
        """
        h = self.hyper
        adam, decay_state, schedule_state = state[-1]  # after the clip's EmptyState when clipping
        count = optax.safe_increment(adam.count)
        bias1, bias2 = 1 - h.b1**count, 1 - h.b2**count
        step_size = jnp.array(-1 * h.schedule(schedule_state.count), jnp.float32)
        clip = None
        if h.max_grad_norm:  # optax's (g / norm) * max_norm to within a rounding: a product XLA fuses into both
            g_norm = optax.tree.norm(grads)  # moments' loops; a quotient it computes once into a whole copy of g
            clip = jnp.where(g_norm < h.max_grad_norm, 1.0, h.max_grad_norm / g_norm).astype(jnp.float32)

        def leaf(g, mu, nu, p):
            g = g.astype(jnp.float32) if clip is None else g.astype(jnp.float32) * clip
            mu = jnp.where(keep, mu, (1 - h.b1) * g + h.b1 * mu)
            nu = jnp.where(keep, nu, (1 - h.b2) * (g * g) + h.b2 * nu)
            mu, nu = jax.lax.optimization_barrier((mu, nu))  # written, then read: not recomputed from the old
            p32 = p.astype(jnp.float32)
            u = (mu / bias1.astype(jnp.float32)) / (jnp.sqrt(nu / bias2.astype(jnp.float32) + 0.0) + h.eps)
            u = step_size * (u + h.weight_decay * p32)
            return jnp.where(keep, p, (p + u.astype(p.dtype)).astype(p.dtype)), mu, nu

        leaves, treedef = jax.tree.flatten(params)
        out = [leaf(*xs) for xs in zip(jax.tree.leaves(grads), jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu),
                                       leaves, strict=True)]
        new_params, mu, nu = (jax.tree.unflatten(treedef, [o[i] for o in out]) for i in range(3))
        adam = optax.ScaleByAdamState(count=jnp.where(keep, adam.count, count), mu=mu, nu=nu)
        schedule_state = optax.ScaleByScheduleState(
            count=jnp.where(keep, schedule_state.count, optax.safe_increment(schedule_state.count)))
        return new_params, (*state[:-1], (adam, decay_state, schedule_state))


def _to_float32(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def in_float32(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` with float32 state and arithmetic whatever the param dtype; updates come back in the param dtype.

    Adam's second moment of a bfloat16 run underflows and rounds (8 mantissa bits), so the moments,
    the clipping norm and the weight decay are float32; only the update is cast to each parameter's dtype.
    """

    def init(params):
        return inner.init(_to_float32(params))

    def update(grads, state, params=None):
        updates, state = inner.update(_to_float32(grads), state, None if params is None else _to_float32(params))
        like = grads if params is None else params
        return jax.tree.map(lambda u, p: u.astype(p.dtype), updates, like), state

    return optax.GradientTransformation(init, update)


