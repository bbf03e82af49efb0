"""The blockwise kernel on one context shard's queries (an early and a late chunk of the row) against the whole
row's keys equals the reference attention's rows at those indices, values and gradients, with windows, sinks,
grouped queries and packed segments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drgrpo_jax.models import attention as attn
from drgrpo_jax.models.context_parallel import zigzag_order

B, S, C, R, H = 2, 24, 2, 2, 8
WAYS = 3  # 24 tokens: six chunks of 4, shard d holds chunks d and 5 - d


def _row():
    """q, k, v of a whole row, and its positions and segment ids (two packed sequences and trailing padding)."""
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, S, C * R, H))
    k, v = (jax.random.normal(key, (B, S, C, H)) for key in keys[1:3])
    segments = np.ones((B, S), np.int32)
    segments[0, 10:] = 2
    segments[1, 20:] = 0
    positions = np.where(segments[0] == 2, np.arange(S) - 10, np.arange(S))[None].repeat(B, 0)
    return q, k, v, jnp.asarray(positions), jnp.asarray(segments), jax.random.normal(keys[3], (C * R,))


@pytest.mark.parametrize("shard", range(WAYS))
@pytest.mark.parametrize("window, sinks", [(None, False), (5, True)])
def test_one_shards_queries_against_the_whole_row_equal_the_reference(shard, window, sinks):
    q, k, v, positions, segments, sinks_Q = _row()
    sinks_Q = sinks_Q if sinks else None
    idx = zigzag_order(S, WAYS)[shard * 8:(shard + 1) * 8]  # the shard's slots of the layout

    def reference(q, k, v, sinks_Q):
        mask = attn.self_attention_mask(segments, segments, jnp.arange(S), jnp.arange(S), positions, positions,
                                        window)
        return attn.reference_attention(q, k, v, mask, 0.3, sinks_Q=sinks_Q)[:, idx]

    def shard_queries(q, k, v, sinks_Q):
        return attn.blockwise_cross_attention(q[:, idx], k, v, positions[:, idx], segments[:, idx], jnp.asarray(idx),
                                              positions, segments, scale=0.3, window=window, block_size=2,
                                              sinks_Q=sinks_Q)

    seen = np.asarray(segments[:, idx] != 0)
    np.testing.assert_allclose(np.asarray(shard_queries(q, k, v, sinks_Q))[seen],
                               np.asarray(reference(q, k, v, sinks_Q))[seen], atol=1e-5)
    cotangent = jax.random.normal(jax.random.key(9), (B, 8, C * R, H)) * jnp.asarray(seen)[..., None, None]
    argnums = (0, 1, 2, 3) if sinks else (0, 1, 2)
    want = jax.grad(lambda *a: jnp.sum(reference(*a) * cotangent), argnums)(q, k, v, sinks_Q)
    got = jax.grad(lambda *a: jnp.sum(shard_queries(*a) * cotangent), argnums)(q, k, v, sinks_Q)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
