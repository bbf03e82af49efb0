"""Per-token log-probabilities and entropies without materialising all [B, T, V] float32 logits at once.

Shape letters (docs/shape_letters.md): B batch rows, T positions, D model dim, V vocab, M flattened tokens
(B * T), J chunks, W tokens per chunk.

Tokens are cut into chunks of W; each chunk's [W, V] logits exist only inside a `jax.checkpoint`ed scan
body, so neither the forward nor the backward pass holds more than one chunk's logits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from drgrpo_jax.models.gemm import mm, mm_nt, mm_tn, row_major

_F32 = jnp.float32
DEFAULT_CHUNK_SIZE = 128  # Gemma 3 (V = 262,144): 128 x V float32 = 134 MB per chunk


def _vocab_logits(hidden_WD: jax.Array, unembed_DV: jax.Array, low_VD: jax.Array) -> jax.Array:
    """float32 logits [W, V] from `low_VD`, the table cast to the compute dtype once for all chunks ([V, D]:
    the layout both the forward and the backward's dx GEMM read in place); `unembed_DV`, the table itself,
    only receives the gradient, float32 from the accumulator."""
    return _vocab(hidden_WD, unembed_DV, low_VD, hidden_WD.dtype, unembed_DV.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _vocab(hidden_WD, unembed_DV, low_VD, hidden_dtype, unembed_dtype):
    """`_vocab_logits`; the gradients come back in `hidden_dtype` and `unembed_dtype`."""
    return mm_nt(hidden_WD.astype(low_VD.dtype), low_VD)


def _vocab_fwd(hidden_WD, unembed_DV, low_VD, hidden_dtype, unembed_dtype):
    """Logits and the GEMM's operands."""
    hidden_WD = hidden_WD.astype(low_VD.dtype)
    return mm_nt(hidden_WD, low_VD), (hidden_WD, low_VD)


def _vocab_bwd(hidden_dtype, unembed_dtype, residuals, dlogits_WV):
    """(dhidden, dunembed [D, V]) from the logits' cotangent rounded to the compute dtype, as torch.autocast
    does; none for the cast table (it carries no gradient of its own)."""
    hidden_WD, low_VD = residuals
    dlogits_WV = dlogits_WV.astype(low_VD.dtype)
    return (mm(dlogits_WV, low_VD).astype(hidden_dtype), mm_tn(hidden_WD, dlogits_WV).astype(unembed_dtype), None)


_vocab.defvjp(_vocab_fwd, _vocab_bwd)


def _chunk_stats(logits_WV: jax.Array, targets_W: jax.Array, temperature: float,
                 final_logit_softcap: float | None) -> tuple[jax.Array, jax.Array]:
    """(log p(target), entropy) for one chunk of tokens' float32 logits."""
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
                   compute_dtype: jnp.dtype | None = None,
                   unembed_sum: jax.Array | None = None, sum_layout: str = "DV", context: int = 1
                   ) -> tuple[jax.Array, jax.Array]:
    """float32 (log-prob of each target, entropy of each position's distribution), both [B, T].

    Logits are soft-capped (if the model does), then divided by temperature, as the sampler does.
    `compute_dtype` (e.g. bfloat16): the vocabulary GEMM and its backward's two run in it accumulating in
    float32 (`_vocab_logits`: the float32 logits' cotangent is rounded to it, as torch.autocast does), and the
    unembedding's gradient sums over chunks in its own dtype; logits and softmax stay float32.
    `unembed_sum` (float32, `sum_layout` "DV" like unembed_DV or "VD" like a tied embedding): the table's gradient
    goes there instead, added chunk by chunk in place (`d/d(unembed_sum) = unembed_sum + d/d(unembed_DV)`, none for
    unembed_DV; models/grad_sums.py), so no [D, V] gradient exists beside the sum.
    `context` (C > 1: T split over the mesh's context axis, models/context_parallel.py): each chunk takes W tokens
    of every row's every shard ([J, B * C * W] chunks), so the loop runs over each device's own tokens.
    """
    if not chunk_size > 0:
        raise ValueError(f"chunk_size: must be a positive int, got {chunk_size}")
    B, T, D = hidden_BTD.shape
    if context > 1:
        return _by_shard(hidden_BTD, targets_BT, context, functools.partial(
            token_logprobs, unembed_DV=unembed_DV, temperature=temperature, final_logit_softcap=final_logit_softcap,
            compute_dtype=compute_dtype, unembed_sum=unembed_sum, sum_layout=sum_layout), chunk_size)
    M = B * T
    W = min(chunk_size, M)
    J = -(-M // W)
    hidden_MD = hidden_BTD.reshape(M, D)
    targets_M = targets_BT.reshape(M).astype(jnp.int32)
    pad = J * W - M
    if pad:  # padded tokens are computed and dropped; their cotangent is zero
        hidden_MD = jnp.concatenate([hidden_MD, jnp.zeros((pad, D), hidden_MD.dtype)])
        targets_M = jnp.concatenate([targets_M, jnp.zeros((pad,), jnp.int32)])

    if unembed_sum is not None:
        stats = functools.partial(_chunk_stats, temperature=temperature, final_logit_softcap=final_logit_softcap)
        if sum_layout not in ("DV", "VD"):
            raise ValueError(f"sum_layout: 'DV' or 'VD', got {sum_layout!r}")
        logprobs_JW, entropy_JW = _logprobs_into_sum(stats, compute_dtype, sum_layout == "VD",
                                                     hidden_MD.reshape(J, W, D), unembed_DV, targets_M.reshape(J, W),
                                                     unembed_sum)
        return logprobs_JW.reshape(-1)[:M].reshape(B, T), entropy_JW.reshape(-1)[:M].reshape(B, T)

    # Mixed precision: the table is cast once, outside the chunk loop, as [V, D] (a tied embedding's own
    # layout); cast per chunk, XLA transposed the whole table again for every chunk.
    low_VD = None if compute_dtype is None else jax.lax.stop_gradient(row_major(unembed_DV.T.astype(compute_dtype)))

    @jax.checkpoint  # recompute each chunk's logits in the backward pass instead of storing them
    def one_chunk(args):
        hidden_WD, targets_W = args
        if compute_dtype is None:
            logits_WV = jnp.einsum("wd,dv->wv", hidden_WD, unembed_DV, preferred_element_type=_F32)
        else:
            logits_WV = _vocab_logits(hidden_WD, unembed_DV, low_VD)
        return _chunk_stats(logits_WV, targets_W, temperature, final_logit_softcap)

    logprobs_JW, entropy_JW = jax.lax.map(one_chunk, (hidden_MD.reshape(J, W, D), targets_M.reshape(J, W)))
    return logprobs_JW.reshape(-1)[:M].reshape(B, T), entropy_JW.reshape(-1)[:M].reshape(B, T)


def _by_shard(hidden_BTD, targets_BT, context: int, per_chunks, chunk_size: int):
    """`per_chunks` (token_logprobs) over [J, B * C * W] chunks cut inside each of the C shards of every row:
    [B, T] log-probs and entropies."""
    B, T, D = hidden_BTD.shape
    P = T // context  # a shard's tokens (the context layout has whole shards)
    W = min(chunk_size, P)
    J = -(-P // W)

    def chunked(x_BT, fill):  # [B, T, ...] -> [J, B * C * W, ...], padded inside each shard
        x_GP = x_BT.reshape(B * context, P, *x_BT.shape[2:])
        x_GP = jnp.pad(x_GP, [(0, 0), (0, J * W - P)] + [(0, 0)] * (x_BT.ndim - 2), constant_values=fill)
        x_JGW = jnp.moveaxis(x_GP.reshape(B * context, J, W, *x_BT.shape[2:]), 1, 0)
        return x_JGW.reshape(J, B * context * W, *x_BT.shape[2:])

    def back(y_JM):  # [J, B * C * W] -> [B, T]
        y_GJW = jnp.moveaxis(y_JM.reshape(J, B * context, W), 0, 1).reshape(B * context, J * W)
        return y_GJW[:, :P].reshape(B, T)

    # One row per chunk: token_logprobs' own chunks (W' = B * C * W) are then exactly these.
    logprobs_JM, entropy_JM = per_chunks(chunked(hidden_BTD, 0), targets_BT=chunked(targets_BT, 0),
                                         chunk_size=B * context * W)
    return back(logprobs_JM), back(entropy_JM)


def _chunk_logits(hidden_WD, table_VD, low):
    """float32 logits [W, V] of one chunk: hidden @ table^T, in `low` (None: float32) accumulating in float32."""
    if low is None:
        return jnp.einsum("wd,vd->wv", hidden_WD, table_VD, preferred_element_type=_F32)
    return mm_nt(hidden_WD.astype(low), table_VD)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _logprobs_into_sum(stats, low, sum_is_VD, hidden_JWD, unembed_DV, targets_JW, unembed_sum):
    """(log-probs, entropies) [J, W] of every chunk; the backward adds the table's gradient into unembed_sum."""
    table_VD = _table(unembed_DV, low)
    return jax.lax.map(lambda c: stats(_chunk_logits(c[0], table_VD, low), c[1]), (hidden_JWD, targets_JW))


def _table(unembed_DV, low):
    """The table as [V, D] (a tied embedding's own layout, read in place by both GEMMs), in `low` if set."""
    return unembed_DV.T if low is None else row_major(unembed_DV.T.astype(low))


def _logprobs_into_sum_fwd(stats, low, sum_is_VD, hidden_JWD, unembed_DV, targets_JW, unembed_sum):
    table_VD = _table(unembed_DV, low)
    out = jax.lax.map(lambda c: stats(_chunk_logits(c[0], table_VD, low), c[1]), (hidden_JWD, targets_JW))
    return out, (hidden_JWD, table_VD, targets_JW, unembed_sum)


def _logprobs_into_sum_bwd(stats, low, sum_is_VD, residuals, cts):
    """Each chunk's logits recomputed, its hidden states' cotangent stacked and its table gradient added to the
    sum, the loop's carry: one [V, D] GEMM result at a time beside it."""
    hidden_JWD, table_VD, targets_JW, sum_ = residuals

    def chunk_back(sum_, chunk):
        hidden_WD, targets_W, ct_logprobs_W, ct_entropy_W = chunk
        _, pullback = jax.vjp(lambda logits: stats(logits, targets_W), _chunk_logits(hidden_WD, table_VD, low))
        (dlogits_WV,) = pullback((ct_logprobs_W, ct_entropy_W))
        if low is None:
            dhidden_WD = jnp.einsum("wv,vd->wd", dlogits_WV, table_VD, preferred_element_type=_F32)
            dtable = (jnp.einsum("wv,wd->vd", dlogits_WV, hidden_WD, preferred_element_type=_F32) if sum_is_VD
                      else jnp.einsum("wd,wv->dv", hidden_WD, dlogits_WV, preferred_element_type=_F32))
        else:  # the logits' cotangent rounded to the compute dtype, as torch.autocast does
            dlogits_WV, low_hidden_WD = dlogits_WV.astype(low), hidden_WD.astype(low)
            dhidden_WD = mm(dlogits_WV, table_VD)
            dtable = mm_tn(dlogits_WV, low_hidden_WD) if sum_is_VD else mm_tn(low_hidden_WD, dlogits_WV)
        return sum_ + dtable.astype(sum_.dtype), dhidden_WD.astype(hidden_WD.dtype)

    sum_, dhidden_JWD = jax.lax.scan(chunk_back, sum_, (hidden_JWD, targets_JW, *cts))
    return dhidden_JWD, None, None, sum_


_logprobs_into_sum.defvjp(_logprobs_into_sum_fwd, _logprobs_into_sum_bwd)


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
