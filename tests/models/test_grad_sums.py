"""Gradients summed where they are made (models/grad_sums.py): the same sums as `sums + grad`, without a second
whole gradient in memory."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from drgrpo_jax.models.config import RuntimeOptions
from drgrpo_jax.models.grad_sums import into_sums, scan_layers, summing_into
from drgrpo_jax.models.logprobs import token_logprobs
from drgrpo_jax.models.transformer import Transformer

from support.tiny_models import tiny_decoder_config

pytestmark = pytest.mark.heavy  # compiles the model's forward and backward


def _model(dtype, **options):
    config = dataclasses.replace(tiny_decoder_config(), **options)
    runtime = RuntimeOptions(remat="full")
    return nnx.split(Transformer(config, rngs=nnx.Rngs(0), dtype=dtype, runtime=runtime), nnx.Param)


def _loss(graphdef, params, tokens_BT, weights_BTD, sums=None, unembed_by_caller=False):
    layer_sums = unembed = None
    if sums is not None:
        params, layer_sums, unembed = into_sums(params, sums, unembed_by_caller=unembed_by_caller)
    model = nnx.merge(graphdef, params)
    hidden_BTD = model.hidden_states(tokens_BT, grad_sums=layer_sums)
    weighted = (hidden_BTD.astype(jnp.float32) * weights_BTD).sum()
    if unembed_by_caller:  # the trainer's way: the chunked log-probs add the table's gradient into its sum
        sum_, layout = unembed if unembed is not None else (None, "DV")
        logprobs_BT, _ = token_logprobs(hidden_BTD, model.unembed_DV(), tokens_BT, chunk_size=4, unembed_sum=sum_,
                                        sum_layout=layout)
        return weighted + logprobs_BT.mean()
    logits_BTV = model.logits_from_hidden(hidden_BTD)  # reads the (tied) embedding a second time
    return weighted + jax.nn.logsumexp(logits_BTV, axis=-1).mean()


@pytest.mark.parametrize("dtype, rtol, tied, unembed_by_caller", [
    (jnp.float32, 1e-6, False, False), (jnp.float32, 1e-6, True, False), (jnp.bfloat16, 1e-2, False, False),
    (jnp.float32, 1e-6, True, True), (jnp.float32, 1e-6, False, True)])
def test_the_sums_take_the_params_gradient_added_to_them(dtype, rtol, tied, unembed_by_caller):
    """Every weight's, the tied embedding's two uses (gather and unembedding) included, also when the unembedding
    adds into its sum itself (`token_logprobs(unembed_sum=...)`)."""
    graphdef, params = _model(dtype, tie_word_embeddings=tied)
    rng = np.random.default_rng(0)
    tokens_BT = jnp.asarray(rng.integers(0, 64, (2, 9)), jnp.int32)
    weights_BTD = jnp.asarray(rng.normal(size=(2, 9, 32)), jnp.float32)
    sums = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)

    expected = jax.jit(jax.grad(_loss, argnums=1), static_argnums=(0, 5))(
        graphdef, params, tokens_BT, weights_BTD, None, unembed_by_caller)
    to_params, to_sums = jax.jit(jax.grad(_loss, argnums=(1, 4)), static_argnums=(0, 5))(
        graphdef, params, tokens_BT, weights_BTD, sums, unembed_by_caller)

    paths_and_got = jax.tree_util.tree_flatten_with_path(to_sums)[0]
    for (path, got), s, g in zip(paths_and_got, jax.tree.leaves(sums), jax.tree.leaves(expected), strict=True):
        name, g = jax.tree_util.keystr(path), np.asarray(g, np.float32)
        assert got.dtype == jnp.float32, name
        np.testing.assert_allclose(got, np.asarray(s) + g, rtol=rtol, atol=rtol * float(np.abs(g).max()),
                                   err_msg=name)
    assert all(not np.asarray(g).any() for g in jax.tree.leaves(to_params)), "params get no gradient of their own"
    assert any(np.asarray(g).any() for g in jax.tree.leaves(expected))


def test_the_layer_sums_are_added_to_in_place():
    """Two micro-batches: `sums + grad` holds the layers' whole gradient beside the sums; the scan's sums do not."""
    graphdef, params = _model(jnp.float32, hidden_size=64, intermediate_size=2048, num_layers=8)
    tokens_MBT = jnp.zeros((2, 1, 4), jnp.int32)
    weights_BTD = jnp.ones((1, 4, 64), jnp.float32)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def plain(params, sums):
        def add(sums, tokens_BT):
            return jax.tree.map(jnp.add, sums, jax.grad(_loss, argnums=1)(graphdef, params, tokens_BT,
                                                                          weights_BTD)), None
        return jax.lax.scan(add, sums, tokens_MBT)[0]

    def in_place(params, sums):
        def add(sums, tokens_BT):
            return jax.grad(_loss, argnums=4)(graphdef, params, tokens_BT, weights_BTD, sums), None
        return jax.lax.scan(add, sums, tokens_MBT)[0]

    def temp_bytes(fn):
        return jax.jit(fn, donate_argnums=1).lower(params, zeros).compile().memory_analysis().temp_size_in_bytes

    layers = sum(x.nbytes for x in jax.tree.leaves(params["blocks"]))
    summed = (jax.tree.leaves(jax.jit(fn)(params, zeros)) for fn in (in_place, plain))
    for got, want in zip(*summed, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    # In place, the temporaries hold a layer or two (its gradient, its weights sliced out), never the whole stack's.
    assert temp_bytes(in_place) < 0.5 * layers < layers < temp_bytes(plain), (temp_bytes(in_place), layers,
                                                                              temp_bytes(plain))


def test_summing_into_sends_the_gradient_to_the_sum():
    grads = jax.grad(lambda p, s: (summing_into(p, s) ** 2).sum(), argnums=(0, 1))(jnp.arange(3.0), jnp.ones(3))
    np.testing.assert_array_equal(grads[1], 1.0 + 2.0 * np.arange(3.0))
    np.testing.assert_array_equal(grads[0], 0.0)


def test_only_full_remat_sums_in_place():
    params = {"w": jnp.ones((2, 3))}
    with pytest.raises(ValueError, match="remat 'full', not 'none'"):
        scan_layers(lambda x, layer: x * layer[0]["w"], jnp.ones(3), params, None, "none", params)
