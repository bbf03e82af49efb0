"""Mixture-of-experts MLPs (Qwen3-MoE, GPT-OSS): top-k routing and the experts as grouped matmuls.

Shape letters (docs/shape_letters.md): M flattened tokens, D model dim, and for the experts e experts, k experts
per token, a token-expert assignments (M * k), f an expert's MLP hidden. Dropless, as transformers computes it:
every token reaches all k of its experts, whatever their loads (no capacity, nothing dropped).

Router replay: `forced_Mk` gives each token's k experts (those the sampler's router chose) in place of the router's
top k; their weights are recomputed from the current router's logits at those experts, by the family's own rule
(Megatron-LM's router replay, which verl and slime use: the scores at the replayed indices), so the weights keep
their gradient and only the discrete choice is replayed. `RouterStats` sums what the router's loss terms and the
expert-load metrics need over a forward's real tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from drgrpo_jax.models.gemm import dense
from drgrpo_jax.models.remat import name_projection

__all__ = ["RouterStats", "clamped_swiglu", "expert_load", "grouped_experts", "load_balancing_loss", "moe_mlp",
           "route", "router_stats", "router_z_loss"]

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


def grouped_experts(x_MD: jax.Array, weights_Mk: jax.Array, experts_Mk: jax.Array, gate_eDf: jax.Array,
                    up_eDf: jax.Array, down_efD: jax.Array, glu: Glu, dtype=None,
                    biases: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> jax.Array:
    """sum over a token's k experts of weight * down(glu(x gate, x up)) [M, D], in x's dtype.

    The M * k assignments are sorted by expert, so each expert's rows are contiguous and the three projections
    are grouped matmuls (`jax.lax.ragged_dot`, operands in `dtype` (None: the weights'), float32 accumulators);
    `biases` (gate [e, f], up [e, f], down [e, D]: GPT-OSS) are added to each row by its expert, in float32. The
    rows go back to token order and are summed with their routing weights (a down bias weighted too).
    """
    M, k = experts_Mk.shape
    e = gate_eDf.shape[0]
    low = gate_eDf.dtype if dtype is None else jnp.dtype(dtype)
    experts_a = jnp.asarray(experts_Mk).reshape(M * k)
    order_a = jnp.argsort(experts_a, stable=True)  # assignment of each sorted row
    sizes_e = jnp.bincount(experts_a, length=e).astype(jnp.int32)
    xs_aD = x_MD[order_a // k].astype(low)
    sorted_a = experts_a[order_a]  # the expert of each sorted row

    def grouped(lhs, rhs, bias):
        out = jax.lax.ragged_dot(lhs, rhs.astype(low), sizes_e, preferred_element_type=_F32)
        return name_projection(out if bias is None else out + bias[sorted_a].astype(_F32))

    gate_bias, up_bias, down_bias = (None, None, None) if biases is None else biases
    hidden_af = glu(grouped(xs_aD, gate_eDf, gate_bias), grouped(xs_aD, up_eDf, up_bias)).astype(low)
    ys_aD = grouped(hidden_af, down_efD, down_bias)
    y_MkD = ys_aD[jnp.argsort(order_a)].reshape(M, k, -1)  # back to token order
    return jnp.einsum("mkd,mk->md", y_MkD, weights_Mk.astype(_F32)).astype(x_MD.dtype)


def moe_mlp(x_MD: jax.Array, p: dict[str, jax.Array], k: int, normalise: bool, glu: Glu, dtype=None,
            topk_first: bool = False, forced_Mk: jax.Array | None = None
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(one layer's sparse MLP [M, D] on normed tokens, router logits [M, e], experts [M, k]): routed by p["router"]
    (and p["router_bias"] where the family has one; `forced_Mk`: router replay), run by the experts of `p` (with
    their biases where it has them)."""
    weights_Mk, experts_Mk, logits_Me = route(x_MD, p["router"], k, normalise, p.get("router_bias"), topk_first,
                                              forced_Mk)
    biases = (p["expert_gate_bias"], p["expert_up_bias"], p["expert_down_bias"]) if "expert_gate_bias" in p else None
    y_MD = grouped_experts(x_MD, weights_Mk, experts_Mk, p["expert_gate"], p["expert_up"], p["expert_down"], glu,
                           dtype, biases)
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
