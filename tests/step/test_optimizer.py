"""make_optimizer's AdamW: `update_or_keep` is optax's update and apply_updates, in place, or nothing at all."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from drgrpo_jax.step.optimizer import make_optimizer


def _tree(rng, shapes=((5, 7), (3,)), dtypes=(jnp.float32, jnp.bfloat16)):
    return {f"w{i}": jnp.asarray(rng.normal(size=s), d) for i, (s, d) in enumerate(zip(shapes, dtypes))}


@pytest.mark.parametrize("max_grad_norm, weight_decay, warmup", [(None, 0.1, 2), (1.0, 0.0, 0), (0.01, 0.1, 3)])
def test_update_or_keep_is_optax_update_then_apply(max_grad_norm, weight_decay, warmup):
    """Bit for bit without clipping; clipping scales by max_norm / norm (optax: / norm * max_norm), one rounding
    apart. Where `keep`, params and state (counts included) are returned as they were."""
    rng = np.random.default_rng(0)
    optimizer, _ = make_optimizer(1e-2, total_steps=10, warmup_steps=warmup, decay="cosine",
                                  weight_decay=weight_decay, max_grad_norm=max_grad_norm)
    params = _tree(rng)
    state = optimizer.init(params)
    reference = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*optimizer.update(g, s, p)))
    fused = jax.jit(optimizer.update_or_keep)
    rtol = 0 if max_grad_norm is None else 1e-5
    for _ in range(4):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        want = reference(grads, state, params)
        got = fused(grads, state, params, jnp.bool_(False))
        assert jax.tree.structure(got) == jax.tree.structure(want)  # checkpoints stay loadable
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.dtype == w.dtype
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=rtol, atol=0)
        kept = fused(grads, state, params, jnp.bool_(True))
        for g, w in zip(jax.tree.leaves(kept), jax.tree.leaves((params, state))):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        params, state = want


def test_update_or_keep_overwrites_donated_moments_without_a_temporary_copy():
    """optax's update, apply and keep-where-skipped held the new moments beside the old (~2x the params)."""
    rng = np.random.default_rng(1)
    params = _tree(rng, shapes=((256, 256), (512, 128), (64,)), dtypes=(jnp.float32,) * 3)
    optimizer, _ = make_optimizer(1e-2, total_steps=10, weight_decay=0.1)
    state = optimizer.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))

    def temp_bytes(fn):
        compiled = jax.jit(fn, donate_argnums=(0, 1, 2)).lower(grads, state, params, jnp.bool_(False)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    def generic(g, s, p, keep):
        updates, new_state = optimizer.update(g, s, p)
        return (optax.tree.where(keep, p, optax.apply_updates(p, updates)), optax.tree.where(keep, s, new_state))

    assert temp_bytes(generic) >= param_bytes  # what it replaces
    assert temp_bytes(optimizer.update_or_keep) < 0.05 * param_bytes
