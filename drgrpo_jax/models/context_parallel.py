"""Context parallelism: the token axis of every row split over the mesh's `context` axis (C ways).

Shape letters (docs/shape_letters.md): B rows, T tokens of a row as one shard holds them (the layout's slots),
S tokens of the whole row (keys), Q query heads, C kv heads, H head dim, D model dim.

Layout (zigzag, for the causal load balance): a row padded to a multiple of 2C tokens is cut into 2C chunks of L;
context shard d holds chunks d and 2C - 1 - d, an early and a late one, so every shard has the same share of the
causal triangle and none idles on masked blocks. `to_context_layout` puts a row's per-token inputs in that order
(the shards' slots one after another, what a T axis sharded over `context` holds), `from_context_layout` takes
per-token outputs back. Everything per-token (embeddings, norms, RoPE from the tokens' own positions, MLPs, a
mixture's routing, log-probs) is indifferent to the order; attention is not: `context_attention` all-gathers every
layer's keys and values over the axis (kv heads only: small beside the activations under grouped-query attention),
puts them back in sequence order and runs each shard's queries at their sequence indices against them (causality
by index, windows by position, segments for packing and padding, sinks as always). The gather's transpose is a
reduce-scatter of the keys' and values' gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from drgrpo_jax.models.attention import (
    blockwise_cross_attention,
    choose_impl,
    reference_attention,
    self_attention_mask,
)
from drgrpo_jax.sharding import ShardingRules

__all__ = ["CANNOT_SPLIT", "constrain_tokens", "context_attention", "context_impl", "context_ways",
           "from_context_layout", "padded_length", "to_context_layout", "zigzag_order"]

CANNOT_SPLIT = ("cudnn", "splash")  # kernels that see the whole row at once: refused with mesh.context > 1


def _axes_in(mesh, axes) -> tuple[str, ...]:
    """The mesh axes of a rule that `mesh` has."""
    named = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return tuple(a for a in named if a in mesh.axis_names)


def context_ways(rules: ShardingRules = ShardingRules()) -> int:
    """C: the size of the token axis' mesh axis in the mesh a program is traced under (`sharding.traced_on_mesh`);
    1 outside a mesh or where it has no such axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    return int(np.prod([mesh.shape[a] for a in _axes_in(mesh, rules.length)]))


def padded_length(length: int, ways: int) -> int:
    """A row's length in the layout: whole 2C chunks."""
    return -(-length // (2 * ways)) * 2 * ways


def zigzag_order(length: int, ways: int) -> np.ndarray:
    """int32 [padded_length]: the sequence index of each slot of the layout (shard d: chunks d and 2C - 1 - d)."""
    L = padded_length(length, ways) // (2 * ways)
    chunks = [c for d in range(ways) for c in (d, 2 * ways - 1 - d)]
    return np.concatenate([np.arange(c * L, (c + 1) * L) for c in chunks]).astype(np.int32)


def to_context_layout(x_BS: jax.Array, ways: int, fill=0) -> jax.Array:
    """[B, S, ...] in sequence order -> [B, padded_length(S), ...] in the layout (padding slots hold `fill`)."""
    S = x_BS.shape[1]
    pad = [(0, 0), (0, padded_length(S, ways) - S)] + [(0, 0)] * (x_BS.ndim - 2)
    return jnp.take(jnp.pad(x_BS, pad, constant_values=fill), zigzag_order(S, ways), axis=1)


def from_context_layout(y_BT: jax.Array, ways: int, length: int) -> jax.Array:
    """`to_context_layout`'s inverse on per-token outputs: [B, length, ...] in sequence order."""
    inverse = np.argsort(zigzag_order(length, ways))[:length]
    return jnp.take(y_BT, inverse, axis=1)


def constrain_tokens(x_BT: jax.Array, rules: ShardingRules = ShardingRules()) -> jax.Array:
    """x [B, T, ...] pinned to rows over the batch axes and tokens over the context axis (so XLA keeps each shard's
    activations to its own tokens); x itself outside a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x_BT
    spec = P(_axes_in(mesh, rules.batch) or None, _axes_in(mesh, rules.length) or None)
    return jax.lax.with_sharding_constraint(x_BT, NamedSharding(mesh, spec))


def context_impl(impl: str, *, seq_len: int, dtype, head_dim: int, sinks: bool = False) -> str:
    """The attention kernel a context-split forward runs: `choose_impl`'s, where auto's pick of cuDNN or splash
    becomes blockwise; those two named explicitly are refused (they take a whole row at once)."""
    if impl in CANNOT_SPLIT:
        raise ValueError(f"attention: {impl} cannot split a row over mesh.context > 1; use blockwise (or auto)")
    chosen = choose_impl(impl, seq_len=seq_len, dtype=dtype, head_dim=head_dim, sinks=sinks)
    return "blockwise" if chosen in CANNOT_SPLIT else chosen


def _in_sequence_order(x_BT: jax.Array, axis: str, ways: int) -> jax.Array:
    """Every shard's slots of x [B, T, ...] gathered over `axis` and put back in sequence order: [B, 2C * L, ...]."""
    gathered = jax.lax.all_gather(x_BT, axis, axis=1)  # [B, C, 2L, ...]
    halves = gathered.reshape(x_BT.shape[0], ways, 2, x_BT.shape[1] // 2, *x_BT.shape[2:])
    chunks = jnp.concatenate([halves[:, :, 0], jnp.flip(halves[:, :, 1], axis=1)], axis=1)  # [B, 2C, L, ...]
    return chunks.reshape(x_BT.shape[0], -1, *x_BT.shape[2:])


def context_attention(q_BTQH: jax.Array, k_BTCH: jax.Array, v_BTCH: jax.Array, positions_BT: jax.Array,
                      segment_ids_BT: jax.Array, *, scale: float, window: int | None, impl: str, dtype=None,
                      sinks_Q: jax.Array | None = None, rules: ShardingRules = ShardingRules()) -> jax.Array:
    """Self-attention [B, T, Q, H] of rows in the context layout, T split over the context axis of the mesh the
    program is traced under: each shard's queries against the all-gathered keys and values (`impl`: blockwise or
    reference, from `context_impl`)."""
    mesh = jax.sharding.get_abstract_mesh()
    (axis,) = _axes_in(mesh, rules.length)
    ways = mesh.shape[axis]
    batch = _axes_in(mesh, rules.batch) or None
    q_heads, kv_heads = _axes_in(mesh, rules.q_heads) or None, _axes_in(mesh, rules.kv_heads) or None

    def shard(q_BTQH, k_BTCH, v_BTCH, pos_BT, seg_BT, *sinks):
        L = q_BTQH.shape[1] // 2
        d = jax.lax.axis_index(axis)
        idx_T = jnp.concatenate([d * L + jnp.arange(L), (2 * ways - 1 - d) * L + jnp.arange(L)]).astype(jnp.int32)
        k_BSCH, v_BSCH, pos_BS, seg_BS = (_in_sequence_order(x, axis, ways) for x in (k_BTCH, v_BTCH, pos_BT, seg_BT))
        sinks_Q = None
        if sinks:  # made to vary as the queries do: the transpose sums the sinks' gradient over rows and shards
            sinks_Q = jax.lax.pcast(sinks[0], (*(batch or ()), axis), to="varying")
        if impl == "reference":
            idx_S = jnp.arange(k_BSCH.shape[1])
            mask_BTS = self_attention_mask(seg_BT, seg_BS, idx_T, idx_S, pos_BT, pos_BS, window)
            return reference_attention(q_BTQH, k_BSCH, v_BSCH, mask_BTS, scale, dtype, sinks_Q)
        return blockwise_cross_attention(q_BTQH, k_BSCH, v_BSCH, pos_BT, seg_BT, idx_T, pos_BS, seg_BS, scale=scale,
                                         window=window, dtype=dtype, sinks_Q=sinks_Q)

    tokens = P(batch, axis)
    specs = [P(batch, axis, q_heads, None), P(batch, axis, kv_heads, None), P(batch, axis, kv_heads, None), tokens,
             tokens]
    args = [q_BTQH, k_BTCH, v_BTCH, positions_BT, segment_ids_BT]
    if sinks_Q is not None:
        specs.append(P(q_heads))
        args.append(sinks_Q)
    return jax.shard_map(shard, mesh=mesh, in_specs=tuple(specs), out_specs=specs[0])(*args)
