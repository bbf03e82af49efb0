"""The fused attention kernels that ship with JAX for accelerators: cuDNN flash attention (GPU) and Pallas splash
attention (TPU), each behind the visibility rule of `drgrpo_jax.models.attention` (which dispatches to them).

Shape letters as there: B rows, T query positions, S key positions, Q query heads, C kv heads, R = Q / C, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cudnn_supported(dtype, head_dim: int) -> bool:
    """cuDNN flash attention's constraints (jax._src.cudnn.fused_attention_stablehlo): 16-bit floats, H % 8 == 0,
    H <= 128 (<= 256 from Hopper, compute capability 9.0). Its even length (training with a bias, our mask) is
    `cudnn_attention`'s to meet."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or head_dim % 8:
        return False
    if head_dim <= 128:
        return True
    capability = getattr(jax.devices()[0], "compute_capability", "0.0")
    return head_dim <= 256 and tuple(int(x) for x in str(capability).split(".")) >= (9, 0)


def cudnn_attention(q_BTQH: jax.Array, k_BSCH: jax.Array, v_BSCH: jax.Array, positions_BT: jax.Array,
                    segment_ids_BT: jax.Array, *, scale: float, window: int | None = None) -> jax.Array:
    """`jax.nn.dot_product_attention(implementation="cudnn")` with the same visibility rule (GPU only).

    Causality and the window go to cuDNN as such (the window by index: q_pos - k_pos equals the index
    difference inside a segment when positions count up by one, as the trainer's do). Segments and padding go
    as a boolean [B, 1, T, S] mask, which JAX turns into an additive bias (and cuDNN's backward into a bias
    gradient of the same shape): [B, T, S] arrays per call, not per head and not kept as probabilities, but
    still quadratic (cuDNN's own padding mask only knows right-padded lengths, and the trainer's rows are
    left-padded; its packed layout with segment offsets is not public API).

    cuDNN trains with a bias only at even lengths, and the trainer's forward is U + T - 1 long (odd for even
    budgets): an odd length gets one padding position at the end (segment 0, seen by nothing), cut off after.
    """
    del positions_BT
    T = q_BTQH.shape[1]
    extra = T % 2
    if extra:
        q_BTQH, k_BSCH, v_BSCH = (jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, 0))) for x in (q_BTQH, k_BSCH, v_BSCH))
        segment_ids_BT = jnp.pad(segment_ids_BT, ((0, 0), (0, extra)))
    seg_BT = segment_ids_BT
    mask_B1TS = ((seg_BT[:, :, None] == seg_BT[:, None, :]) & (seg_BT[:, :, None] != 0))[:, None]
    out_BTQH = jax.nn.dot_product_attention(
        q_BTQH, k_BSCH, v_BSCH, mask=mask_B1TS, scale=scale, is_causal=True,
        local_window_size=None if window is None else (window - 1, 0), implementation="cudnn")
    return out_BTQH[:, :T]


SPLASH_BLOCK = 128  # splash's default block sizes; T must be a multiple


def splash_supported(seq_len: int) -> bool:
    """Lengths the splash kernel's default 128 x 128 blocks tile."""
    return seq_len % SPLASH_BLOCK == 0


def splash_attention(q_BTQH: jax.Array, k_BSCH: jax.Array, v_BSCH: jax.Array, positions_BT: jax.Array,
                     segment_ids_BT: jax.Array, *, scale: float, window: int | None = None,
                     interpret: bool = False) -> jax.Array:
    """TPU Pallas splash attention (jax.experimental.pallas.ops.tpu.splash_attention) with the same rule.

    Causal or causal-local mask by index (see `cudnn_attention` on windows), segment ids for packing and
    padding; one MQA kernel per kv head (vmapped over B and C), so kv heads are not repeated. Padding queries
    see the padding keys before them: finite, ignored outputs. Single device: under a sharded jit the kernel
    needs a shard_map over the batch, which this module does not add yet. `interpret` runs it on CPU (tests).
    """
    # start-up: Pallas's TPU kernels (~60 ms) load only when splash is picked, not with every model import
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

    del positions_BT
    B, T, Q, H = q_BTQH.shape
    C = k_BSCH.shape[2]
    R = Q // C
    mask: splash_mask.Mask
    if window is None:
        mask = splash_mask.CausalMask((T, T))
    else:
        mask = splash_mask.LocalMask((T, T), window_size=(window - 1, 0), offset=0)
    kernel = splash.make_splash_mqa_single_device(splash_mask.MultiHeadMask([mask] * R), interpret=interpret)
    q_BCRTH = (q_BTQH.reshape(B, T, C, R, H) * jnp.asarray(scale, q_BTQH.dtype)).transpose(0, 2, 3, 1, 4)
    k_BCSH, v_BCSH = k_BSCH.transpose(0, 2, 1, 3), v_BSCH.transpose(0, 2, 1, 3)

    def one_row(q_CRTH, k_CSH, v_CSH, seg_T):
        ids = splash.SegmentIds(q=seg_T, kv=seg_T)
        return jax.vmap(lambda q_RTH, k_SH, v_SH: kernel(q_RTH, k_SH, v_SH, ids))(q_CRTH, k_CSH, v_CSH)

    out_BCRTH = jax.vmap(one_row)(q_BCRTH, k_BCSH, v_BCSH, segment_ids_BT.astype(jnp.int32))
    return out_BCRTH.transpose(0, 3, 1, 2, 4).reshape(B, T, Q, H).astype(q_BTQH.dtype)
