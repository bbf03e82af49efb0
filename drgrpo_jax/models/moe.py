"""Mixture-of-experts MLPs (Qwen3-MoE, GPT-OSS): top-k routing and the experts as grouped matmuls.

Shape letters (docs/shape_letters.md): M flattened tokens, D model dim, and for the experts e experts, k experts
per token, a token-expert assignments (M * k), f an expert's MLP hidden. Dropless, as transformers computes it:
every token reaches all k of its experts, whatever their loads (no capacity, nothing dropped).

Router replay: `forced_Mk` gives each token's k experts (those the sampler's router chose) in place of the router's
top k; their weights are recomputed from the current router's logits at those experts, by the family's own rule
(Megatron-LM's router replay, which verl and slime use: the scores at the replayed indices), so the weights keep
their gradient and only the discrete choice is replayed. `RouterStats` sums what the router's loss terms and the
expert-load metrics need over a forward's real tokens.

Expert parallelism: traced under a mesh (`sharding.traced_on_mesh`) whose expert axis (`ShardingRules.expert`,
E shards) divides e, the experts run in a `shard_map`: each shard routes its own tokens, an all-to-all over the
expert axis sends every token copy to the shard holding its expert, that shard runs its e / E experts as grouped
matmuls, and a second all-to-all brings the rows back to be weighted. Dropless with a fixed capacity: each
destination's slot of the send buffer holds all a_s = M_s * k of a shard's copies (its worst case), so a shard
holds E * a_s rows of [D] going out, coming in, and (float32) coming back: E times its own copies.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.megablox import gmm
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from drgrpo_jax.models.gemm import dense
from drgrpo_jax.models.remat import name_projection
from drgrpo_jax.sharding import ShardingRules

__all__ = ["RouterStats", "clamped_swiglu", "expert_load", "expert_parallel_experts", "expert_shards",
           "grouped_experts", "grouped_matmul", "load_balancing_loss", "moe_mlp", "route", "router_stats",
           "router_z_loss"]

_F32 = jnp.float32
# (gate [a, f], up [a, f]) -> hidden [a, f], in float32: how an expert combines its two projections.
Glu = Callable[[jax.Array, jax.Array], jax.Array]


def route(x_MD: jax.Array, router_De: jax.Array, k: int, normalise: bool, bias_e: jax.Array | None = None,
          topk_first: bool = False, forced_Mk: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(weights [M, k] in x's dtype, experts [M, k] int32, float32 router logits [M, e] (plus `bias_e`)).

    Qwen3-MoE: the k most probable experts of a softmax over all of them, their probabilities renormalised to sum
    to 1 when `normalise`. GPT-OSS (`topk_first`): the k largest logits, then a softmax over those k.
    `forced_Mk` (router replay): those experts instead of the top k, weighted by the same rule at them.
    """
    logits_Me = dense(x_MD, router_De).astype(_F32)
    if bias_e is not None:
        logits_Me = logits_Me + bias_e.astype(_F32)[None]
    if topk_first:
        if forced_Mk is None:
            top_Mk, experts_Mk = jax.lax.top_k(logits_Me, k)
        else:
            experts_Mk, top_Mk = forced_Mk, jnp.take_along_axis(logits_Me, forced_Mk, axis=-1)
        weights_Mk = jax.nn.softmax(top_Mk, axis=-1)
    else:
        probs_Me = jax.nn.softmax(logits_Me, axis=-1)
        if forced_Mk is None:
            weights_Mk, experts_Mk = jax.lax.top_k(probs_Me, k)
        else:
            experts_Mk, weights_Mk = forced_Mk, jnp.take_along_axis(probs_Me, forced_Mk, axis=-1)
        if normalise:
            weights_Mk = weights_Mk / jnp.sum(weights_Mk, axis=-1, keepdims=True)
    return weights_Mk.astype(x_MD.dtype), experts_Mk.astype(jnp.int32), logits_Me


def clamped_swiglu(alpha: float, limit: float) -> Glu:
    """GPT-OSS's expert nonlinearity: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""
    def glu(gate_af: jax.Array, up_af: jax.Array) -> jax.Array:
        gate_af = jnp.minimum(gate_af, limit)
        return (jnp.clip(up_af, -limit, limit) + 1) * gate_af * jax.nn.sigmoid(alpha * gate_af)

    return glu


def grouped_matmul(lhs_aX: jax.Array, rhs_eXY: jax.Array, sizes_e: jax.Array) -> jax.Array:
    """float32 [a, Y]: the rows of each expert's contiguous group times its [X, Y] (rows past the groups: 0).

    On TPU, Megablox's grouped-matmul kernel where its 128-tiles fit the shapes (untested here: no TPU in CI);
    `jax.lax.ragged_dot` everywhere else.
    """
    if jax.default_backend() == "tpu" and all(n % 128 == 0 for n in (*lhs_aX.shape, rhs_eXY.shape[-1])):
        return gmm(lhs_aX, rhs_eXY, sizes_e, _F32)
    return jax.lax.ragged_dot(lhs_aX, rhs_eXY, sizes_e, preferred_element_type=_F32)


def _run_sorted(xs_aD: jax.Array, sorted_a: jax.Array, sizes_e: jax.Array, gate_eDf: jax.Array, up_eDf: jax.Array,
                down_efD: jax.Array, glu: Glu, low, biases, mlp_axis: str | None = None) -> jax.Array:
    """float32 [a, D]: rows sorted by expert (`sorted_a`, `sizes_e` rows per expert) through their experts' FFN.
    `mlp_axis` (inside a shard_map): the axis the hidden dim is split over, the down projection summed over it
    before its bias."""
    def grouped(lhs, rhs, bias, axis=None):
        out = grouped_matmul(lhs, rhs.astype(low), sizes_e)
        out = out if axis is None else jax.lax.psum(out, axis)
        return name_projection(out if bias is None else out + bias[sorted_a].astype(_F32))

    gate_bias, up_bias, down_bias = (None, None, None) if biases is None else biases
    hidden_af = glu(grouped(xs_aD, gate_eDf, gate_bias), grouped(xs_aD, up_eDf, up_bias)).astype(low)
    return grouped(hidden_af, down_efD, down_bias, mlp_axis)


def _combine(ys_aD: jax.Array, order_a: jax.Array, weights_Mk: jax.Array, dtype) -> jax.Array:
    """The rows of the sorted assignments (`order_a`) back in token order, summed with their routing weights."""
    M, k = weights_Mk.shape
    y_MkD = ys_aD[jnp.argsort(order_a)].reshape(M, k, -1)
    return jnp.einsum("mkd,mk->md", y_MkD, weights_Mk.astype(_F32)).astype(dtype)


def grouped_experts(x_MD: jax.Array, weights_Mk: jax.Array, experts_Mk: jax.Array, gate_eDf: jax.Array,
                    up_eDf: jax.Array, down_efD: jax.Array, glu: Glu, dtype=None,
                    biases: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> jax.Array:
    """sum over a token's k experts of weight * down(glu(x gate, x up)) [M, D], in x's dtype.

    The M * k assignments are sorted by expert, so each expert's rows are contiguous and the three projections
    are grouped matmuls (`grouped_matmul`, operands in `dtype` (None: the weights'), float32 accumulators);
    `biases` (gate [e, f], up [e, f], down [e, D]: GPT-OSS) are added to each row by its expert, in float32. The
    rows go back to token order and are summed with their routing weights (a down bias weighted too).
    """
    M, k = experts_Mk.shape
    e = gate_eDf.shape[0]
    low = gate_eDf.dtype if dtype is None else jnp.dtype(dtype)
    experts_a = jnp.asarray(experts_Mk).reshape(M * k)
    order_a = jnp.argsort(experts_a, stable=True)  # assignment of each sorted row
    sizes_e = jnp.bincount(experts_a, length=e).astype(jnp.int32)
    sorted_a = experts_a[order_a]  # the expert of each sorted row
    ys_aD = _run_sorted(x_MD[order_a // k].astype(low), sorted_a, sizes_e, gate_eDf, up_eDf, down_efD, glu, low,
                        biases)
    return _combine(ys_aD, order_a, weights_Mk, x_MD.dtype)


# ------------------------------------------------------------------ expert parallelism


def expert_shards(num_experts: int, rules: ShardingRules = ShardingRules()) -> tuple[AbstractMesh, int] | None:
    """(the mesh a forward is traced under, its expert axis' size E) where the experts run expert-parallel: the
    expert axis has E > 1 shards (or the tokens are split over a context axis: then E = 1 too, so each shard
    routes its own tokens), E divides `num_experts`, and the tokens' batch axes include it; else None."""
    mesh = jax.sharding.get_abstract_mesh()
    axis = rules.expert
    if mesh.empty or not isinstance(axis, str) or axis not in mesh.axis_names:
        return None
    size = mesh.shape[axis]
    batch = (rules.batch,) if isinstance(rules.batch, str) else tuple(rules.batch or ())
    split = int(np.prod([mesh.shape[a] for a in _token_axes(mesh, rules) if a not in batch])) > 1
    if (size == 1 and not split) or num_experts % size or axis not in batch:
        return None
    return mesh, size


def _token_axes(mesh: AbstractMesh, rules: ShardingRules) -> tuple[str, ...]:
    """The mesh axes a forward's flattened tokens [M] are split over: the batch axes, then the context axis (rows
    major, each row's tokens over context)."""
    named = [(a,) if isinstance(a, str) else tuple(a or ()) for a in (rules.batch, rules.length)]
    return tuple(a for axes in named for a in axes if a in mesh.axis_names)


def expert_parallel_experts(x_MD: jax.Array, weights_Mk: jax.Array, experts_Mk: jax.Array, gate_eDf: jax.Array,
                            up_eDf: jax.Array, down_efD: jax.Array, glu: Glu, dtype=None,
                            biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                            rules: ShardingRules = ShardingRules()) -> jax.Array:
    """`grouped_experts` with tokens and experts split over the mesh (`expert_shards`): every shard sends each
    token copy to its expert's shard (all-to-all over the expert axis), runs its own experts, and gets the rows
    back. Tokens split over the rules' batch and context axes (padded to a multiple with zero-weight copies); an
    expert's hidden dim over the `mlp` axis (the down projection summed over it)."""
    mesh, E = expert_shards(gate_eDf.shape[0], rules)  # type: ignore[misc]
    names = set(mesh.axis_names)
    batch = _token_axes(mesh, rules)
    mlp = rules.mlp if isinstance(rules.mlp, str) and rules.mlp in names else None
    M, k = experts_Mk.shape
    e = gate_eDf.shape[0]
    local = e // E  # experts per shard
    low = gate_eDf.dtype if dtype is None else jnp.dtype(dtype)
    pad = -M % int(np.prod([mesh.shape[a] for a in batch]))
    if pad:  # zero-weight copies of a zero token, on expert 0: exact, and dropped by the combine
        x_MD, weights_Mk, experts_Mk = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x_MD, weights_Mk, experts_Mk))

    def shard(x_mD, weights_mk, experts_mk, gate_lDf, up_lDf, down_lfD, *bias):
        m = x_mD.shape[0]
        a = m * k
        experts_a = experts_mk.reshape(a)
        order_a = jnp.argsort(experts_a, stable=True)  # by expert, hence by destination shard
        sorted_a = experts_a[order_a]
        dest_a = sorted_a // local
        counts_E = jnp.bincount(dest_a, length=E)
        slot_a = jnp.arange(a) - (jnp.cumsum(counts_E) - counts_E)[dest_a]  # place in its destination's slot
        send_EaD = jnp.zeros((E, a, x_mD.shape[1]), low).at[dest_a, slot_a].set(x_mD[order_a // k].astype(low))
        send_Ea = jnp.full((E, a), local, jnp.int32).at[dest_a, slot_a].set(sorted_a % local)  # local: empty slot
        recv_EaD = jax.lax.all_to_all(send_EaD, rules.expert, 0, 0, tiled=True)
        recv_r = jax.lax.all_to_all(send_Ea, rules.expert, 0, 0, tiled=True).reshape(E * a)
        order_r = jnp.argsort(recv_r, stable=True)  # empty slots last, past every group (their rows: unread)
        sizes_l = jnp.bincount(recv_r, length=local).astype(jnp.int32)
        ys_rD = _run_sorted(recv_EaD.reshape(E * a, -1)[order_r], jnp.minimum(recv_r[order_r], local - 1), sizes_l,
                            gate_lDf, up_lDf, down_lfD, glu, low, bias or None, mlp)
        back_EaD = jax.lax.all_to_all(ys_rD[jnp.argsort(order_r)].reshape(E, a, -1), rules.expert, 0, 0,
                                      tiled=True)
        return _combine(back_EaD[dest_a, slot_a], order_a, weights_mk, x_mD.dtype)

    tokens = P(batch or None, None)
    specs = [tokens, tokens, tokens, P(rules.expert, None, mlp), P(rules.expert, None, mlp),
             P(rules.expert, mlp, None)]
    if biases is not None:
        specs += [P(rules.expert, mlp), P(rules.expert, mlp), P(rules.expert, None)]
    y_MD = jax.shard_map(shard, mesh=mesh, in_specs=tuple(specs), out_specs=tokens)(
        x_MD, weights_Mk, experts_Mk, gate_eDf, up_eDf, down_efD, *(biases or ()))
    return y_MD[:M]


def moe_mlp(x_MD: jax.Array, p: dict[str, jax.Array], k: int, normalise: bool, glu: Glu, dtype=None,
            topk_first: bool = False, forced_Mk: jax.Array | None = None
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(one layer's sparse MLP [M, D] on normed tokens, router logits [M, e], experts [M, k]): routed by p["router"]
    (and p["router_bias"] where the family has one; `forced_Mk`: router replay), run by the experts of `p` (with
    their biases where it has them)."""
    weights_Mk, experts_Mk, logits_Me = route(x_MD, p["router"], k, normalise, p.get("router_bias"), topk_first,
                                              forced_Mk)
    biases = (p["expert_gate_bias"], p["expert_up_bias"], p["expert_down_bias"]) if "expert_gate_bias" in p else None
    experts = expert_parallel_experts if expert_shards(p["expert_gate"].shape[0]) else grouped_experts
    y_MD = experts(x_MD, weights_Mk, experts_Mk, p["expert_gate"], p["expert_up"], p["expert_down"], glu, dtype,
                   biases)
    return y_MD, logits_Me, experts_Mk


# ------------------------------------------------------------------ the router's loss terms and load metrics


@flax.struct.dataclass
class RouterStats:
    """Sums over a forward's real tokens, additive over micro-batches (L layers, e experts)."""

    counts_Le: jax.Array  # float32 token-expert assignments per layer (the experts used: replayed or chosen)
    probs_e: jax.Array  # float32 softmax over all experts, summed over layers and tokens
    z: jax.Array  # float32 []: logsumexp(logits)^2 summed over layers and tokens
    rows: jax.Array  # float32 []: real tokens times layers (transformers' total_rows)


def router_stats(logits_Me: jax.Array, experts_Mk: jax.Array, real_M: jax.Array, layer: jax.Array,
                 num_layers: int) -> RouterStats:
    """One layer's `RouterStats` (its counts in row `layer` of [L, e]) over the tokens where `real_M`."""
    e = logits_Me.shape[-1]
    real_M = real_M.astype(_F32)
    counts_e = jnp.zeros(e, _F32).at[experts_Mk.reshape(-1)].add(jnp.repeat(real_M, experts_Mk.shape[1]))
    lse_M = jax.nn.logsumexp(logits_Me, axis=-1)
    return RouterStats(counts_Le=jnp.zeros((num_layers, e), _F32).at[layer].set(counts_e),
                       probs_e=jnp.sum(jax.nn.softmax(logits_Me, axis=-1) * real_M[:, None], axis=0),
                       z=jnp.sum(lse_M * lse_M * real_M), rows=jnp.sum(real_M))


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """Switch Transformer's auxiliary loss as transformers' `load_balancing_loss_func` pools it over layers:
    e * sum_e (assignments of e / rows) * (probability mass of e / rows); 1 when perfectly balanced."""
    rows = jnp.maximum(stats.rows, 1.0)
    return stats.probs_e.shape[0] * jnp.sum(stats.counts_Le.sum(axis=0) / rows * stats.probs_e / rows)


def router_z_loss(stats: RouterStats) -> jax.Array:
    """ST-MoE's router z-loss: the mean over layers and real tokens of logsumexp(router logits)^2."""
    return stats.z / jnp.maximum(stats.rows, 1.0)


def expert_load(stats: RouterStats) -> tuple[jax.Array, jax.Array]:
    """Per layer [L]: the largest expert's share of the assignments (1/e balanced, 1 collapsed) and the entropy of
    the shares in nats (log e balanced, 0 collapsed)."""
    share_Le = stats.counts_Le / jnp.maximum(stats.counts_Le.sum(axis=-1, keepdims=True), 1.0)
    entropy_L = -jnp.sum(jnp.where(share_Le > 0, share_Le * jnp.log(jnp.where(share_Le > 0, share_Le, 1.0)), 0.0),
                         axis=-1)
    return share_Le.max(axis=-1), entropy_L
