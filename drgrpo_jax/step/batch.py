"""A training batch: its fields, its split into micro-batches and the packed rows those need.

Shape letters (docs/shape_letters.md): N responses, U prompt positions (left-padded), T response positions
(right-padded).
"""

from __future__ import annotations

from typing import Generic, TypeVar

import jax
import jax.numpy as jnp
from flax import struct

from drgrpo_jax.step.config import StepConfig
from drgrpo_jax.step.packing import PackSpec, window_rows_needed

__all__ = ["Batch", "join_micro_batches", "pack_demand", "pack_spec", "split_micro_batches"]

ArrayT = TypeVar("ArrayT")  # what a Batch holds: np.ndarray on the host, jax.Array on the mesh


@struct.dataclass
class Batch(Generic[ArrayT]):
    """One rollout batch of N responses, as arrays with N leading."""

    prompt_ids: ArrayT  # int32 [N, U], left-padded
    prompt_mask: ArrayT  # bool [N, U]
    response_ids: ArrayT  # int32 [N, T], right-padded
    response_mask: ArrayT  # bool [N, T]: the response's real tokens (the model reads them all)
    advantages: ArrayT  # float32 [N]
    old_logprobs: ArrayT  # float32 [N, T]: the policy before this update (recomputed by the trainer)
    behaviour_logprobs: ArrayT  # float32 [N, T]: the sampler's, for TIS and the mismatch metric
    row_valid: ArrayT  # bool [N]: False = a padding row added for static shapes
    # bool [N, T]: the tokens that count in the loss, the KL and the window's T_w; None = response_mask. A
    # multi-turn trajectory's environment and tool tokens are real (context) but not the model's: False here.
    loss_mask: ArrayT | None = None
    # int32 [N, U + T, L, k] (router replay, a mixture of experts): the experts every layer of the sampler chose for
    # each token of prompt_ids ++ response_ids as the model reads them (the last response token's are never read);
    # None = the policy's router chooses.
    routed_experts: ArrayT | None = None

    def tokens_in_loss(self) -> ArrayT:
        """The loss mask (response_mask where None); a loss token is always a real one."""
        if self.loss_mask is None:
            return self.response_mask
        return self.loss_mask & self.response_mask  # type: ignore[operator]  # arrays of either kind


def pack_spec(config: StepConfig, shards: int) -> PackSpec | None:
    """The packed layout of a step config on `shards` data-parallel shards; None when packing is off."""
    return PackSpec(config.pack_rows, config.pack_length, shards) if config.pack_rows else None


def pack_demand(config: StepConfig, batch: Batch, shards: int = 1) -> tuple[jax.Array, jax.Array]:
    """(most packed rows any shard of any micro-batch needs, longest sequence) of a window (packing on)."""
    spec = pack_spec(config, shards)
    assert spec is not None, "pack_demand needs StepConfig.pack_rows > 0"
    masks = (batch.prompt_mask, batch.response_mask, batch.row_valid)
    prompt_mask, response_mask, row_valid = split_micro_batches(masks, config.micro_batches)
    return window_rows_needed(prompt_mask, response_mask, row_valid, spec)


def split_micro_batches(tree, num: int):
    """[N, ...] -> [num, N / num, ...], micro-batch m taking rows m, m + num, ... (spread over every shard)."""

    def one(x):
        rows = x.shape[0]
        if rows % num:
            raise ValueError(f"train.micro_batches: {num} does not divide the window's {rows} responses")
        return jnp.swapaxes(x.reshape(rows // num, num, *x.shape[1:]), 0, 1)

    return jax.tree.map(one, tree)


def join_micro_batches(x):
    """Inverse of split_micro_batches for one array."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])
