"""The decode-time KV cache: its layout, sharding, slot writes and the attention that reads it.

Shape letters as in transformer.py (docs/shape_letters.md). `init_cache` makes the stacked [L, B, S, C, H]
form that shards like the params; a decode loop carries the per-layer form (`split_cache`): values [B, C, S, H],
keys [B, C, H, S] in 32-bit floats and [B, C, S, H] in 16-bit ones (`key_order`), whose slots each step
writes in place (`write_keys`, `write_values`) and attention reads without a transpose (`attend_slots`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from drgrpo_jax.models.attention import MASKED, sink_softmax
from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.gemm import is_half
from drgrpo_jax.sharding import ShardingRules, named_sharding

_F32 = jnp.float32


@struct.dataclass
class KVCache:
    """Explicit decode state: keys/values per layer and the position stored in each slot."""

    k: jax.Array | tuple[jax.Array, ...]  # [L, B, S, C, H]; a decode loop carries L [B, C, H or S, S or H]
    v: jax.Array | tuple[jax.Array, ...]  # [L, B, S, C, H]; a decode loop carries L [B, C, S, H]
    positions_BS: jax.Array  # int32, -1 = empty slot or padding token
    length: jax.Array  # int32 scalar: slots written so far (all rows write the same slots)


# Logical axes of the cache's arrays: rows follow the activations (batch), heads follow kv_heads.
_CACHE_AXES = {"k": ("layers", "batch", None, "kv_heads", "head_dim"),
               "v": ("layers", "batch", None, "kv_heads", "head_dim"),
               "positions_BS": ("batch", None)}


def cache_shardings(cache: KVCache, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> KVCache:
    """NamedShardings for a cache (a KVCache of shardings, usable as in/out_shardings)."""
    # Shardings where the arrays would be: Any, as KVCache's fields are typed for arrays.
    shardings: dict[str, Any] = {name: named_sharding(f"cache.{name}", getattr(cache, name).shape, axes, mesh, rules)
                                 for name, axes in _CACHE_AXES.items()}
    shardings["length"] = NamedSharding(mesh, PartitionSpec())
    return KVCache(**shardings)


def init_cache(config: DecoderConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache with room for max_len tokens per row."""
    shape = (config.num_layers, batch_size, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        positions_BS=jnp.full((batch_size, max_len), -1, jnp.int32),
        length=jnp.zeros((), jnp.int32),
    )


def bits(x: jax.Array) -> jax.Array:
    """A 16-bit float array viewed as uint16 (others unchanged), to move bf16 data around on CPU.

    XLA's CPU float normalisation upcasts bfloat16 dynamic_update_slice, dynamic-slice and gather to
    float32: a cache write converted the whole cache twice, and a gather from the embedding the whole
    table. On the uint16 view they stay as they are (inference only: a bitcast has no gradient).
    """
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if is_half(x.dtype) else x


def unbits(x: jax.Array, dtype) -> jax.Array:
    """The inverse of `bits`."""
    return jax.lax.bitcast_convert_type(x, dtype) if is_half(dtype) else x


def write_slots(buffer: jax.Array, update: jax.Array, start: tuple) -> jax.Array:
    """dynamic_update_slice of `update` (cast to the buffer's dtype) into a cache buffer, in place (`bits`)."""
    written = jax.lax.dynamic_update_slice(bits(buffer), bits(update.astype(buffer.dtype)), start)
    return unbits(written, buffer.dtype)


VALUE_ORDER = (0, 2, 1, 3)  # a split cache's values, from [B, S, C, H]: [B, C, S, H]


def key_order(dtype) -> tuple[int, ...]:
    """A split cache's keys, as a permutation of [B, S, C, H]: [B, C, H, S] in 32-bit floats, [B, C, S, H] in 16-bit.

    Transposed keys give the score dot its big operand as [contracted, kept], which XLA's CPU GEMMs read
    fastest at decode's few query rows. A 16-bit write into the minor slot axis is not done in place (XLA
    copied every layer's keys every step, which cost more than the layout saves), so bfloat16 keeps [B, C, S, H].
    """
    return VALUE_ORDER if is_half(dtype) else (0, 2, 3, 1)


def key_slot_axis(dtype) -> int:
    """The slot axis of a split cache's keys."""
    return key_order(dtype).index(1)


def _write_tokens(buffer: jax.Array, x_BTCH: jax.Array, start: jax.Array, order: tuple[int, ...]) -> jax.Array:
    """T tokens' keys or values, laid out by `order`, into a split cache's slots [start, start + T), in place."""
    slot_axis = order.index(1)
    return write_slots(buffer, x_BTCH.transpose(order), tuple(start if axis == slot_axis else 0 for axis in range(4)))


def write_keys(buffer: jax.Array, k_BTCH: jax.Array, start: jax.Array) -> jax.Array:
    return _write_tokens(buffer, k_BTCH, start, key_order(buffer.dtype))


def write_values(buffer: jax.Array, v_BTCH: jax.Array, start: jax.Array) -> jax.Array:
    return _write_tokens(buffer, v_BTCH, start, VALUE_ORDER)


def attend_slots(q_BTQH: jax.Array, k_BCxx: jax.Array, v_BCSH: jax.Array, mask_BTS: jax.Array,
                 scale: float, sinks_Q: jax.Array | None = None) -> jax.Array:
    """`reference_attention` over a per-layer cache (keys laid out by `key_order`, values [B, C, S, H]);
    scores and softmax (with the attention sinks `sinks_Q`, if any) in float32.

    Batched dots over (B, C) read that layout in place (the stacked [.., S, C, H] layout made XLA transpose
    every layer's slots every decode step); only the few queries are transposed.
    """
    B, T, Q, H = q_BTQH.shape
    C = k_BCxx.shape[1]
    q_BCRTH = q_BTQH.reshape(B, T, C, Q // C, H).transpose(0, 2, 3, 1, 4).astype(k_BCxx.dtype)
    keys = "bcsh" if key_order(k_BCxx.dtype) == VALUE_ORDER else "bchs"
    scores_BCRTS = jnp.einsum(f"bcrth,{keys}->bcrts", q_BCRTH, k_BCxx, preferred_element_type=_F32) * scale
    scores_BCRTS = jnp.where(mask_BTS[:, None, None], scores_BCRTS, MASKED)
    sinks_CR = None if sinks_Q is None else sinks_Q.reshape(C, Q // C)
    probs_BCRTS = sink_softmax(scores_BCRTS, sinks_CR).astype(v_BCSH.dtype)
    out_BCRTH = jnp.einsum("bcrts,bcsh->bcrth", probs_BCRTS, v_BCSH, preferred_element_type=_F32)
    return out_BCRTH.transpose(0, 3, 1, 2, 4).reshape(B, T, Q, H).astype(q_BTQH.dtype)


def split_cache(cache: KVCache) -> KVCache:
    """The cache with keys/values as tuples of per-layer arrays in attention order: values [B, C, S, H], keys
    [B, C, H, S] or [B, C, S, H] (`key_order`).

    What a decode loop carries: each layer's slots are their own buffer, which a step updates in place
    and attention reads without a transpose (slicing a layer out of the stacked array is a copy, and its
    [B, S, C, H] order a transpose before every attention dot). `Transformer.decode` takes either form.
    """
    order = key_order(cache.k[0].dtype)
    return dataclasses.replace(cache, k=tuple(jnp.transpose(k_BSCH, order) for k_BSCH in cache.k),
                               v=tuple(jnp.transpose(v_BSCH, VALUE_ORDER) for v_BSCH in cache.v))


def stack_cache(cache: KVCache) -> KVCache:
    """The inverse of `split_cache`: stacked [L, B, S, C, H] keys/values."""
    def unsplit(x: jax.Array, order: tuple[int, ...]) -> jax.Array:
        return jnp.transpose(x, [order.index(axis) for axis in range(4)])

    order = key_order(cache.k[0].dtype)
    return dataclasses.replace(cache, k=jnp.stack([unsplit(k, order) for k in cache.k]),
                               v=jnp.stack([unsplit(v, VALUE_ORDER) for v in cache.v]))
