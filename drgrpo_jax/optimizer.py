"""AdamW for the training step: warmup then decay, after global-norm clipping, with float32 state.

Split from train_step.py (one concept per module); `drgrpo_jax.train_step` re-exports both names.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["in_float32", "make_optimizer"]


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
    adamw = optax.chain(*clip, optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return in_float32(adamw), schedule


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


