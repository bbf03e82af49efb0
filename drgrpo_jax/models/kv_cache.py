"""The decode-time KV cache: its layout, sharding, slot writes and the attention that reads it.

Shape letters as in transformer.py (the README's glossary). `init_cache` makes the stacked [L, B, S, C, H]
form that shards like the params; a decode loop carries the per-layer [B, C, S, H] form (`split_cache`),
whose slots each step writes in place (`write_slots`) and attention reads without a transpose (`attend_slots`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from drgrpo_jax.models.attention import MASKED
from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.gemm import is_half
from drgrpo_jax.sharding import ShardingRules, named_sharding

_F32 = jnp.float32


@struct.dataclass
class KVCache:
    """Explicit decode state: keys/values per layer and the position stored in each slot."""

    k: jax.Array | tuple[jax.Array, ...]  # [L, B, S, C, H]; a decode loop carries L [B, C, S, H] (`split_cache`)
    v: jax.Array | tuple[jax.Array, ...]  # as k
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


def attend_slots(q_BTQH: jax.Array, k_BCSH: jax.Array, v_BCSH: jax.Array, mask_BTS: jax.Array,
                 scale: float) -> jax.Array:
    """`reference_attention` over a per-layer cache in attention order [B, C, S, H]; scores and softmax in float32.

    Batched dots over (B, C) read that layout in place (the stacked [.., S, C, H] layout made XLA
    transpose every layer's slots every decode step); only the few queries are transposed.
    """
    B, T, Q, H = q_BTQH.shape
    C = k_BCSH.shape[1]
    q_BCRTH = q_BTQH.reshape(B, T, C, Q // C, H).transpose(0, 2, 3, 1, 4).astype(k_BCSH.dtype)
    scores_BCRTS = jnp.einsum("bcrth,bcsh->bcrts", q_BCRTH, k_BCSH, preferred_element_type=_F32) * scale
    scores_BCRTS = jnp.where(mask_BTS[:, None, None], scores_BCRTS, MASKED)
    probs_BCRTS = jax.nn.softmax(scores_BCRTS, axis=-1).astype(v_BCSH.dtype)
    out_BCRTH = jnp.einsum("bcrts,bcsh->bcrth", probs_BCRTS, v_BCSH, preferred_element_type=_F32)
    return out_BCRTH.transpose(0, 3, 1, 2, 4).reshape(B, T, Q, H).astype(q_BTQH.dtype)


def split_cache(cache: KVCache) -> KVCache:
    """The cache with keys/values as tuples of per-layer arrays in attention order [B, C, S, H].

    What a decode loop carries: each layer's slots are their own buffer, which a step updates in place
    and attention reads without a transpose (slicing a layer out of the stacked array is a copy, and its
    [B, S, C, H] order a transpose before every attention dot). `Transformer.decode` takes either form.
    """
    return dataclasses.replace(cache, k=tuple(jnp.swapaxes(k_BSCH, 1, 2) for k_BSCH in cache.k),
                               v=tuple(jnp.swapaxes(v_BSCH, 1, 2) for v_BSCH in cache.v))


def stack_cache(cache: KVCache) -> KVCache:
    """The inverse of `split_cache`: stacked [L, B, S, C, H] keys/values."""
    return dataclasses.replace(cache, k=jnp.stack([jnp.swapaxes(k, 1, 2) for k in cache.k]),
                               v=jnp.stack([jnp.swapaxes(v, 1, 2) for v in cache.v]))
