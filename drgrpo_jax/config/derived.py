"""The library's own configs built from the run config, each refusal named by its config key.

`LossConfig`, `StepConfig` and `LoraSpec` validate their fields themselves; building them here is how the
run config is checked against those rules (one place per rule), and `_LIBRARY_KEYS` turns the field a
library config refuses into the run-config key a user would edit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from drgrpo_jax.algorithms import ALGORITHMS, check_algorithm_options
from drgrpo_jax.config.schema import AlgorithmConfig, Config, RewardConfig
from drgrpo_jax.errors import ConfigError, FieldError
from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models.config import LoraSpec
from drgrpo_jax.step.config import StepConfig
from drgrpo_jax.step.optimizer import make_optimizer

__all__ = ["child_service_batch_size", "component_names", "function_name", "lora_base_dtype", "lora_spec",
           "one_window_per_rollout", "optimizer_of", "pack_length", "reward_weights", "step_configs"]

# Where each field of the library's configs comes from in the run config: FieldError(owner, field) -> key.
_LIBRARY_KEYS: dict[tuple[str, str], str] = {
    ("algorithm", "name"): "algorithm.name",
    ("algorithm", "scale_rewards"): "algorithm.scale_rewards",
    ("algorithm", "whiten_advantages"): "algorithm.whiten_advantages",
    ("algorithm", "kl_in_reward"): "algorithm.kl_in_reward",
    ("algorithm", "group_size"): "rollout.group_size",
    ("LossConfig", "aggregation"): "algorithm.name",
    ("LossConfig", "budget"): "rollout.max_new_tokens",
    ("LossConfig", "clip_low"): "algorithm.clip_low",
    ("LossConfig", "clip_high"): "algorithm.clip_high",
    ("LossConfig", "dual_clip"): "algorithm.dual_clip",
    ("LossConfig", "kl_coef"): "algorithm.kl_coef",
    ("LossConfig", "kl_estimator"): "algorithm.kl_estimator",
    ("LossConfig", "entropy_coef"): "algorithm.entropy_coef",
    ("LossConfig", "policy_loss"): "algorithm.name",
    ("StepConfig", "micro_batches"): "train.micro_batches",
    ("StepConfig", "temperature"): "rollout.temperature",
    ("StepConfig", "tis_cap"): "algorithm.tis_cap",
    ("StepConfig", "tis_level"): "algorithm.tis_level",
    ("StepConfig", "mis_high"): "algorithm.mis_high",
    ("StepConfig", "mis_low"): "algorithm.mis_low",
    ("StepConfig", "compute_dtype"): "model.compute_dtype",
    ("StepConfig", "pack_rows"): "train.pack_rows",
    ("StepConfig", "pack_length"): "train.pack_length",
    ("StepConfig", "router_aux_coef"): "model.moe.router_aux_coef",
    ("StepConfig", "router_z_coef"): "model.moe.router_z_coef",
    ("LoraSpec", "rank"): "model.lora.rank",
    ("LoraSpec", "alpha"): "model.lora.alpha",
    ("LoraSpec", "dropout"): "model.lora.dropout",
    ("LoraSpec", "targets"): "model.lora.targets",
}


def lora_base_dtype(config: Config) -> str:
    """The dtype the trainer stores the frozen LoRA base's projections in (model.lora.base_dtype made concrete)."""
    return config.model.dtype if config.model.lora.base_dtype == "model" else config.model.lora.base_dtype


def lora_spec(config: Config) -> LoraSpec | None:
    """The adapters' spec from model.lora (None when rank is 0: full fine-tuning); ConfigError naming the key."""
    lora = config.model.lora
    if lora.rank == 0:
        return None
    try:
        return LoraSpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=tuple(lora.targets))
    except FieldError as error:
        raise ConfigError(_LIBRARY_KEYS[(error.owner, error.field)], error.reason) from None


def one_window_per_rollout(algorithm: AlgorithmConfig) -> bool:
    """A rollout gets exactly one optimizer window: its old log-probs are the updating policy's own."""
    return algorithm.ppo_epochs == 1 and algorithm.minibatches_per_rollout == 1


def step_configs(config: Config, compute_dtype: str | None = None) -> tuple[StepConfig, StepConfig]:
    """(train StepConfig, StepConfig for the old log-probs of a whole rollout); ConfigError naming the key.

    `compute_dtype`: model.compute_dtype made concrete for the device (`models.precision.resolve_compute_dtype`);
    None = the configured one, "auto" counting as float32 (validation knows no device).
    """
    a = config.algorithm
    if compute_dtype is None:
        compute_dtype = "float32" if config.model.compute_dtype == "auto" else config.model.compute_dtype
    try:
        check_algorithm_options(a.name, scale_rewards=a.scale_rewards, whiten_advantages=a.whiten_advantages,
                                kl_in_reward=a.kl_in_reward, group_size=config.rollout.group_size)
        # Multi-turn rows: the budget is over the model's tokens of the whole trajectory (docs/tools.md).
        budget = config.environment.max_model_tokens if config.environment.enabled else config.rollout.max_new_tokens
        loss = LossConfig(aggregation=ALGORITHMS[a.name].aggregation, budget=budget,
                          clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip, kl_coef=a.kl_coef,
                          kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef,
                          policy_loss=ALGORITHMS[a.name].policy_loss)
        train = StepConfig(loss=loss, micro_batches=config.train.micro_batches,
                           temperature=config.rollout.temperature, tis_cap=a.tis_cap, tis_level=a.tis_level,
                           mis_high=a.mis_high, mis_low=a.mis_low, on_policy=one_window_per_rollout(a),
                           compute_dtype=compute_dtype,  # type: ignore[arg-type]  # StepConfig checks it
                           pack_rows=config.train.pack_rows, pack_length=pack_length(config),
                           router_aux_coef=config.model.moe.router_aux_coef,
                           router_z_coef=config.model.moe.router_z_coef)
    except FieldError as error:
        key = _LIBRARY_KEYS.get((error.owner, error.field))
        if key is None:  # a field the run config does not set: a bug here, not a bad config
            raise
        raise ConfigError(key, error.reason) from None
    # The old log-probs run over the whole rollout: as many slices as all its updates' micro-batches.
    logprob = dataclasses.replace(train, micro_batches=config.train.micro_batches * a.minibatches_per_rollout,
                                  on_policy=False)
    return train, logprob


def child_service_batch_size(config: Config) -> int:
    """--max-batch-size of the trainer's own child service: rollout.service_batch_size, else a whole rollout or
    the eval set, whichever is larger (it serves this trainer alone)."""
    r = config.rollout
    return r.service_batch_size or max(r.prompts_per_step * r.group_size, config.data.eval_size)


def pack_length(config: Config) -> int:
    """Tokens per packed row: train.pack_length, or 0 (packing off), or the longest prompt and response."""
    t, r = config.train, config.rollout
    if not t.pack_rows:
        return t.pack_length
    return t.pack_length or r.max_prompt_tokens + r.max_new_tokens - 1


def optimizer_of(config: Config) -> tuple[Any, Any]:
    """(optax optimizer, learning-rate schedule) over every update of the run."""
    o, a = config.optimizer, config.algorithm
    updates = config.train.steps * a.ppo_epochs * a.minibatches_per_rollout
    return make_optimizer(o.learning_rate, total_steps=updates, warmup_steps=o.warmup_steps, decay=o.decay,
                          weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps,
                          max_grad_norm=o.max_grad_norm or None)


def function_name(target: str) -> str:
    """A reward function's component name: the built-in's name or the import path's function name."""
    return target.rpartition(":")[2]


def component_names(reward: RewardConfig) -> tuple[str, ...]:
    """The K reward components, in order: reward.components, else one per function."""
    return tuple(reward.components) or tuple(function_name(t) for t in reward.functions)


def reward_weights(config: Config) -> tuple[float, ...]:
    """reward.weights, or 1 for every component."""
    return tuple(config.reward.weights) or (1.0,) * len(component_names(config.reward))
