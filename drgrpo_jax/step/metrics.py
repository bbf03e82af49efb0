"""What one training step reports: typed metrics, one field per metric, and the metrics.jsonl keys they become.

`train_step` returns a `StepMetrics` (a pytree: it crosses `jax.jit` and `jax.device_get` whole). The loss's
metrics stay a dict (`loss_fn`'s public contract) and become typed once, in `TokenMeans.of_loss`: a key the loss
adds, renames or drops fails there when the step is traced, so no metric is lost silently. `row` names the fields
as metrics.jsonl does; readers use the fields.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from drgrpo_jax.models.moe import RouterStats, expert_load, load_balancing_loss, router_z_loss

__all__ = ["RouterMetrics", "StepMetrics", "TokenMeans", "router_metrics"]


def _scalars_row(metrics) -> dict[str, float]:
    """Each field of a dataclass of scalars as `{field name: float}`, in field order."""
    return {field.name: float(getattr(metrics, field.name)) for field in dataclasses.fields(metrics)}


@struct.dataclass
class TokenMeans:
    """Token means over the window (each micro-batch adds its share): the loss's metrics and the sampler's."""

    pg_loss: jax.Array
    kl: jax.Array  # the policy against the reference (0 without one)
    entropy: jax.Array
    clip_fraction: jax.Array
    approx_kl: jax.Array  # k2 of the old policy against the current one
    behaviour_kl: jax.Array  # k3 of the sampler's (behaviour) policy against the old policy
    tis_weight: jax.Array  # the importance weight on the advantage (1 without TIS / MIS)
    is_truncated: jax.Array  # share of tokens whose weight was capped
    is_dropped: jax.Array  # share of tokens whose weight was zeroed (MIS)

    @classmethod
    def of_loss(cls, loss_metrics: dict[str, jax.Array], *, behaviour_kl: jax.Array, tis_weight: jax.Array,
                is_truncated: jax.Array, is_dropped: jax.Array) -> TokenMeans:
        """`loss_fn`'s metrics with the sampler's; a loss key with no field here (or a field it lacks) is a
        TypeError at trace time."""
        return cls(**loss_metrics, behaviour_kl=behaviour_kl, tis_weight=tis_weight, is_truncated=is_truncated,
                   is_dropped=is_dropped)

    @classmethod
    def zeros(cls) -> TokenMeans:
        """Every mean 0: the start of the sum over micro-batches."""
        return cls(**{field.name: jnp.zeros((), jnp.float32) for field in dataclasses.fields(cls)})

    def row(self) -> dict[str, float]:
        return _scalars_row(self)


@struct.dataclass
class RouterMetrics:
    """A mixture's router over the window: its two loss terms (whatever their coefficients) and each layer's load."""

    aux_loss: jax.Array  # load balancing (1 balanced)
    z_loss: jax.Array
    expert_max_share_L: jax.Array  # the busiest expert's share per layer: 1/e balanced, 1 collapsed
    expert_entropy_L: jax.Array  # the shares' entropy per layer, nats: log e balanced, 0 collapsed

    def row(self) -> dict[str, float]:
        """`router_aux_loss`, `router_z_loss`, then `expert_max_share/<layer>` and `expert_entropy/<layer>`."""
        row = {"router_aux_loss": float(self.aux_loss), "router_z_loss": float(self.z_loss)}
        for layer, (share, entropy) in enumerate(zip(self.expert_max_share_L, self.expert_entropy_L, strict=True)):
            row |= {f"expert_max_share/{layer}": float(share), f"expert_entropy/{layer}": float(entropy)}
        return row


def router_metrics(stats: RouterStats) -> RouterMetrics:
    """The router's metrics from its window's sums."""
    max_share_L, entropy_L = expert_load(stats)
    return RouterMetrics(aux_loss=load_balancing_loss(stats), z_loss=router_z_loss(stats),
                         expert_max_share_L=max_share_L, expert_entropy_L=entropy_L)


@struct.dataclass
class StepMetrics:
    """One optimizer window's metrics, global over the mesh: what `train_step` returns (all float32)."""

    tokens: TokenMeans
    router: RouterMetrics | None  # a mixture of experts only
    pack_overflow: jax.Array | None  # packed rows only: 1 when the window did not fit them (and was skipped)
    loss: jax.Array  # the window's loss (its aggregation's)
    grad_norm: jax.Array
    learning_rate: jax.Array  # the schedule's at this step
    num_responses: jax.Array  # N_w
    num_tokens: jax.Array  # T_w
    skipped: jax.Array  # 1: no update (an empty window or a packing overflow)

    def row(self) -> dict[str, float]:
        """The metrics under their metrics.jsonl keys (host values: after `jax.device_get`); absent parts add none."""
        row: dict[str, float] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, (TokenMeans, RouterMetrics)):
                row |= value.row()
            elif value is not None:
                row[field.name] = float(value)
        return row
