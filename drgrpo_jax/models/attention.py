"""Self-attention of a full (cache-free) forward: the reference (float32 [B, C, R, T, S] scores, memory quadratic
in length: the test oracle), a memory-linear blockwise kernel (online softmax; a FlashAttention-2 backward that
recomputes each block from the saved log-sum-exp; `blockwise_cross_attention` runs it for one context shard's
queries against the whole row's keys, models/context_parallel.py), and the dispatch that also picks cuDNN or TPU
splash.

Shape letters (docs/shape_letters.md): B rows, T query positions, S key positions, Q query heads, C key/value
heads, R query heads per kv head (Q = C * R), H head dim, J query blocks of W positions, key blocks of V = K * W.
Visibility is one rule for all (`self_attention_mask`); segment id 0 marks padding, which nobody sees and whose
own outputs nothing downstream reads. Attention sinks (GPT-OSS: `sinks_CR`, a learned logit per query head) join
every softmax's denominator and carry no value; the reference, blockwise and cached (kv_cache.attend_slots) paths
take them, the accelerator kernels refuse them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from drgrpo_jax.models.accelerator_attention import (
    SPLASH_BLOCK,
    cudnn_attention,
    cudnn_supported,
    splash_attention,
    splash_supported,
)
from drgrpo_jax.models.config import ATTENTION_IMPLS
from drgrpo_jax.models.gemm import is_half, matmul, matmul_nt, mm_tn
from drgrpo_jax.models.remat import name_attention

_F32 = jnp.float32
# Finite, so rows with no visible key (padding) give a uniform softmax instead of NaN.
MASKED = -1e30
# 128 query positions per block, against key blocks KEY_BLOCK_FACTOR = 2 times as wide: fewer loop trips and
# wider score GEMMs, while the block's [B, C, R, W, 2W] float32 temporaries still fit in cache (wider blocks
# fall out of it, narrower ones pay more loop trips; `benchmarks/attention.py --blocks` compares sizes).
DEFAULT_BLOCK_SIZE = 128
KEY_BLOCK_FACTOR = 2
# "auto" on CPU below this length keeps the reference: short rows' quadratic scores are small and one GEMM beats
# the block loop's overhead; from here on blockwise is faster and its memory stays linear (benchmarks/attention.py).
BLOCKWISE_MIN_LENGTH = 256


def self_attention_mask(q_seg_BT: jax.Array, k_seg_BS: jax.Array, q_idx_T: jax.Array, k_idx_S: jax.Array,
                        q_pos_BT: jax.Array, k_pos_BS: jax.Array, window: int | None) -> jax.Array:
    """bool [B, T, S]: same non-zero segment, causal by index, and (with a window) q_pos - k_pos < window."""
    visible_BTS = (q_seg_BT[:, :, None] == k_seg_BS[:, None, :]) & (q_seg_BT[:, :, None] != 0)
    visible_BTS = visible_BTS & (q_idx_T[:, None] >= k_idx_S[None, :])[None]
    if window is not None:
        visible_BTS = visible_BTS & (q_pos_BT[:, :, None] - k_pos_BS[:, None, :] < window)
    return visible_BTS


def sink_softmax(scores_BCRTS: jax.Array, sinks_CR: jax.Array | None) -> jax.Array:
    """float32 softmax over the last (key) axis, with each head's sink logit (if any) in the denominator."""
    if sinks_CR is None:
        return jax.nn.softmax(scores_BCRTS, axis=-1)
    sink_BCRT1 = jnp.broadcast_to(sinks_CR.astype(_F32)[None, :, :, None, None], (*scores_BCRTS.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([scores_BCRTS, sink_BCRT1], axis=-1), axis=-1)[..., :-1]


def reference_attention(q_BTQH: jax.Array, k_BSCH: jax.Array, v_BSCH: jax.Array, mask_BTS: jax.Array,
                        scale: float, dtype=None, sinks_Q: jax.Array | None = None) -> jax.Array:
    """Grouped-query softmax attention with a boolean visibility mask; scores in float32 (the oracle).

    A 16-bit `dtype` (mixed precision) runs its GEMMs in it with float32 accumulation (`_reference_low`).
    `sinks_Q`: attention sinks, one logit per query head.
    """
    C = k_BSCH.shape[2]
    sinks_CR = None if sinks_Q is None else sinks_Q.reshape(C, -1)
    if dtype is not None and is_half(dtype):
        return _reference_low(q_BTQH, k_BSCH, v_BSCH, mask_BTS, scale, dtype, sinks_CR)
    B, T, Q, H = q_BTQH.shape
    q_BTCRH = q_BTQH.reshape(B, T, C, Q // C, H)
    scores_BCRTS = jnp.einsum("btcrh,bsch->bcrts", q_BTCRH, k_BSCH, preferred_element_type=_F32) * scale
    scores_BCRTS = jnp.where(mask_BTS[:, None, None, :, :], scores_BCRTS, MASKED)
    probs_BCRTS = sink_softmax(scores_BCRTS, sinks_CR).astype(v_BSCH.dtype)
    out_BTCRH = jnp.einsum("bcrts,bsch->btcrh", probs_BCRTS, v_BSCH, preferred_element_type=_F32)
    return out_BTCRH.reshape(B, T, Q, H).astype(q_BTQH.dtype)


def _reference_low(q_BTQH: jax.Array, k_BSCH: jax.Array, v_BSCH: jax.Array, mask_BTS: jax.Array, scale: float,
                   dtype, sinks_CR: jax.Array | None) -> jax.Array:
    """`reference_attention` with Q K^T and P V (and their backward GEMMs: models/gemm.py) in `dtype`.

    Each kv head's R query heads are one GEMM's R * T rows, every operand row-major [B, C, rows, cols]: the
    layout XLA's CPU hands to its fast bf16 GEMM. Mask, softmax and the probabilities' gradient stay float32.
    """
    B, T, Q, H = q_BTQH.shape
    S, C = k_BSCH.shape[1:3]
    R = Q // C
    q_BCMH = q_BTQH.reshape(B, T, C, R, H).transpose(0, 2, 3, 1, 4).reshape(B, C, R * T, H)
    k_BCSH, v_BCSH = k_BSCH.transpose(0, 2, 1, 3), v_BSCH.transpose(0, 2, 1, 3)
    scores_BCRTS = matmul_nt(q_BCMH, k_BCSH, dtype).reshape(B, C, R, T, S) * scale
    scores_BCRTS = jnp.where(mask_BTS[:, None, None, :, :], scores_BCRTS, MASKED)
    probs_BCMS = sink_softmax(scores_BCRTS, sinks_CR).reshape(B, C, R * T, S)
    out_BCRTH = matmul(probs_BCMS, v_BCSH, dtype).reshape(B, C, R, T, H)
    return out_BCRTH.transpose(0, 3, 1, 2, 4).reshape(B, T, Q, H).astype(q_BTQH.dtype)


# ---------------------------------------------------------------- blockwise (flash-style) attention


def _to_blocks(x_BT: jax.Array, W: int, J: int, fill=0) -> jax.Array:
    """[B, T, ...] padded to J * W positions and cut into blocks: [J, B, W, ...]."""
    B, T = x_BT.shape[:2]
    pad = [(0, 0), (0, J * W - T)] + [(0, 0)] * (x_BT.ndim - 2)
    x_BJW = jnp.pad(x_BT, pad, constant_values=fill).reshape(B, J, W, *x_BT.shape[2:])
    return jnp.moveaxis(x_BJW, 1, 0)


def _block_mask(qseg_JBW, qpos_JBW, qidx_JW, kseg_JBV, kpos_JBV, i, j, window: int | None) -> jax.Array:
    """bool [B, W, V]: which keys of key block j (V wide, indices j * V + v) the queries of query block i (W wide,
    indices qidx_JW[i]) see."""
    V = kseg_JBV.shape[2]
    return self_attention_mask(qseg_JBW[i], kseg_JBV[j], qidx_JW[i], j * V + jnp.arange(V), qpos_JBW[i],
                               kpos_JBV[j], window)


def _scores(q_BCRWH, k_BCVH, mask_BWV, scale: float) -> jax.Array:
    """float32 scores [B, C, R, W, V] with hidden keys at -inf."""
    s_BCRWV = jnp.einsum("bcrwh,bcsh->bcrws", q_BCRWH, k_BCVH, preferred_element_type=_F32) * scale
    return jnp.where(mask_BWV[:, None, None], s_BCRWV, -jnp.inf)


def _key_block_ends(qidx_JW, V: int, num_key_blocks: int) -> jax.Array:
    """int32 [J]: how many key blocks (V wide) query block i's latest query reaches (causality bounds the loops)."""
    return jnp.minimum(qidx_JW.max(axis=1) // V + 1, num_key_blocks)


def _flash_forward(q_JBCRWH, k_JBCVH, v_JBCVH, qseg_JBW, qpos_JBW, qidx_JW, kseg_JBV, kpos_JBV, sinks_CR,
                   scale: float, window: int | None, out_dtype):
    """Output [J, B, C, R, W, H] in `out_dtype` and float32 log-sum-exp [J, B, C, R, W] (0 where nothing is seen).

    Queries at the indices `qidx_JW` (rising), keys in blocks V wide at indices j * V + v. Sinks start each row's
    running max and sum (m = sink, l = 1), so they count in the denominator and the log-sum-exp, and a row that
    sees nothing gets 0.
    """
    J, B, C, R, W, H = q_JBCRWH.shape
    ends_J = _key_block_ends(qidx_JW, k_JBCVH.shape[3], k_JBCVH.shape[0])

    def query_block(i):
        q_BCRWH = q_JBCRWH[i]

        def key_block(j, carry):
            mask_BWV = _block_mask(qseg_JBW, qpos_JBW, qidx_JW, kseg_JBV, kpos_JBV, i, j, window)

            def update(carry):
                m_BCRW, l_BCRW, acc_BCRWH = carry
                s_BCRWV = _scores(q_BCRWH, k_JBCVH[j], mask_BWV, scale)
                m_new = jnp.maximum(m_BCRW, s_BCRWV.max(-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p_BCRWV = jnp.exp(s_BCRWV - m_safe[..., None])
                correction = jnp.exp(m_BCRW - m_safe)
                pv_BCRWH = jnp.einsum("bcrws,bcsh->bcrwh", p_BCRWV.astype(v_JBCVH.dtype), v_JBCVH[j],
                                      preferred_element_type=_F32)
                return m_new, l_BCRW * correction + p_BCRWV.sum(-1), acc_BCRWH * correction[..., None] + pv_BCRWH

            # Blocks nobody in them sees (windows, padding) cost one mask; causality bounds the loop.
            return jax.lax.cond(mask_BWV.any(), update, lambda c: c, carry)

        # Built `_like` the queries: inside a shard_map (models/context_parallel.py) they vary as the updates do.
        zeros_BCRW = jnp.zeros_like(q_BCRWH[..., 0], _F32)
        if sinks_CR is None:
            m0_BCRW, l0_BCRW = zeros_BCRW - jnp.inf, zeros_BCRW
        else:
            m0_BCRW, l0_BCRW = zeros_BCRW + sinks_CR.astype(_F32)[None, :, :, None], zeros_BCRW + 1.0
        init = (m0_BCRW, l0_BCRW, jnp.zeros_like(q_BCRWH, _F32))
        m_BCRW, l_BCRW, acc_BCRWH = jax.lax.fori_loop(0, ends_J[i], key_block, init)
        seen = l_BCRW > 0
        out_BCRWH = jnp.where(seen[..., None], acc_BCRWH / jnp.where(seen, l_BCRW, 1.0)[..., None], 0.0)
        lse_BCRW = jnp.where(seen, m_BCRW + jnp.log(jnp.where(seen, l_BCRW, 1.0)), 0.0)
        return out_BCRWH.astype(out_dtype), lse_BCRW

    return jax.lax.map(query_block, jnp.arange(J))


def _flash_backward(q_JBCRWH, k_JBCVH, v_JBCVH, qseg_JBW, qpos_JBW, qidx_JW, kseg_JBV, kpos_JBV, delta_JBCRW,
                    lse_JBCRW, do_JBCRWH, scale: float, window: int | None):
    """(dq, dk, dv) in float32, each block's probabilities recomputed from the log-sum-exp (FlashAttention-2).

    `delta_JBCRW`: each row's sum of dO * O. The GEMMs run in q's dtype (the compute dtype), accumulating in float32.
    Key block j is seen from the first query block whose latest index reaches it (indices rise).
    """
    J = q_JBCRWH.shape[0]
    V = k_JBCVH.shape[3]
    last_J = qidx_JW.max(axis=1)
    dtype = q_JBCRWH.dtype
    do_JBCRWH = do_JBCRWH.astype(dtype)

    def key_block(dq_JBCRWH, j):
        k_BCVH, v_BCVH = k_JBCVH[j], v_JBCVH[j]

        def query_block(i, carry):
            dk_BCVH, dv_BCVH, dq_JBCRWH = carry
            mask_BWV = _block_mask(qseg_JBW, qpos_JBW, qidx_JW, kseg_JBV, kpos_JBV, i, j, window)

            def grads(dkv):
                dk_BCVH, dv_BCVH = dkv
                q_BCRWH, do_BCRWH = q_JBCRWH[i], do_JBCRWH[i]
                s_BCRWV = _scores(q_BCRWH, k_BCVH, mask_BWV, scale)
                p_BCRWV = jnp.exp(s_BCRWV - lse_JBCRW[i][..., None])  # hidden keys: exp(-inf) = 0
                dv_BCVH = dv_BCVH + _key_grad(p_BCRWV.astype(dtype), do_BCRWH)
                dp_BCRWV = jnp.einsum("bcrwh,bcsh->bcrws", do_BCRWH, v_BCVH, preferred_element_type=_F32)
                ds_BCRWV = (p_BCRWV * (dp_BCRWV - delta_JBCRW[i][..., None]) * scale).astype(dtype)
                dq_BCRWH = jnp.einsum("bcrws,bcsh->bcrwh", ds_BCRWV, k_BCVH, preferred_element_type=_F32)
                dk_BCVH = dk_BCVH + _key_grad(ds_BCRWV, q_BCRWH)
                return dk_BCVH, dv_BCVH, dq_BCRWH

            def skip(dkv):
                return *dkv, jnp.zeros_like(q_JBCRWH[0], _F32)

            dk_BCVH, dv_BCVH, dq_BCRWH = jax.lax.cond(mask_BWV.any(), grads, skip, (dk_BCVH, dv_BCVH))
            # The dq update stays outside the cond: a cond carrying the whole dq copied it per block.
            dq_JBCRWH = jax.lax.dynamic_update_index_in_dim(dq_JBCRWH, dq_JBCRWH[i] + dq_BCRWH, i, 0)
            return dk_BCVH, dv_BCVH, dq_JBCRWH

        zeros_BCVH = jnp.zeros_like(k_BCVH, _F32)
        first = jnp.sum(last_J < j * V, dtype=jnp.int32)
        dk_BCVH, dv_BCVH, dq_JBCRWH = jax.lax.fori_loop(first, J, query_block, (zeros_BCVH, zeros_BCVH, dq_JBCRWH))
        return dq_JBCRWH, (dk_BCVH, dv_BCVH)

    dq_JBCRWH, (dk_JBCVH, dv_JBCVH) = jax.lax.scan(key_block, jnp.zeros_like(q_JBCRWH, _F32),
                                                   jnp.arange(k_JBCVH.shape[0]))
    return dq_JBCRWH, dk_JBCVH, dv_JBCVH


def _key_grad(x_BCRWV, y_BCRWH) -> jax.Array:
    """float32 [B, C, V, H]: sum over (R, W) of x[.., v] y[.., h], the gradient of keys or values.

    Through row-major copies (`mm_tn`) in float32 too: XLA's CPU GEMM is slower on the einsum's transposed operand
    than the copy costs.
    """
    B, C, R, W, V = x_BCRWV.shape
    return mm_tn(x_BCRWV.reshape(B, C, R * W, V), y_BCRWH.reshape(B, C, R * W, -1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11))
def _flash(q_JBCRWH, k_JBCVH, v_JBCVH, qseg_JBW, qpos_JBW, qidx_JW, kseg_JBV, kpos_JBV, sinks_CR, scale, window,
           dtype):
    """Blocked attention output in q's dtype, its GEMMs in `dtype`; the custom backward keeps only the inputs
    (in `dtype`), output and log-sum-exp. `sinks_CR`: attention sinks or None."""
    return _flash_fwd(q_JBCRWH, k_JBCVH, v_JBCVH, qseg_JBW, qpos_JBW, qidx_JW, kseg_JBV, kpos_JBV, sinks_CR, scale,
                      window, dtype)[0]


def _flash_fwd(q_JBCRWH, k_JBCVH, v_JBCVH, qseg_JBW, qpos_JBW, qidx_JW, kseg_JBV, kpos_JBV, sinks_CR, scale,
               window, dtype):
    """Output and residuals (inputs in `dtype`, sinks, output, float32 log-sum-exp)."""
    out_dtype = q_JBCRWH.dtype
    q_JBCRWH, k_JBCVH, v_JBCVH = q_JBCRWH.astype(dtype), k_JBCVH.astype(dtype), v_JBCVH.astype(dtype)
    visibility = (qseg_JBW, qpos_JBW, qidx_JW, kseg_JBV, kpos_JBV)
    out_JBCRWH, lse_JBCRW = _flash_forward(q_JBCRWH, k_JBCVH, v_JBCVH, *visibility, sinks_CR, scale, window,
                                           out_dtype)
    # Named, so a rematerialised layer that saves the attention (models/remat.py) keeps them and skips this forward.
    out_JBCRWH, lse_JBCRW = name_attention(out_JBCRWH), name_attention(lse_JBCRW)
    return out_JBCRWH, (q_JBCRWH, k_JBCVH, v_JBCVH, visibility, sinks_CR, out_JBCRWH, lse_JBCRW)


def _flash_bwd(scale, window, dtype, residuals, do_JBCRWH):
    """Cotangents of q, k, v in the output's dtype (theirs) and of the sinks in theirs; none for the integer
    segment ids and positions.

    A sink's probability is exp(sink - lse) and its value 0, so its gradient is -sum exp(sink - lse) * delta.
    """
    q_JBCRWH, k_JBCVH, v_JBCVH, visibility, sinks_CR, out_JBCRWH, lse_JBCRW = residuals
    delta_JBCRW = jnp.sum(do_JBCRWH.astype(_F32) * out_JBCRWH.astype(_F32), axis=-1)
    dq, dk, dv = _flash_backward(q_JBCRWH, k_JBCVH, v_JBCVH, *visibility, delta_JBCRW, lse_JBCRW, do_JBCRWH, scale,
                                 window)
    dsinks_CR = None
    if sinks_CR is not None:
        p_sink_JBCRW = jnp.exp(sinks_CR.astype(_F32)[None, None, :, :, None] - lse_JBCRW)
        dsinks_CR = (-jnp.sum(p_sink_JBCRW * delta_JBCRW, axis=(0, 1, 4))).astype(sinks_CR.dtype)
    cast = do_JBCRWH.dtype
    return dq.astype(cast), dk.astype(cast), dv.astype(cast), None, None, None, None, None, dsinks_CR


_flash.defvjp(_flash_fwd, _flash_bwd)


def block_widths(T: int, block_size: int | None = None) -> tuple[int, int]:
    """(W, V): the query and key block widths of `blockwise_attention` at length T (the plan sizes its temporaries
    by them). `block_size` None reads DEFAULT_BLOCK_SIZE when called (tests shrink it)."""
    W = min(T, block_size or DEFAULT_BLOCK_SIZE)
    return W, KEY_BLOCK_FACTOR * W if T > W else W


def blockwise_attention(q_BTQH: jax.Array, k_BSCH: jax.Array, v_BSCH: jax.Array, positions_BT: jax.Array,
                        segment_ids_BT: jax.Array, *, scale: float, window: int | None = None,
                        block_size: int | None = None, dtype=None, sinks_Q: jax.Array | None = None) -> jax.Array:
    """Self-attention [B, T, Q, H] in blocks of W = min(T, block_size): memory linear in T, same rule as the reference.

    Block widths by `block_widths` (keys KEY_BLOCK_FACTOR * W wide when T > W; T padded to whole key blocks).

    `dtype` (None: q's): the GEMMs' operand dtype, accumulating in float32 (bfloat16 under mixed precision).
    Float32 softmax statistics whatever the input dtype; kv heads are never repeated (queries are grouped
    [B, C, R, W, H]); queries that see nothing (padding) get 0 and pass no gradient. `sinks_Q`: attention sinks,
    one logit per query head.
    """
    T = q_BTQH.shape[1]
    if k_BSCH.shape[1] != T:
        raise ValueError(f"blockwise_attention: self-attention only, got {T} queries and {k_BSCH.shape[1]} keys")
    W, V = block_widths(T, block_size)
    queries = -(-T // V) * V  # T padded to whole key blocks
    return _blockwise(q_BTQH, k_BSCH, v_BSCH, positions_BT, segment_ids_BT, jnp.arange(queries), positions_BT,
                      segment_ids_BT, W, V, scale=scale, window=window, dtype=dtype, sinks_Q=sinks_Q)


def blockwise_cross_attention(q_BTQH: jax.Array, k_BSCH: jax.Array, v_BSCH: jax.Array, q_positions_BT: jax.Array,
                              q_segment_ids_BT: jax.Array, q_indices_T: jax.Array, k_positions_BS: jax.Array,
                              k_segment_ids_BS: jax.Array, *, scale: float, window: int | None = None,
                              block_size: int | None = None, dtype=None, sinks_Q: jax.Array | None = None
                              ) -> jax.Array:
    """`blockwise_attention` of T queries at the rising sequence indices `q_indices_T` against all S keys of their
    sequence (key s at index s): one context shard's queries (models/context_parallel.py) and the gathered keys.
    Causality by index as always: a query's loop stops at the last key block it can see."""
    T, S = q_BTQH.shape[1], k_BSCH.shape[1]
    W = min(T, block_size or DEFAULT_BLOCK_SIZE)
    V = KEY_BLOCK_FACTOR * W if S > W else W
    queries = -(-T // W) * W
    # Padding queries repeat the last index: the indices keep rising and the loops' bounds stay tight.
    idx_T = jnp.pad(q_indices_T.astype(jnp.int32), (0, queries - T), mode="edge")
    return _blockwise(q_BTQH, k_BSCH, v_BSCH, q_positions_BT, q_segment_ids_BT, idx_T, k_positions_BS,
                      k_segment_ids_BS, W, V, scale=scale, window=window, dtype=dtype, sinks_Q=sinks_Q)


def _blockwise(q_BTQH, k_BSCH, v_BSCH, q_pos_BT, q_seg_BT, q_idx_P, k_pos_BS, k_seg_BS, W: int, V: int, *,
               scale: float, window: int | None, dtype, sinks_Q) -> jax.Array:
    """The blocked kernel on queries padded to P = len(q_idx_P) (a multiple of W) and keys padded to whole blocks
    of V; out [B, T, Q, H]."""
    B, T, Q, H = q_BTQH.shape
    S, C = k_BSCH.shape[1:3]
    J, Jk = q_idx_P.shape[0] // W, -(-S // V)
    q_JBWCRH = _to_blocks(q_BTQH.reshape(B, T, C, Q // C, H), W, J)
    q_JBCRWH = q_JBWCRH.transpose(0, 1, 3, 4, 2, 5)
    k_JBCVH = _to_blocks(k_BSCH, V, Jk).transpose(0, 1, 3, 2, 4)
    v_JBCVH = _to_blocks(v_BSCH, V, Jk).transpose(0, 1, 3, 2, 4)
    # padded positions: segment 0, never seen
    qseg_JBW, kseg_JBV = _to_blocks(q_seg_BT.astype(jnp.int32), W, J), _to_blocks(k_seg_BS.astype(jnp.int32), V, Jk)
    qpos_JBW, kpos_JBV = _to_blocks(q_pos_BT.astype(jnp.int32), W, J), _to_blocks(k_pos_BS.astype(jnp.int32), V, Jk)
    low = q_BTQH.dtype if dtype is None else jnp.dtype(dtype)
    sinks_CR = None if sinks_Q is None else sinks_Q.reshape(C, Q // C)
    out_JBCRWH = _flash(q_JBCRWH, k_JBCVH, v_JBCVH, qseg_JBW, qpos_JBW, q_idx_P.reshape(J, W), kseg_JBV, kpos_JBV,
                        sinks_CR, float(scale), window, low)
    out_BJWQH = out_JBCRWH.transpose(1, 0, 4, 2, 3, 5).reshape(B, J * W, Q, H)
    return out_BJWQH[:, :T]


# ---------------------------------------------------------------- dispatch


def choose_impl(impl: str, *, seq_len: int, dtype, head_dim: int, backend: str | None = None,
                sinks: bool = False) -> str:
    """The implementation `attention` runs: `impl` itself, or for "auto" the best one the backend supports.

    auto: GPU -> cuDNN for bf16/fp16 (else blockwise); TPU -> splash where T is a multiple of 128 (else
    blockwise); CPU -> blockwise from BLOCKWISE_MIN_LENGTH keys, the reference below. With attention `sinks`
    (which neither accelerator kernel takes) auto keeps to blockwise and the reference. An explicit kernel that
    cannot run these shapes raises rather than falling back silently.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention: {impl!r} is not supported (supported: {ATTENTION_IMPLS})")
    if sinks and impl in ("cudnn", "splash"):
        raise ValueError(f"attention: {impl} has no attention sinks (GPT-OSS); use blockwise or reference")
    backend = "cpu" if sinks else backend or jax.default_backend()
    if impl == "cudnn" and not cudnn_supported(dtype, head_dim):
        raise ValueError(f"attention: cudnn needs bfloat16/float16 and head_dim % 8 == 0, <= 128 (256 on Hopper); "
                         f"got {jnp.dtype(dtype).name}, head_dim {head_dim}")
    if impl == "splash" and not splash_supported(seq_len):
        raise ValueError(f"attention: splash needs a length multiple of {SPLASH_BLOCK}, got {seq_len}")
    if impl != "auto":
        return impl
    if backend == "gpu":
        return "cudnn" if cudnn_supported(dtype, head_dim) else "blockwise"
    if backend == "tpu":
        return "splash" if splash_supported(seq_len) else "blockwise"
    return "blockwise" if seq_len >= BLOCKWISE_MIN_LENGTH else "reference"


def attention(q_BTQH: jax.Array, k_BSCH: jax.Array, v_BSCH: jax.Array, positions_BT: jax.Array,
              segment_ids_BT: jax.Array, *, scale: float, window: int | None = None, impl: str = "auto",
              dtype=None, sinks_Q: jax.Array | None = None) -> jax.Array:
    """Self-attention [B, T, Q, H] of a full forward by `choose_impl(impl, ...)`; `window` is static (or None).

    `dtype` (None: q's): the GEMM operands (mixed precision's bfloat16). It also picks the kernel, so float32
    activations under bfloat16 compute still get cuDNN's 16-bit kernel on a GPU (its operands cast, its output
    cast back); the reference and blockwise kernels cast inside their GEMMs. `sinks_Q`: attention sinks (GPT-OSS).
    """
    B, T, Q, H = q_BTQH.shape
    compute = q_BTQH.dtype if dtype is None else jnp.dtype(dtype)
    chosen = choose_impl(impl, seq_len=T, dtype=compute, head_dim=H, sinks=sinks_Q is not None)
    if chosen == "blockwise":
        return blockwise_attention(q_BTQH, k_BSCH, v_BSCH, positions_BT, segment_ids_BT, scale=scale, window=window,
                                   dtype=dtype, sinks_Q=sinks_Q)
    if chosen in ("cudnn", "splash"):
        kernel = cudnn_attention if chosen == "cudnn" else splash_attention
        q, k, v = (x.astype(compute) for x in (q_BTQH, k_BSCH, v_BSCH))
        return kernel(q, k, v, positions_BT, segment_ids_BT, scale=scale, window=window).astype(q_BTQH.dtype)
    idx_T = jnp.arange(T)
    mask_BTS = self_attention_mask(segment_ids_BT, segment_ids_BT, idx_T, idx_T, positions_BT, positions_BT, window)
    return reference_attention(q_BTQH, k_BSCH, v_BSCH, mask_BTS, scale, dtype, sinks_Q)
