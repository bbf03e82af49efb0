"""Per-token log-probabilities and entropies without materialising all [B, T, V] float32 logits at once.

Shape letters (the README's glossary): B batch rows, T positions, D model dim, V vocab, M flattened tokens
(B * T), J chunks, W tokens per chunk.

Tokens are cut into chunks of W; each chunk's [W, V] logits exist only inside a `jax.checkpoint`ed scan
body, so neither the forward nor the backward pass holds more than one chunk's logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32
DEFAULT_CHUNK_SIZE = 256  # Gemma 3 (V = 262,144): 256 x V float32 = 268 MB per chunk


def _chunk_stats(hidden_WD: jax.Array, targets_W: jax.Array, unembed_DV: jax.Array, temperature: float,
                 final_logit_softcap: float | None) -> tuple[jax.Array, jax.Array]:
    """(log p(target), entropy) for one chunk of tokens, in float32."""
    logits_WV = jnp.einsum("wd,dv->wv", hidden_WD, unembed_DV, preferred_element_type=_F32)
    if final_logit_softcap is not None:
        logits_WV = final_logit_softcap * jnp.tanh(logits_WV / final_logit_softcap)
    logits_WV = logits_WV / temperature
    lse_W = jax.nn.logsumexp(logits_WV, axis=-1)
    target_logit_W = jnp.take_along_axis(logits_WV, targets_W[:, None], axis=-1)[:, 0]
    probs_WV = jnp.exp(logits_WV - lse_W[:, None])
    entropy_W = lse_W - jnp.sum(probs_WV * logits_WV, axis=-1)
    return target_logit_W - lse_W, entropy_W


def token_logprobs(hidden_BTD: jax.Array, unembed_DV: jax.Array, targets_BT: jax.Array, *,
                   temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE,
                   final_logit_softcap: float | None = None,
                   compute_dtype: jnp.dtype | None = None) -> tuple[jax.Array, jax.Array]:
    """float32 (log-prob of each target, entropy of each position's distribution), both [B, T].

    Logits are soft-capped (if the model does), then divided by temperature, as the sampler does.
    `compute_dtype` (e.g. bfloat16): the vocabulary GEMM's inputs are cast to it inside each chunk, so
    the unembedding's gradient still sums over chunks in its own dtype; logits and softmax stay float32.
    """
    if not chunk_size > 0:
        raise ValueError(f"chunk_size: must be a positive int, got {chunk_size}")
    B, T, D = hidden_BTD.shape
    M = B * T
    W = min(chunk_size, M)
    J = -(-M // W)
    hidden_MD = hidden_BTD.reshape(M, D)
    targets_M = targets_BT.reshape(M).astype(jnp.int32)
    pad = J * W - M
    if pad:  # padded tokens are computed and dropped; their cotangent is zero
        hidden_MD = jnp.concatenate([hidden_MD, jnp.zeros((pad, D), hidden_MD.dtype)])
        targets_M = jnp.concatenate([targets_M, jnp.zeros((pad,), jnp.int32)])

    @jax.checkpoint  # recompute each chunk's logits in the backward pass instead of storing them
    def one_chunk(args):
        hidden_WD, targets_W = args
        unembed = unembed_DV
        if compute_dtype is not None:
            hidden_WD, unembed = hidden_WD.astype(compute_dtype), unembed_DV.astype(compute_dtype)
        return _chunk_stats(hidden_WD, targets_W, unembed, temperature, final_logit_softcap)

    logprobs_JW, entropy_JW = jax.lax.map(one_chunk, (hidden_MD.reshape(J, W, D), targets_M.reshape(J, W)))
    return logprobs_JW.reshape(-1)[:M].reshape(B, T), entropy_JW.reshape(-1)[:M].reshape(B, T)


def naive_token_logprobs(hidden_BTD: jax.Array, unembed_DV: jax.Array, targets_BT: jax.Array, *,
                         temperature: float = 1.0, final_logit_softcap: float | None = None):
    """Reference: the same quantities from the full [B, T, V] float32 logits (tests and benchmarks)."""
    logits_BTV = jnp.einsum("btd,dv->btv", hidden_BTD, unembed_DV, preferred_element_type=_F32)
    if final_logit_softcap is not None:
        logits_BTV = final_logit_softcap * jnp.tanh(logits_BTV / final_logit_softcap)
    logp_BTV = jax.nn.log_softmax(logits_BTV / temperature, axis=-1)
    logprobs_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    entropy_BT = -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)
    return logprobs_BT, entropy_BT


def sequence_logprobs(model, input_ids_BT: jax.Array, targets_BT: jax.Array, positions_BT: jax.Array | None = None,
                      segment_ids_BT: jax.Array | None = None, temperature: float = 1.0,
                      chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[jax.Array, jax.Array]:
    """Model forward then chunked log-probs of targets_BT (usually input ids shifted left) and entropies."""
    hidden_BTD = model.hidden_states(input_ids_BT, positions_BT, segment_ids_BT)
    return token_logprobs(hidden_BTD, model.unembed_DV(), targets_BT, temperature=temperature,
                          chunk_size=chunk_size, final_logit_softcap=model.config.final_logit_softcap)
