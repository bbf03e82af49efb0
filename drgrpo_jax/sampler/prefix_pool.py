"""KV pages that outlive a batch, pure and jitted: a pool of fixed-size blocks of every layer's keys and values,
the copy of a batch's prompt blocks into it (`store_blocks`) and the gather of a prompt's cached blocks into a new
batch's prompt cache (`gather_prefix`). Which block holds what, and when one is evicted, is the host's business
(serve/prefix_cache.py).

Shape letters (docs/shape_letters.md): L layers, N pool blocks, K block tokens (BLOCK_TOKENS), C kv heads, H head
dim, P distinct prompts, M cached blocks of a prompt (bucketed), n blocks copied at once (bucketed), B rows, S slots.

A block is K consecutive prompt positions [i K, (i + 1) K) of one prompt. Attention masks read each slot's position,
never its index (`transformer.cache_masks`), so a prompt's cached blocks sit left-padded in the first slots of its
prompt cache and the rest of the prompt is prefilled after them at its own positions: RoPE, masks and the tokens'
draws are those of a prompt prefilled whole.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.kv_cache import VALUE_ORDER, KVCache, bits, cache_shardings, key_order, split_cache, unbits
from drgrpo_jax.sharding import named_sharding

__all__ = ["BLOCK_TOKENS", "PagePool", "block_bytes", "gather_prefix", "grow_pool", "init_pool", "left_padded_table",
           "store_blocks"]

BLOCK_TOKENS = 16  # prompt positions per cached block: the unit of reuse, hashing and eviction

_POOL_AXES = ("layers", None, None, "kv_heads", "head_dim")  # [L, N, K, C, H]: heads split as a batch cache's are


@flax.struct.dataclass
class PagePool:
    """Every layer's keys and values of N blocks, [L, N + 1, K, C, H]; block N is scratch (padding writes land
    there and padding reads come from there, masked by position -1)."""

    k: jax.Array
    v: jax.Array

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1] - 1


def block_bytes(config: DecoderConfig, itemsize: int) -> int:
    """Bytes of one cached block: keys and values of every layer."""
    return 2 * config.num_layers * BLOCK_TOKENS * config.num_kv_heads * config.head_dim * itemsize


def init_pool(config: DecoderConfig, num_blocks: int, dtype, mesh: Mesh | None = None) -> PagePool:
    """An empty pool of `num_blocks` blocks (plus the scratch one), heads on the mesh's `tensor` axis."""
    shape = (config.num_layers, num_blocks + 1, BLOCK_TOKENS, config.num_kv_heads, config.head_dim)
    sharding = None if mesh is None else named_sharding("prefix_pool", shape, _POOL_AXES, mesh)
    # Made where it lives: zeros built on one device and moved would hold the whole pool there first.
    zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return PagePool(zeros(), zeros())


def grow_pool(pool: PagePool, num_blocks: int, mesh: Mesh | None = None) -> PagePool:
    """The pool with room for `num_blocks` blocks, its blocks kept (the scratch block is the new last one)."""
    old = pool.num_blocks
    shape = (pool.k.shape[0], num_blocks + 1, *pool.k.shape[2:])
    sharding = None if mesh is None else named_sharding("prefix_pool", shape, _POOL_AXES, mesh)

    def grown(x: jax.Array) -> jax.Array:
        return unbits(jnp.zeros(shape, bits(x).dtype).at[:, :old].set(bits(x)[:, :old]), x.dtype)

    return jax.jit(lambda p: PagePool(grown(p.k), grown(p.v)), out_shardings=sharding)(pool)


def _slots_of(buffer: jax.Array, order: tuple[int, ...], rows_n1: jax.Array, slots_nK: jax.Array) -> jax.Array:
    """[n, K, C, H]: the slots `slots_nK` of rows `rows_n1` of one layer's split cache (laid out by `order`)."""
    index: list = [slice(None)] * 4
    index[0], index[order.index(1)] = rows_n1, slots_nK
    return unbits(bits(buffer)[tuple(index)], buffer.dtype)  # the two indexed axes lead (numpy's rule), then C, H


@functools.partial(jax.jit, donate_argnames=("pool",))
def store_blocks(pool: PagePool, cache: KVCache, rows_n: jax.Array, first_slots_n: jax.Array,
                 blocks_n: jax.Array) -> PagePool:
    """Copies K slots from `first_slots_n` on of each row `rows_n` of a batch's split cache into pool block
    `blocks_n` (the scratch block N for padding entries), in place."""
    slots_nK = first_slots_n[:, None] + jnp.arange(BLOCK_TOKENS)[None, :]
    rows_n1 = rows_n[:, None]
    key_layout = key_order(cache.k[0].dtype)
    k_LnKCH = jnp.stack([_slots_of(k, key_layout, rows_n1, slots_nK) for k in cache.k])
    v_LnKCH = jnp.stack([_slots_of(v, VALUE_ORDER, rows_n1, slots_nK) for v in cache.v])

    def put(into: jax.Array, update: jax.Array) -> jax.Array:
        return unbits(bits(into).at[:, blocks_n].set(bits(update.astype(into.dtype))), into.dtype)

    return PagePool(put(pool.k, k_LnKCH), put(pool.v, v_LnKCH))


@functools.partial(jax.jit, static_argnames=("prompt_slots", "mesh"))
def gather_prefix(pool: PagePool, blocks_PM: jax.Array, *, prompt_slots: int, mesh: Mesh | None = None) -> KVCache:
    """The distinct prompts' split cache of M K + `prompt_slots` slots: its first M K hold each prompt's cached
    blocks `blocks_PM` (left-padded with -1: no block, an empty slot), `length` = M K, so a prefill writes the rest
    of the prompts after them."""
    num_prompts, num_cached = blocks_PM.shape
    cached = blocks_PM >= 0
    table_PM = jnp.where(cached, blocks_PM, pool.num_blocks)

    def take(x_LNKCH: jax.Array) -> jax.Array:
        x_LPSCH = unbits(bits(x_LNKCH)[:, table_PM], x_LNKCH.dtype).reshape(
            x_LNKCH.shape[0], num_prompts, num_cached * BLOCK_TOKENS, *x_LNKCH.shape[3:])
        return jnp.pad(x_LPSCH, ((0, 0), (0, 0), (0, prompt_slots), (0, 0), (0, 0)))

    # The cached positions count from 0 at the first real block: left padding keeps each prompt's blocks last.
    first_P1 = num_cached - jnp.sum(cached, axis=1, keepdims=True)
    block_positions_PM = (jnp.arange(num_cached)[None, :] - first_P1) * BLOCK_TOKENS
    positions_PMK = block_positions_PM[:, :, None] + jnp.arange(BLOCK_TOKENS)[None, None, :]
    positions_PS = jnp.where(cached[:, :, None], positions_PMK, -1)
    positions_PS = jnp.pad(positions_PS.reshape(num_prompts, -1), ((0, 0), (0, prompt_slots)), constant_values=-1)
    cache = KVCache(k=take(pool.k), v=take(pool.v), positions_BS=positions_PS,
                    length=jnp.int32(num_cached * BLOCK_TOKENS))
    if mesh is not None:
        cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))
    return split_cache(cache)


def left_padded_table(blocks: list[list[int]], num_prompts: int, width: int) -> np.ndarray:
    """int32 [num_prompts, width]: each prompt's cached block ids, left-padded with -1 (host)."""
    table = np.full((num_prompts, width), -1, np.int32)
    for p, ids in enumerate(blocks):
        if ids:
            table[p, width - len(ids):] = ids
    return table
