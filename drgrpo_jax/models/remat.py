"""Rematerialisation policies of the decoder layers: what each layer keeps for the backward pass.

`REMAT_POLICIES` runs from most memory (least recomputation) to least; `remat_block` says what each keeps.
Every policy gives the same loss and gradients (tests/models/test_models.py); `drgrpo_jax.plan.activations`
models the memory of each and `drgrpo_jax.plan` picks one for `model.remat: auto`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

__all__ = ["ATTENTION", "PROJECTION", "REMAT_POLICIES", "name_attention", "name_projection", "normalise_remat",
           "remat_block"]

REMAT_POLICIES = ("none", "dots_saveable", "save_attention_out", "full")  # most memory first
PROJECTION = "projection"  # checkpoint name of each projection's output (models/transformer.py)
ATTENTION = "attention"  # checkpoint name of the attention output and the blockwise kernel's statistics


def normalise_remat(value: str) -> str:
    """The policy `value` names, in lower case; ValueError naming the choices (a bool is no policy)."""
    if not isinstance(value, str) or value.lower() not in REMAT_POLICIES:
        raise ValueError(f"remat: {value!r} is not a policy (choose one of {', '.join(REMAT_POLICIES)})")
    return value.lower()


def name_projection(x: jax.Array) -> jax.Array:
    """x tagged as a projection output (identity outside a rematerialised layer)."""
    return checkpoint_name(x, PROJECTION)


def name_attention(x: jax.Array) -> jax.Array:
    """x tagged as attention output or statistics (identity outside a rematerialised layer)."""
    return checkpoint_name(x, ATTENTION)


_SAVED_NAMES = {"dots_saveable": (PROJECTION, ATTENTION), "save_attention_out": (ATTENTION,), "full": ()}


def remat_block(block: Callable, policy: str) -> Callable:
    """`block` (one scanned decoder layer) under the rematerialisation `policy`, which keeps for the backward:

    - `none`: everything the backward needs;
    - `dots_saveable`: every projection's output (the names `PROJECTION`) and the attention's output and softmax
      statistics (`ATTENTION`); the backward recomputes the elementwise work (norms, RoPE, the gate) and, for the
      reference attention, its scores. JAX's own `dots_saveable` would also keep the reference's [S, S] score
      matmuls; this one saves by name and never does;
    - `save_attention_out`: the attention's output and softmax statistics; the backward recomputes the projections
      and the MLP but not the blockwise attention (the reference, cuDNN and splash attention are recomputed: their
      probabilities or kernel statistics carry no name);
    - `full`: only each layer's input; the backward reruns the whole layer.
    """
    policy = normalise_remat(policy)
    if policy == "none":
        return block
    names = _SAVED_NAMES[policy]
    saved = jax.checkpoint_policies.save_only_these_names(*names) if names else None
    return jax.checkpoint(block, policy=saved)
