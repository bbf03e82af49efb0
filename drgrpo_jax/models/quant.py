"""Weights-only int8: per-output-channel symmetric quantisation of a frozen projection, dequantised in its GEMM.

Shape letters (docs/shape_letters.md): L layers, X and Y a projection's input and output features (several
axes for the head-shaped ones, e.g. o_proj [Q, H, D]). Inside the layer scan `dequantize` makes one layer's weight
at a time, so the stacked float copy never exists. Not qwix: its PTQ intercepts `dot_general` on a module's own
parameter, and our stacked weights are sliced inside `lax.scan` into a custom-VJP GEMM (as models/lora.py says), so
it never sees them; its array-level functions would add a dependency and still lack the bfloat16-exact scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["INT8_MAX", "SCALE_SUFFIX", "dequantize", "quantize", "weight"]

INT8_MAX = 127  # symmetric: -127..127, so q and -q are both representable
SCALE_SUFFIX = "_scale"  # a quantised weight "q_proj" has its scales beside it as "q_proj_scale"


def _round_up_to_bfloat16(x: jax.Array) -> jax.Array:
    """The smallest bfloat16-representable float32 >= x, for finite x >= 0 (bfloat16 is float32's top 16 bits)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jax.lax.bitcast_convert_type((bits + jnp.uint32(0xFFFF)) & jnp.uint32(0xFFFF0000), jnp.float32)


def quantize(w: jax.Array, in_dims: int) -> tuple[jax.Array, jax.Array]:
    """(int8 q [L, *X, *Y], float32 scales [L, *Y]) of a stacked weight whose `in_dims` axes after L are X.

    s = max |w| over X / 127, q = round(w / s), w ~ q * s, one scale per layer and output channel. Each scale is
    rounded UP to a bfloat16-representable value: no |w / s| exceeds 127, and q * s (7 + 8 significant bits) is
    exact in float32, so dequantising on bfloat16 scales (`precision.matmul_weights_in`) rounds once, to the same
    value as the float32 dequantised weight cast to bfloat16. An all-zero channel gets scale 1 (q = 0).
    """
    w32 = w.astype(jnp.float32)
    absmax_LY = jnp.max(jnp.abs(w32), axis=tuple(range(1, 1 + in_dims)))
    scale_LY = _round_up_to_bfloat16(jnp.where(absmax_LY > 0, absmax_LY / INT8_MAX, 1.0))
    expanded = jnp.expand_dims(scale_LY, tuple(range(1, 1 + in_dims)))
    q = jnp.clip(jnp.round(w32 / expanded), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale_LY


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """One layer's q [*X, *Y] * scale [*Y] in the scale's dtype (float32, or bfloat16 under mixed precision).

    Stacked [L, ...] arrays: `jax.vmap(dequantize)`.
    """
    scale_1Y = scale.reshape((1,) * (q.ndim - scale.ndim) + scale.shape)  # explicit: no implicit rank promotion
    return (q.astype(jnp.float32) * scale_1Y.astype(jnp.float32)).astype(scale.dtype)


def weight(p: dict[str, jax.Array], name: str) -> jax.Array:
    """Weight `name` of one layer's params `p`: dequantised when it is stored as int8 (its scale beside it)."""
    scale = p.get(name + SCALE_SUFFIX)
    return p[name] if scale is None else dequantize(p[name], scale)
