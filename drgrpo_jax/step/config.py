"""What the training step computes (`StepConfig`), and the sampler/trainer importance weights it applies."""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from drgrpo_jax.errors import FieldError, FieldTypeError
from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models.logprobs import DEFAULT_CHUNK_SIZE
from drgrpo_jax.models.precision import DTYPES, DtypeName

__all__ = ["ImportanceLevel", "StepConfig", "importance_weights"]


ImportanceLevel = Literal["token", "sequence"]


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What the step computes; static under jit; validated at construction (FieldError naming the field)."""

    loss: LossConfig  # aggregation, clipping, KL and entropy terms
    micro_batches: int = 1  # gradient-accumulation slices of one window
    temperature: float = 1.0  # the sampler's temperature; log-probs use the same scaling
    tis_cap: float | None = None  # truncated importance sampling: cap C >= 1 on exp(old - behaviour); None = off
    tis_level: ImportanceLevel = "token"  # tis_cap's and mis_high's ratio: per token or per response
    mis_high: float | None = None  # masked importance sampling: weight 0 above this ratio (>= 1), else the ratio
    mis_low: float = 0.0  # masked importance sampling: weight 0 below this ratio too, in [0, 1]
    logprob_chunk: int = DEFAULT_CHUNK_SIZE  # tokens per chunk of the vocabulary projection
    # The rollout gets exactly one optimizer window (one epoch, one minibatch): the old policy IS the current
    # one, so its log-probs are this forward's with the gradient stopped and the batch's old_logprobs are unused.
    on_policy: bool = False
    # Mixed precision: "bfloat16" runs the model's GEMMs on a bfloat16 copy of the projection and unembedding
    # weights (float32 accumulation) while params, gradients, optimizer state, log-probs and the loss stay float32.
    compute_dtype: DtypeName = "float32"
    # Packing (step/packing.py): each data shard packs its responses of a micro-batch, each with its prompt,
    # into pack_rows rows of pack_length tokens, so padding is not computed; 0 = off (the padded layout).
    pack_rows: int = 0
    pack_length: int = 0
    # A mixture of experts' router terms, added to the loss (0 = off): Switch's load-balancing loss as transformers
    # computes it (1 when balanced) and ST-MoE's router z-loss, each over a micro-batch's tokens (models/moe.py).
    router_aux_coef: float = 0.0
    router_z_coef: float = 0.0

    def __post_init__(self):
        for name, kinds in [("micro_batches", int), ("logprob_chunk", int), ("temperature", (int, float)),
                            ("tis_cap", (int, float, type(None))), ("pack_rows", int), ("pack_length", int)]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kinds):
                wanted = "an int" if kinds is int else "a number"
                raise FieldTypeError("StepConfig", name, f"must be {wanted}, got {type(value).__name__} {value!r}")
        if not isinstance(self.on_policy, bool):
            raise FieldTypeError("StepConfig", "on_policy", f"must be a bool, got {self.on_policy!r}")
        for name in ("micro_batches", "logprob_chunk"):
            if getattr(self, name) < 1:
                raise FieldError("StepConfig", name, f"must be an int >= 1, got {getattr(self, name)}")
        if not 0 < self.temperature < float("inf"):
            raise FieldError("StepConfig", "temperature",
                             f"must be finite and > 0 for training log-probs, got {self.temperature}")
        # C < 1 would weight even on-policy tokens (ratio 1) by C: a smaller learning rate, not a truncation.
        if self.tis_cap is not None and not 1 <= self.tis_cap < float("inf"):
            raise FieldError("StepConfig", "tis_cap", "must be finite and >= 1 (a cap on an importance ratio), "
                                                      f"got {self.tis_cap}")
        self._check_masked_is()
        for name in ("router_aux_coef", "router_z_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise FieldTypeError("StepConfig", name, f"must be a number, got {type(value).__name__} {value!r}")
            if not 0 <= value < float("inf"):
                raise FieldError("StepConfig", name, f"must be finite and >= 0 (0 = off), got {value}")
        for name in ("pack_rows", "pack_length"):
            if getattr(self, name) < 0:
                raise FieldError("StepConfig", name, f"must be an int >= 0 (0 = no packing), got {getattr(self, name)}")
        if self.pack_rows and self.pack_length < 1:
            raise FieldError("StepConfig", "pack_length", f"must be >= 1 with pack_rows = {self.pack_rows}")
        if self.compute_dtype not in DTYPES:
            raise FieldError("StepConfig", "compute_dtype", f"unknown {self.compute_dtype!r}; choose one of "
                                                            f"{sorted(DTYPES)}")

    def _check_masked_is(self):
        if self.tis_level not in get_args(ImportanceLevel):
            raise FieldError("StepConfig", "tis_level", f"unknown {self.tis_level!r}; choose one of "
                                                        f"{get_args(ImportanceLevel)}")
        for name, kinds in [("mis_high", (int, float, type(None))), ("mis_low", (int, float))]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise FieldTypeError("StepConfig", name, f"must be a number, got {type(value).__name__} {value!r}")
        if self.mis_high is not None and not 1 <= self.mis_high < float("inf"):
            raise FieldError("StepConfig", "mis_high", f"must be finite and >= 1 (on-policy tokens have ratio 1), "
                                                       f"got {self.mis_high}")
        if not 0 <= self.mis_low <= 1:
            raise FieldError("StepConfig", "mis_low", f"must be in [0, 1] (on-policy tokens have ratio 1), "
                                                      f"got {self.mis_low}")
        if self.mis_low > 0 and self.mis_high is None:
            raise FieldError("StepConfig", "mis_low", "needs mis_high (masked importance sampling is off)")
        if self.mis_high is not None and self.tis_cap is not None:
            raise FieldError("StepConfig", "mis_high", "and tis_cap correct the same mismatch two ways; set one")


def importance_weights(mismatch_NT: jax.Array, config: StepConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(weight, truncated, dropped) [N, T] of the sampler/trainer mismatch log(pi_old / pi_sampler) per token.

    The ratio is per token, or at tis_level="sequence" the product over each response (a fact of one
    row, so exact under any split by rows). TIS: min(ratio, tis_cap). MIS: the ratio inside
    [mis_low, mis_high], else 0 (the response or token leaves the policy gradient; it still counts in the
    window's N_w and T_w, which are facts of the rollout). Neither: 1.
    """
    log_ratio = mismatch_NT
    if config.tis_level == "sequence":
        log_ratio = jnp.broadcast_to(mismatch_NT.sum(axis=1, keepdims=True), mismatch_NT.shape)
    none = jnp.zeros(mismatch_NT.shape, bool)
    ratio = jnp.exp(log_ratio)  # may overflow to inf at the sequence level: capped or masked below, never used
    if config.tis_cap is not None:
        return jnp.minimum(ratio, config.tis_cap), ratio > config.tis_cap, none
    if config.mis_high is not None:
        inside = (ratio <= config.mis_high) & (ratio >= config.mis_low)
        return jnp.where(inside, ratio, 0.0), none, ~inside
    return jnp.ones(mismatch_NT.shape, jnp.float32), none, none


