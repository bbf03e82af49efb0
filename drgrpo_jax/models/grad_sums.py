"""Gradients added into a running float32 sum where they are made, for accumulation over micro-batches.

`sums + grad(micro_loss)(params)` holds a whole second gradient beside the sum (XLA writes the layer scan's
backward into a fresh stacked buffer and adds it afterwards). Here the sum itself takes the gradient, a micro-batch
returning `d/d(sums) = sums + d/d(params)` and params none: `scan_layers`' backward loop adds each layer's weight
gradient into that layer's slice (full remat reruns each layer anyway), `summing_into` the weights outside the
stack, `token_logprobs(unembed_sum=...)` the output table's chunk by chunk. It is Megatron's gradient-accumulation
fusion for a scanned JAX model: one stacked gradient buffer, not two.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from drgrpo_jax.models.remat import normalise_remat, remat_block

__all__ = ["gradient_to", "into_sums", "scan_layers", "summing_into"]


def into_sums(params: Any, sums: Any, *, unembed_by_caller: bool = False
              ) -> tuple[Any, dict[str, jax.Array], tuple[jax.Array, str] | None]:
    """(params whose gradient goes to `sums`, the layer stack's sums for `Transformer.hidden_states`, the
    unembedding's sum and layout or None).

    params and sums: a Transformer's nnx.State and a float32 one like it. The layers' sums are added to in place
    by the layer scan's backward; the other weights' (embeddings, final norm) by `summing_into`. Differentiate
    with respect to `sums`: a use of the original params elsewhere in the loss adds nothing to them.
    `unembed_by_caller`: the output table's sum is returned, (sum, "VD") for a tied embedding or (sum, "DV") for
    lm_head, for `token_logprobs(unembed_sum=...)` to add into chunk by chunk; the table's other uses (a tied
    embedding's gather) then send it their gradient alone (`gradient_to`), and it must be used that way once.
    """
    tied = "lm_head" not in params

    def outside_layers(path, param, sum_):
        name = path[0].key
        if name == "blocks":
            return param
        if unembed_by_caller and name == ("embed" if tied else "lm_head"):
            return gradient_to(param, sum_) if tied else param
        return summing_into(param, sum_)

    unembed = None
    if unembed_by_caller:
        unembed = (sums["embed"][...], "VD") if tied else (sums["lm_head"][...], "DV")
    return (jax.tree_util.tree_map_with_path(outside_layers, params, sums),
            {name: sum_[...] for name, sum_ in sums["blocks"].items()}, unembed)


Block = Callable[[Any, Any], Any]  # (x, (params of one layer, its extras)) -> x; x an array or a tuple of them


def scan_layers(block: Block, x: Any, params: dict[str, jax.Array], extras: Any, policy: str,
                sums: dict[str, jax.Array] | None = None) -> Any:
    """x after `block` of every layer: params (stacked arrays) and extras have the layer axis leading; x is the
    hidden state, or a tuple of it and what the layers add to (a mixture's router sums).

    `sums` (float32, shaped like params; `policy` "full" only) takes the gradient in place of params (see above).
    """
    if sums is None:
        block = remat_block(block, policy)
        return jax.lax.scan(lambda x, layer: (block(x, layer), None), x, (params, extras))[0]
    if normalise_remat(policy) != "full":
        raise ValueError(f"scan_layers: summing gradients in place reruns each layer: remat 'full', not {policy!r}")
    return _scan_into_sums(block, x, params, extras, sums)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan_into_sums(block, x, params, extras, sums):
    del sums  # only the backward reads it
    return _forward(block, x, params, extras)[0]


def _forward(block, x, params, extras):
    """(output, every layer's input): what full rematerialisation keeps."""
    return jax.lax.scan(lambda x, layer: (block(x, layer), x), x, (params, extras))


def _forward_keeping_inputs(block, x, params, extras, sums):
    y, inputs = _forward(block, x, params, extras)
    return y, (inputs, params, extras, sums)


def _backward_into_sums(block, residuals, ct_y):
    inputs, params, extras, sums = residuals

    def layer_back(carry, layer):
        ct, sums = carry
        index, x, p, extra = layer
        _, pullback = jax.vjp(lambda x, p: block(x, (p, extra)), x, p)  # reruns the layer
        ct, ct_p = pullback(ct)
        sums = {name: _add_at(sums[name], index, g) for name, g in ct_p.items()}
        return (ct, sums), None

    layers = (jnp.arange(jax.tree.leaves(inputs)[0].shape[0]), inputs, params, extras)  # x may be a tuple
    (ct_x, sums), _ = jax.lax.scan(layer_back, (ct_y, sums), layers, reverse=True)
    return ct_x, None, None, sums


_scan_into_sums.defvjp(_forward_keeping_inputs, _backward_into_sums)


def _add_at(sum_L: jax.Array, index: jax.Array, g: jax.Array) -> jax.Array:
    """sum_L with g added to its slice `index` (an in-place update of the loop's carry)."""
    current = jax.lax.dynamic_index_in_dim(sum_L, index, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(sum_L, current + g.astype(sum_L.dtype), index, 0)


@jax.custom_vjp
def summing_into(param: jax.Array, sum_: jax.Array) -> jax.Array:
    """`param`, whose gradient goes to `sum_` (float32) as sum_ + d/d(param); param gets none."""
    del sum_
    return param


def _identity_keeping_sum(param, sum_):
    return param, sum_


def _add_into_sum(sum_, ct):
    return None, sum_ + ct.astype(sum_.dtype)


summing_into.defvjp(_identity_keeping_sum, _add_into_sum)


@jax.custom_vjp
def gradient_to(param: jax.Array, sum_: jax.Array) -> jax.Array:
    """`param`, whose gradient goes to `sum_` as it is (d/d(sum_) = d/d(param), no sum_ added: another use of sum_
    adds it once, e.g. `token_logprobs(unembed_sum=sum_)`); param gets none."""
    del sum_
    return param


def _pass_to_sum(sum_, ct):
    return None, ct.astype(sum_.dtype)


gradient_to.defvjp(_identity_keeping_sum, _pass_to_sum)
