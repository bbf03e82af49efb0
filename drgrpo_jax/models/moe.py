"""A mixture-of-experts MLP (Qwen3-MoE): softmax top-k routing and the experts as grouped matmuls.

Shape letters (docs/shape_letters.md): M flattened tokens, D model dim, and for the experts e experts, k experts
per token, a token-expert assignments (M * k), f an expert's MLP hidden. Dropless, as transformers computes it:
every token reaches all k of its experts, whatever their loads (no capacity, nothing dropped).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from drgrpo_jax.models.gemm import dense
from drgrpo_jax.models.remat import name_projection

__all__ = ["grouped_experts", "moe_mlp", "route"]

_F32 = jnp.float32


def route(x_MD: jax.Array, router_De: jax.Array, k: int, normalise: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [M, k] in x's dtype, experts [M, k] int32): each token's k most probable experts under a float32
    softmax of its router logits, and their probabilities (renormalised to sum to 1 when `normalise`)."""
    probs_Me = jax.nn.softmax(dense(x_MD, router_De).astype(_F32), axis=-1)
    weights_Mk, experts_Mk = jax.lax.top_k(probs_Me, k)
    if normalise:
        weights_Mk = weights_Mk / jnp.sum(weights_Mk, axis=-1, keepdims=True)
    return weights_Mk.astype(x_MD.dtype), experts_Mk.astype(jnp.int32)


def grouped_experts(x_MD: jax.Array, weights_Mk: jax.Array, experts_Mk: jax.Array, gate_eDf: jax.Array,
                    up_eDf: jax.Array, down_efD: jax.Array, activation: Callable[[jax.Array], jax.Array],
                    dtype=None) -> jax.Array:
    """sum over a token's k experts of weight * down(act(x gate) * x up) [M, D], in x's dtype.

    The M * k assignments are sorted by expert, so each expert's rows are contiguous and the three projections
    are grouped matmuls (`jax.lax.ragged_dot`, operands in `dtype` (None: the weights'), float32 accumulators);
    the rows go back to token order and are summed with their routing weights.
    """
    M, k = experts_Mk.shape
    e = gate_eDf.shape[0]
    low = gate_eDf.dtype if dtype is None else jnp.dtype(dtype)
    experts_a = experts_Mk.reshape(M * k)
    order_a = jnp.argsort(experts_a, stable=True)  # assignment of each sorted row
    sizes_e = jnp.bincount(experts_a, length=e).astype(jnp.int32)
    xs_aD = x_MD[order_a // k].astype(low)

    def grouped(lhs, rhs):
        return name_projection(jax.lax.ragged_dot(lhs, rhs.astype(low), sizes_e, preferred_element_type=_F32))

    hidden_af = (activation(grouped(xs_aD, gate_eDf)) * grouped(xs_aD, up_eDf)).astype(low)
    ys_aD = grouped(hidden_af, down_efD)
    y_MkD = ys_aD[jnp.argsort(order_a)].reshape(M, k, -1)  # back to token order
    return jnp.einsum("mkd,mk->md", y_MkD, weights_Mk.astype(_F32)).astype(x_MD.dtype)


def moe_mlp(x_MD: jax.Array, p: dict[str, jax.Array], k: int, normalise: bool,
            activation: Callable[[jax.Array], jax.Array], dtype=None) -> jax.Array:
    """One layer's sparse MLP [M, D] on normed tokens: routed by p["router"], run by the experts of `p`."""
    weights_Mk, experts_Mk = route(x_MD, p["router"], k, normalise)
    return grouped_experts(x_MD, weights_Mk, experts_Mk, p["expert_gate"], p["expert_up"], p["expert_down"],
                           activation, dtype)
