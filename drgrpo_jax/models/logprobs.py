"""Per-token log-probabilities and entropies without materialising all [B, T, V] float32 logits at once.

Einsum letters: B batch, T length, D model dim, V vocab, M flattened tokens (B * T), C chunks, Q tokens per chunk.

Tokens are cut into chunks of Q; each chunk's [Q, V] logits exist only inside a `jax.checkpoint`ed scan
body, so neither the forward nor the backward pass holds more than one chunk's logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32
DEFAULT_CHUNK_SIZE = 256  # Gemma 3 (V = 262,144): 256 x V float32 = 268 MB per chunk


def _chunk_stats(hidden_QD: jax.Array, targets_Q: jax.Array, unembed_DV: jax.Array, temperature: float,
                 final_logit_softcap: float | None) -> tuple[jax.Array, jax.Array]:
    """(log p(target), entropy) for one chunk of tokens, in float32."""
    logits_QV = jnp.einsum("qd,dv->qv", hidden_QD, unembed_DV, preferred_element_type=_F32)
    if final_logit_softcap is not None:
        logits_QV = final_logit_softcap * jnp.tanh(logits_QV / final_logit_softcap)
    logits_QV = logits_QV / temperature
    lse_Q = jax.nn.logsumexp(logits_QV, axis=-1)
    target_logit_Q = jnp.take_along_axis(logits_QV, targets_Q[:, None], axis=-1)[:, 0]
    probs_QV = jnp.exp(logits_QV - lse_Q[:, None])
    entropy_Q = lse_Q - jnp.sum(probs_QV * logits_QV, axis=-1)
    return target_logit_Q - lse_Q, entropy_Q


def token_logprobs(hidden_BTD: jax.Array, unembed_DV: jax.Array, targets_BT: jax.Array, *,
                   temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE,
                   final_logit_softcap: float | None = None) -> tuple[jax.Array, jax.Array]:
    """float32 (log-prob of each target, entropy of each position's distribution), both [B, T].

    Logits are soft-capped (if the model does), then divided by temperature, as the sampler does.
    """
    if not chunk_size > 0:
        raise ValueError(f"chunk_size: must be a positive int, got {chunk_size}")
    B, T, D = hidden_BTD.shape
    M = B * T
    Q = min(chunk_size, M)
    C = -(-M // Q)
    hidden_MD = hidden_BTD.reshape(M, D)
    targets_M = targets_BT.reshape(M).astype(jnp.int32)
    pad = C * Q - M
    if pad:  # padded tokens are computed and dropped; their cotangent is zero
        hidden_MD = jnp.concatenate([hidden_MD, jnp.zeros((pad, D), hidden_MD.dtype)])
        targets_M = jnp.concatenate([targets_M, jnp.zeros((pad,), jnp.int32)])

    @jax.checkpoint  # recompute each chunk's logits in the backward pass instead of storing them
    def one_chunk(args):
        hidden_QD, targets_Q = args
        return _chunk_stats(hidden_QD, targets_Q, unembed_DV, temperature, final_logit_softcap)

    logprobs_CQ, entropy_CQ = jax.lax.map(one_chunk, (hidden_MD.reshape(C, Q, D), targets_M.reshape(C, Q)))
    return logprobs_CQ.reshape(-1)[:M].reshape(B, T), entropy_CQ.reshape(-1)[:M].reshape(B, T)


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
