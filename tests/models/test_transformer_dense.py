"""The projections' custom gradient (transformer.project) against autodiff of the plain einsum."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drgrpo_jax.models.transformer import project


def _einsum_project(x, w, in_dims):
    """Reference: the same contraction as one einsum, differentiated by JAX."""
    letters = "abcdefgh"
    x_in, w_out = letters[:in_dims], letters[in_dims:w.ndim]
    return jnp.einsum(f"BT{x_in},{x_in}{w_out}->BT{w_out}", x, w, preferred_element_type=jnp.float32)


@pytest.mark.parametrize("x_shape, w_shape, in_dims", [
    ((2, 3, 8), (8, 4, 5), 1),    # I < O: the weight gradient transposes x
    ((2, 3, 8), (8, 2, 3), 1),    # O < I: it transposes dy
    ((2, 3, 4, 5), (4, 5, 6), 2),  # o_proj's [N, H, D] weight
])
def test_project_matches_einsum_values_and_gradients(x_shape, w_shape, in_dims):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=x_shape), jnp.float32)
    w = jnp.asarray(rng.normal(size=w_shape), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=x_shape[:2] + w_shape[in_dims:]), jnp.float32)

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w, in_dims) * cotangent)

    np.testing.assert_allclose(project(x, w, in_dims), _einsum_project(x, w, in_dims), rtol=1e-6, atol=1e-6)
    ours = jax.jit(jax.grad(loss(project), argnums=(0, 1)))(x, w)
    reference = jax.grad(loss(_einsum_project), argnums=(0, 1))(x, w)
    for got, want in zip(ours, reference):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_project_keeps_bfloat16_dtypes():
    x = jnp.ones((2, 3, 8), jnp.bfloat16)
    w = jnp.full((8, 4), 0.5, jnp.bfloat16)
    y = project(x, w)
    dx, dw = jax.grad(lambda x, w: jnp.sum(project(x, w).astype(jnp.float32)), argnums=(0, 1))(x, w)
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16,) * 3
    np.testing.assert_array_equal(np.asarray(dw, np.float32), np.full((8, 4), 6.0))  # sum over B * T = 6 rows
