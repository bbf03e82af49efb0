"""Chunked log-probs and entropy equal the full-logits computation, values and gradients, with less memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.logprobs import naive_token_logprobs, sequence_logprobs, token_logprobs
from drgrpo_jax.models.transformer import Transformer

pytestmark = pytest.mark.heavy  # model forwards compiled per chunking


def _inputs(B=3, T=37, D=16, V=101, seed=0):
    """Random hidden states, output projection and targets."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k1, (B, T, D)), 0.5 * jax.random.normal(k2, (D, V)),
            jax.random.randint(k3, (B, T), 0, V))


@pytest.mark.parametrize("temperature,softcap,chunk", [(1.0, None, 16), (0.7, None, 5), (1.3, 2.0, 128)])
def test_values_match_naive(temperature, softcap, chunk):
    hidden, unembed, targets = _inputs()
    got = token_logprobs(hidden, unembed, targets, temperature=temperature, chunk_size=chunk,
                         final_logit_softcap=softcap)
    want = naive_token_logprobs(hidden, unembed, targets, temperature=temperature, final_logit_softcap=softcap)
    for g, w in zip(got, want):
        assert g.dtype == jnp.float32 and g.shape == targets.shape
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)


def test_entropy_against_numpy_oracle():
    hidden, unembed, targets = _inputs(B=1, T=4, V=7)
    logits = np.asarray(hidden, np.float64) @ np.asarray(unembed, np.float64) / 0.5
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    logprobs, entropy = token_logprobs(hidden, unembed, targets, temperature=0.5, chunk_size=3)
    np.testing.assert_allclose(entropy, -(p * np.log(p)).sum(-1), atol=1e-5)
    np.testing.assert_allclose(logprobs, np.log(np.take_along_axis(p, np.asarray(targets)[..., None], -1))[..., 0],
                               atol=1e-5)


def test_gradients_match_naive():
    hidden, unembed, targets = _inputs()
    weights = jax.random.normal(jax.random.key(1), targets.shape)

    def objective(fn, hidden, unembed):
        logprobs, entropy = fn(hidden, unembed, targets, temperature=0.8)
        return jnp.sum(weights * logprobs) + 0.1 * jnp.sum(entropy)

    chunked = jax.grad(lambda h, u: objective(
        lambda *a, **k: token_logprobs(*a, **k, chunk_size=8), h, u), argnums=(0, 1))(hidden, unembed)
    naive = jax.grad(lambda h, u: objective(naive_token_logprobs, h, u), argnums=(0, 1))(hidden, unembed)
    for g, w in zip(chunked, naive):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout, compute_dtype, tol", [("DV", None, 1e-5), ("VD", None, 1e-5),
                                                        ("VD", jnp.bfloat16, 2e-2)])
def test_unembed_sum_takes_the_table_gradient_added_to_it(layout, compute_dtype, tol):
    """d/d(sum) = sum + d/d(table) in the sum's layout (a tied embedding's [V, D] or lm_head's [D, V]); the
    values and the hidden states' gradient as without the sum."""
    hidden, unembed, targets = _inputs()
    weights = jax.random.normal(jax.random.key(1), targets.shape)
    sum_ = jax.random.normal(jax.random.key(2), unembed.shape if layout == "DV" else unembed.T.shape)

    def objective(hidden, unembed, sum_=None):
        logprobs, entropy = token_logprobs(hidden, unembed, targets, temperature=0.8, chunk_size=8,
                                           compute_dtype=compute_dtype, unembed_sum=sum_, sum_layout=layout)
        return jnp.sum(weights * logprobs) + 0.1 * jnp.sum(entropy)

    want_value, (want_dhidden, want_dunembed) = jax.value_and_grad(objective, argnums=(0, 1))(hidden, unembed)
    value, (dhidden, dunembed, dsum) = jax.jit(jax.value_and_grad(objective, argnums=(0, 1, 2)))(
        hidden, unembed, sum_)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(dhidden, want_dhidden, atol=tol, rtol=tol)
    np.testing.assert_array_equal(dunembed, 0)  # its gradient went to the sum
    want_dsum = sum_ + (want_dunembed if layout == "DV" else want_dunembed.T)
    np.testing.assert_allclose(dsum, want_dsum, atol=tol, rtol=tol)


def test_chunked_backward_never_holds_full_logits():
    B, T, D, V = 4, 256, 32, 4096
    hidden, unembed, targets = _inputs(B, T, D, V)
    full_logits_bytes = B * T * V * 4

    def loss(fn):
        return jax.jit(jax.grad(lambda h, u: jnp.sum(fn(h, u, targets)[0]), argnums=(0, 1)))

    chunked = loss(lambda h, u, t: token_logprobs(h, u, t, chunk_size=64)).lower(hidden, unembed).compile()
    naive = loss(naive_token_logprobs).lower(hidden, unembed).compile()
    chunked_temp = chunked.memory_analysis().temp_size_in_bytes
    naive_temp = naive.memory_analysis().temp_size_in_bytes
    assert naive_temp >= full_logits_bytes  # the reference does hold [B, T, V] float32
    assert chunked_temp < full_logits_bytes / 4, (chunked_temp, full_logits_bytes)


def test_sequence_logprobs_match_model_logits():
    config = DecoderConfig(family="gemma3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=True,
                         layer_types=("sliding_attention", "full_attention"), sliding_window=3,
                         final_logit_softcap=4.0)
    model = Transformer(config, rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(2), (2, 9), 0, 64)
    targets = jnp.roll(ids, -1, axis=1)
    # Each side one jitted program (eagerly, the forward's operations were ~60 programs of their own)
    logprobs, entropy = jax.jit(lambda m, x, y: sequence_logprobs(m, x, y, temperature=0.9))(model, ids, targets)
    logp = jax.jit(lambda m, x: jax.nn.log_softmax(m(x) / 0.9, axis=-1))(model, ids)
    np.testing.assert_allclose(logprobs, jnp.take_along_axis(logp, targets[..., None], -1)[..., 0], atol=1e-5)
    np.testing.assert_allclose(entropy, -jnp.sum(jnp.exp(logp) * logp, -1), atol=1e-5)


def test_bad_chunk_size_is_an_error():
    hidden, unembed, targets = _inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(hidden, unembed, targets, chunk_size=0)
