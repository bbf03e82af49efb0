"""Per-row token draws: temperature, top-k/top-p filtering and inverse-CDF sampling (pure, jittable).

Shape letters (docs/shape_letters.md): B rows, V vocab, J vocab chunks, W vocab ids per chunk.

Log-probabilities are those of the sampled token under softmax(logits / temperature) over the
whole vocabulary (before top-k/top-p truncation): the definition the trainer's
`drgrpo_jax.models.logprobs.token_logprobs` uses. A greedy row (temperature 0) reports
log-probs at temperature 1.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

_CDF_CHUNK = 256  # vocabulary chunk of the two-level inverse-CDF sampler


def _ordered_int32(x: jax.Array) -> jax.Array:
    """Maps float32 to int32 so that integer order equals float order (for exact bisection)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, jnp.int32(-2**31) - bits - 1, bits)


def _largest_threshold(keys_BV: jax.Array, enough: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Largest int32 t per row with enough(keys_BV >= t) true, by bisection over all int32 values."""
    lo = jnp.full(keys_BV.shape[:1], -2**31, jnp.int32)  # enough() holds here (everything kept)
    hi = jnp.full(keys_BV.shape[:1], 2**31 - 1, jnp.int32)

    def step(_, lo_hi):
        lo, hi = lo_hi
        # Midpoint rounded up, computed without int32 overflow.
        mid = (lo >> 1) + (hi >> 1) + ((lo & 1) | (hi & 1))
        ok = enough(keys_BV >= mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, step, (lo, hi))
    return lo


def filter_top_k_top_p(scaled_BV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """Sets logits outside each row's top-k, then outside its top-p nucleus, to -inf (ties kept).

    No sort: on CPU a sort over the vocabulary costs many times a decode step's sampling, so the k-th largest
    value and the nucleus threshold are found by bisection over the float bits instead.
    """
    keys_BV = _ordered_int32(scaled_BV)
    num_vocab = scaled_BV.shape[-1]
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, num_vocab), num_vocab)
    kth_B = _largest_threshold(keys_BV, lambda keep_BV: jnp.sum(keep_BV, axis=-1) >= k_B)
    after_k_BV = jnp.where(keys_BV >= kth_B[:, None], scaled_BV, -jnp.inf)
    probs_BV = jax.nn.softmax(after_k_BV, axis=-1)
    # Keep the smallest top set whose mass reaches top_p: the largest threshold that still has it.
    nucleus_B = _largest_threshold(
        keys_BV, lambda keep_BV: jnp.sum(jnp.where(keep_BV, probs_BV, 0.0), axis=-1) >= top_p_B)
    # top_p = 1 keeps everything (float rounding of the mass must not drop the tail), and any
    # threshold above the top token (rounding again) must still keep that token.
    nucleus_B = jnp.where(top_p_B >= 1, jnp.int32(-2**31), jnp.minimum(nucleus_B, jnp.max(keys_BV, axis=-1)))
    return jnp.where(keys_BV >= jnp.maximum(kth_B, nucleus_B)[:, None], scaled_BV, -jnp.inf)


def _inclusive_cumsum(x: jax.Array) -> jax.Array:
    """Cumulative sum over the last axis as a triangular matmul (XLA CPU's cumsum is much slower)."""
    size = x.shape[-1]
    upper_WW = jnp.triu(jnp.ones((size, size), x.dtype))
    return jnp.einsum("...i,ij->...j", x, upper_WW, precision=jax.lax.Precision.HIGHEST)


def sample_inverse_cdf(logits_BV: jax.Array, uniform_B: jax.Array) -> jax.Array:
    """Draws one token per row from softmax(logits_BV) by inverting its CDF at uniform_B in [0, 1).

    Two levels (chunk masses, then the chosen chunk) so the work is one pass over V and the
    randomness is one number per row (a Gumbel draw needs V random numbers per row, a costly pass of its own
    on CPU). Tokens of zero probability are never drawn.
    """
    return _sample_weights(jnp.exp(logits_BV - jnp.max(logits_BV, axis=-1, keepdims=True)), uniform_B)


def _sample_weights(weights_BV: jax.Array, uniform_B: jax.Array) -> jax.Array:
    """`sample_inverse_cdf` from unnormalised probabilities (the exp of max-shifted logits)."""
    num_rows, num_vocab = weights_BV.shape
    num_chunks = -(-num_vocab // _CDF_CHUNK)
    weights_BJW = jnp.pad(weights_BV, ((0, 0), (0, num_chunks * _CDF_CHUNK - num_vocab))).reshape(
        num_rows, num_chunks, _CDF_CHUNK)
    chunk_cdf_BJ = _inclusive_cumsum(jnp.sum(weights_BJW, axis=-1))
    target_B = uniform_B * chunk_cdf_BJ[:, -1]
    # First chunk whose cumulative mass exceeds the target (zero-mass chunks never exceed it).
    chunk_B = jnp.minimum(jnp.sum(chunk_cdf_BJ <= target_B[:, None], axis=-1), num_chunks - 1)
    before_B = jnp.take_along_axis(chunk_cdf_BJ, chunk_B[:, None], axis=-1)[:, 0] - jnp.take_along_axis(
        jnp.sum(weights_BJW, axis=-1), chunk_B[:, None], axis=-1)[:, 0]
    weights_BW = jnp.take_along_axis(weights_BJW, chunk_B[:, None, None], axis=1)[:, 0]
    within_BW = _inclusive_cumsum(weights_BW)
    offset_B = jnp.sum(within_BW <= (target_B - before_B)[:, None], axis=-1)
    # Rounding can put the target at the chunk's end: fall back to its last non-zero token.
    last_nonzero_B = _CDF_CHUNK - 1 - jnp.argmax(weights_BW[:, ::-1] > 0, axis=-1)
    offset_B = jnp.minimum(offset_B, last_nonzero_B)
    return (chunk_B * _CDF_CHUNK + offset_B).astype(jnp.int32)


def row_keys(seeds_B: jax.Array, streams_B: jax.Array, samples_B: jax.Array) -> jax.Array:
    """One key per row from (seed, stream, sample): a row's draws do not depend on its batch-mates."""
    def one(seed, stream, sample):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), sample)
    return jax.vmap(one)(seeds_B, streams_B, samples_B)


def sample_step(logits_BV: jax.Array, keys_B: jax.Array, step: jax.Array, temperature_B: jax.Array,
                top_k_B: jax.Array, top_p_B: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Picks one token per row and its log-prob under softmax(logits / temperature); temperature 0 = greedy.
    `step`: the draw's index, one for all rows or one per row [B]."""
    greedy_B = temperature_B <= 0
    temperature_B = jnp.where(greedy_B, 1.0, temperature_B)
    scaled_BV = logits_BV.astype(jnp.float32) / temperature_B[:, None]
    # One exp pass over [B, V] serves the log-probs and, unless a row filters, the draw.
    max_B1 = jnp.max(scaled_BV, axis=-1, keepdims=True)
    weights_BV = jnp.exp(scaled_BV - max_B1)
    logsumexp_B = max_B1[:, 0] + jnp.log(jnp.sum(weights_BV, axis=-1))
    needs_filter = jnp.any(((top_k_B > 0) | (top_p_B < 1)) & ~greedy_B)
    steps_B = jnp.broadcast_to(step, keys_B.shape)  # one step for all rows, or each row's own
    uniform_B = jax.vmap(lambda key, s: jax.random.uniform(jax.random.fold_in(key, s)))(keys_B, steps_B)
    sampled_B = jax.lax.cond(
        needs_filter,
        lambda: sample_inverse_cdf(filter_top_k_top_p(scaled_BV, top_k_B, top_p_B), uniform_B),
        lambda: _sample_weights(weights_BV, uniform_B))
    # The argmax is one more pass over [B, V]: skipped when no row is greedy.
    argmax_B = jax.lax.cond(jnp.any(greedy_B), lambda: jnp.argmax(logits_BV, axis=-1).astype(jnp.int32),
                            lambda: jnp.zeros_like(sampled_B))
    tokens_B = jnp.where(greedy_B, argmax_B, sampled_B)
    return tokens_B, jnp.take_along_axis(scaled_BV, tokens_B[:, None], axis=-1)[:, 0] - logsumexp_B
