"""Cross-field rules OmegaConf's typing cannot express; `validate` runs them all.

The rules of the library's own configs live in them alone: `validate` builds them from the run config
(`derived.py`), which names the config key of any field they refuse.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import re
import tempfile
import threading
import urllib.parse

import numpy as np

from drgrpo_jax.algorithms import ALGORITHMS
from drgrpo_jax.config.derived import component_names, lora_spec, pack_length, step_configs
from drgrpo_jax.config.engines import ENGINE_TRAITS
from drgrpo_jax.config.schema import BUILTIN_REWARDS, BUILTIN_TOOLS, TRACKERS, Config, MeshConfig, RunConfig
from drgrpo_jax.errors import ConfigError, MissingValueError
from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.context_parallel import CANNOT_SPLIT
from drgrpo_jax.models.remat import REMAT_POLICIES
from drgrpo_jax.sharding import parse_service_mesh
from drgrpo_jax.weight_folders import is_remote

__all__ = ["check_model_options", "check_output_dir", "validate"]

# ---------------------------------------------------------------------------------------------
# Validation: cross-field rules OmegaConf's typing cannot express
# ---------------------------------------------------------------------------------------------

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A service URL's characters: no whitespace, quote or shell metacharacter (the launchers pass URLs to shells)
_URL_CHARS = re.compile(r"[A-Za-z0-9._~:/\[\]@%-]+")



# The bounds of the run's own numeric fields, one rule per family (the library configs check theirs: step_configs).
# NaN fails every comparison, so each bound also refuses it.
INT32_MAX = 2**31 - 1  # counts and token totals reach int32 arrays (JAX indexes with int32)
SEED_MAX = 2**32 - 1  # seeds.py derives uint32 seeds; numpy refuses a negative one
WAIT_MAX = threading.TIMEOUT_MAX  # the longest wait Python's locks and queues accept


def _at_least(key: str, value: float, low: float) -> None:
    if not value >= low:  # also catches NaN
        raise ConfigError(key, f"must be >= {low}, got {value}")


def _finite(key: str, value: float) -> None:
    if not math.isfinite(value):
        raise ConfigError(key, f"must be a finite number, got {value}")


def _count(key: str, value: int, low: int) -> None:
    """A count or size: an int in [low, INT32_MAX]."""
    _at_least(key, value, low)
    if value > INT32_MAX:
        raise ConfigError(key, f"must be <= {INT32_MAX} (counts reach int32 arrays), got {value}")


def _counts(config: Config) -> list[tuple[str, int, int]]:
    """(key, value, lowest) of every count and size of the run's own fields."""
    c, e = config, config.environment
    return [
        ("run.log_every", c.run.log_every, 1),
        ("run.sample_every", c.run.sample_every, 0),
        ("model.lora.rank", c.model.lora.rank, 0),
        ("data.size", c.data.size, 0),
        ("data.eval_size", c.data.eval_size, 0),
        ("rollout.group_size", c.rollout.group_size, 1),
        ("rollout.prompts_per_step", c.rollout.prompts_per_step, 1),
        ("rollout.max_prompt_tokens", c.rollout.max_prompt_tokens, 1),
        ("rollout.top_k", c.rollout.top_k, 0),
        ("rollout.max_staleness", c.rollout.max_staleness, 0),
        ("rollout.max_resample_rounds", c.rollout.max_resample_rounds, 0),
        ("rollout.service_batch_size", 1 if c.rollout.service_batch_size is None else c.rollout.service_batch_size, 1),
        ("rollout.service_prefix_cache_bytes", c.rollout.service_prefix_cache_bytes, -1),
        ("algorithm.ppo_epochs", c.algorithm.ppo_epochs, 1),
        ("algorithm.minibatches_per_rollout", c.algorithm.minibatches_per_rollout, 1),
        ("reward.num_workers", c.reward.num_workers, 1),
        ("reward.overlong_buffer", c.reward.overlong_buffer, 0),
        ("optimizer.warmup_steps", c.optimizer.warmup_steps, 0),
        ("train.steps", c.train.steps, 1),
        ("train.micro_batches", c.train.micro_batches, 1),
        ("train.eval_every", c.train.eval_every, 0),
        ("train.eval_samples", c.train.eval_samples, 0),
        ("train.save_every", c.train.save_every, 1),
        ("train.keep_checkpoints", c.train.keep_checkpoints, 1),
        ("train.pack_rows", c.train.pack_rows, 0),
        ("train.pack_length", c.train.pack_length, 0),
        ("mesh.data", c.mesh.data, 1),
        ("mesh.fsdp", c.mesh.fsdp, 1),
        ("mesh.tensor", c.mesh.tensor, 1),
        ("mesh.context", c.mesh.context, 1),
        ("mesh.dcn_data", c.mesh.dcn_data, 1),
        ("mesh.num_processes", c.mesh.num_processes, 1),
        ("mesh.process_id", c.mesh.process_id, 0),
        ("environment.max_turns", e.max_turns, 1),
        ("environment.max_turn_tokens", e.max_turn_tokens, 1),
        ("environment.max_model_tokens", e.max_model_tokens, 1),
        ("environment.max_tool_calls", e.max_tool_calls, 0),
        ("environment.python_memory_mb", e.python_memory_mb, 1),
    ]


def _check_ranges(config: Config) -> None:
    """Per-field bounds of the run's own fields, by family: counts, seconds, scales, fractions, the seed."""
    c = config
    for key, count, low in _counts(c):
        _count(key, count, low)
    for key, seconds in [  # waits: finite, > 0 and no longer than a thread may wait
        ("rollout.timeout_s", c.rollout.timeout_s),
        ("reward.timeout_s", c.reward.timeout_s),
        ("environment.tool_timeout_s", c.environment.tool_timeout_s),
        ("environment.python_timeout_s", c.environment.python_timeout_s),
    ]:
        if not 0 < seconds <= WAIT_MAX:
            raise ConfigError(key, f"must be > 0 and <= {WAIT_MAX:.0f} seconds, got {seconds}")
    for key, scale, positive, high in [  # scales: finite, > 0 (or >= 0) and at most `high`
        ("optimizer.learning_rate", c.optimizer.learning_rate, True, 1.0),  # Adam moves a weight ~lr a step
        ("optimizer.eps", c.optimizer.eps, True, math.inf),
        ("optimizer.weight_decay", c.optimizer.weight_decay, False, math.inf),
        ("optimizer.max_grad_norm", c.optimizer.max_grad_norm, False, math.inf),  # 0 = no clipping
        ("train.eval_temperature", c.train.eval_temperature, False, math.inf),
    ]:
        if not (math.isfinite(scale) and (scale > 0 if positive else scale >= 0) and scale <= high):
            bound = ("> 0" if positive else ">= 0") + (f" and <= {high}" if high < math.inf else "")
            raise ConfigError(key, f"must be finite and {bound}, got {scale}")
    if c.train.eval_samples and c.train.eval_temperature <= 0:
        raise ConfigError("train.eval_temperature", f"must be > 0 to sample train.eval_samples = "
                          f"{c.train.eval_samples} completions, got {c.train.eval_temperature}")
    if not 0.0 < c.rollout.top_p <= 1.0:
        raise ConfigError("rollout.top_p", f"must be in (0, 1], got {c.rollout.top_p}")
    for key, value in [("optimizer.b1", c.optimizer.b1), ("optimizer.b2", c.optimizer.b2)]:
        if not 0.0 <= value < 1.0:
            raise ConfigError(key, f"must be in [0, 1), got {value}")
    if not 0 <= c.run.seed <= SEED_MAX:
        raise ConfigError("run.seed", f"must be in [0, {SEED_MAX}] (seeds are uint32), got {c.run.seed}")
    _check_rollout_size(c)


def _check_rollout_size(config: Config) -> None:
    """A rollout's tokens, P * G rows of the longest prompt and budget, fit the int32 arrays that hold them."""
    r = config.rollout
    tokens = r.prompts_per_step * r.group_size * (r.max_prompt_tokens + r.max_new_tokens)
    if tokens > INT32_MAX:
        key = "rollout.group_size" if r.group_size >= r.prompts_per_step else "rollout.prompts_per_step"
        raise ConfigError(key, f"rollout.prompts_per_step * rollout.group_size * (rollout.max_prompt_tokens + "
                               f"rollout.max_new_tokens) = {tokens} tokens a rollout; its int32 arrays hold at most "
                               f"{INT32_MAX}")


def _check_base_dtype(config: Config) -> None:
    """model.lora.base_dtype: only with adapters, never wider than model.dtype, bfloat16 computes in bfloat16."""
    lora, model = config.model.lora, config.model
    if lora.base_dtype == "model":
        return
    if lora.rank == 0:
        raise ConfigError("model.lora.base_dtype", f"{lora.base_dtype} needs model.lora.rank > 0 (full fine-tuning "
                                                   "trains every weight in model.dtype)")
    if lora.base_dtype == "float32" and model.dtype == "bfloat16":
        raise ConfigError("model.lora.base_dtype", "float32 would widen the bfloat16 weights model.dtype loads; "
                                                   "use model, or model.dtype=float32")
    if lora.base_dtype == "bfloat16" and model.compute_dtype == "float32":
        raise ConfigError("model.lora.base_dtype", "bfloat16 projections compute in bfloat16, but "
                                                   "model.compute_dtype=float32; set it to auto or bfloat16")


def _check_packing(config: Config, per_device: int) -> None:
    """Packed rows: no more than the responses a device holds, and one row holds the longest sequence."""
    t, r = config.train, config.rollout
    longest = r.max_prompt_tokens + r.max_new_tokens - 1
    if t.pack_length and not t.pack_rows:
        raise ConfigError("train.pack_length", "needs train.pack_rows > 0 (packing is off)")
    if t.pack_rows > per_device:
        raise ConfigError("train.pack_rows", f"{t.pack_rows} rows for the {per_device} response(s) a device holds "
                                             "per micro-batch: more rows than responses packs nothing")
    if t.pack_rows and pack_length(config) < longest:
        raise ConfigError("train.pack_length", f"{t.pack_length} tokens cannot hold a response with its prompt: "
                                               f"rollout.max_prompt_tokens + rollout.max_new_tokens - 1 = {longest}")


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
    _check_packing(config, per_micro // data_parallel)
    _check_context(config)


def _check_context(config: Config) -> None:
    """mesh.context > 1 splits each row's tokens (the step pads rows to whole chunks itself): no attention kernel
    that reads a whole row on one device."""
    ways, impl = config.mesh.context, config.model.attention_impl
    if ways > 1 and impl in CANNOT_SPLIT:
        raise ConfigError("mesh.context", f"{ways} splits each row, but model.attention_impl={impl} reads every key "
                                          "of a row on one device; use auto or blockwise")


def _check_rest(config: Config) -> None:
    """Model, data, reward and multi-host rules."""
    c = config
    if not c.model.path:
        raise MissingValueError("model.path", "must be set (a local Hugging Face model folder, a .gguf file, "
                                              "pkg:PACKAGE or a Hub id org/name[@revision])")
    if c.data.source != "reasoning_gym" and not c.data.path:
        raise MissingValueError("data.path", f"must be set when data.source={c.data.source}")
    if "{question}" not in c.data.template:
        raise ConfigError("data.template", "must contain the {question} placeholder")
    for key, value in [("data.subset", c.data.subset), ("data.eval_split", c.data.eval_split)]:
        if value and c.data.source == "reasoning_gym":
            raise ConfigError(key, f"{value!r} names part of an HF dataset (data.path); data.source=reasoning_gym "
                                   "generates its problems")
    if c.data.source == "reasoning_gym" and c.data.size < 1:
        raise ConfigError("data.size", f"reasoning-gym needs at least 1 example, got {c.data.size}")
    if c.model.remat not in ("auto", *REMAT_POLICIES):
        # YAML's true/false reach this str field as 'True'/'False': say what they used to mean.
        was = {"true": "; true is now full", "false": "; false is now none"}.get(c.model.remat.lower(), "")
        raise ConfigError("model.remat", f"{c.model.remat!r} is not a policy: auto, {', '.join(REMAT_POLICIES)}{was}")
    if c.model.compute_dtype == "float32" and c.model.dtype == "bfloat16":
        raise ConfigError("model.compute_dtype", "float32 needs model.dtype=float32 (bfloat16 parameters compute in "
                                                 "bfloat16; set model.compute_dtype=auto or bfloat16)")
    if not c.reward.functions:
        raise ConfigError("reward.functions", "needs at least one reward function")
    for i, name in enumerate(c.reward.functions):
        if name not in BUILTIN_REWARDS and not _IMPORT_PATH.match(name):
            close = difflib.get_close_matches(name, BUILTIN_REWARDS, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(
                f"reward.functions[{i}]",
                f"{name!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor 'package.module:function'{hint}",
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
    if c.reward.weights and not any(c.reward.weights):
        raise ConfigError("reward.weights", "are all 0: every reward would be 0 and no step would learn")
    _check_float32_weights(c)
    _check_run_outputs(c.run)
    _check_mesh_start_up(c.mesh)
    if c.mesh.num_processes > 1 and not c.mesh.coordinator_address:
        raise MissingValueError("mesh.coordinator_address", "must be set (host:port) when mesh.num_processes > 1")
    if c.mesh.num_processes > 1 and not c.rollout.urls:
        raise ConfigError("rollout.urls", f"must list the generation services when mesh.num_processes = "
                                          f"{c.mesh.num_processes}: the trainer's mesh takes every device of every "
                                          "host, so start the services apart (python -m drgrpo_jax.launch starts "
                                          "them)")


def _check_mesh_start_up(m: MeshConfig) -> None:
    """The DCN split and the start-up: explicit (host:port, count, id), auto (all detected) or one host."""
    if m.data % m.dcn_data:
        raise ConfigError("mesh.dcn_data", f"{m.dcn_data} does not divide mesh.data = {m.data} (each slice holds "
                                           "mesh.data / mesh.dcn_data of the data ways)")
    if m.coordinator_address == "auto":
        for key, value, default in [("mesh.num_processes", m.num_processes, 1), ("mesh.process_id", m.process_id, 0)]:
            if value != default:
                raise ConfigError(key, "is detected with mesh.coordinator_address=auto; leave it unset")
    elif m.coordinator_port is not None:
        raise ConfigError("mesh.coordinator_port", "is for mesh.coordinator_address=auto; give the port in the "
                                                   "address (host:port)")
    elif m.coordinator_address and not re.fullmatch(r".+:\d+", m.coordinator_address):
        raise ConfigError("mesh.coordinator_address", f"{m.coordinator_address!r} is not host:port or auto")
    if m.coordinator_port is not None and not 0 < m.coordinator_port < 65536:
        raise ConfigError("mesh.coordinator_port", f"{m.coordinator_port} is not a port (1-65535)")
    if m.process_id >= m.num_processes:
        raise ConfigError("mesh.process_id", f"must be < mesh.num_processes = {m.num_processes}")


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


def _check_float32_weights(config: Config) -> None:
    """The trainer multiplies in float32: a weight must survive the cast, and a multi-reward algorithm's (GDPO's),
    which weights each component's own advantages, must stay apart and not all be 0."""
    weights = config.reward.weights
    with np.errstate(over="ignore"):  # an overflow is reported below, naming the weight
        cast = np.asarray(weights, np.float64).astype(np.float32) if weights else np.zeros(0, np.float32)
    for i, (weight, value) in enumerate(zip(weights, cast)):
        if not np.isfinite(value):
            limit = np.finfo(np.float32).max
            raise ConfigError(f"reward.weights[{i}]", f"{weight} overflows float32 (|w| must be < {limit:.4g})")
        if weight != 0 and value == 0:
            raise ConfigError(f"reward.weights[{i}]", f"{weight} underflows to 0 in float32")
    name = config.algorithm.name
    if not ALGORITHMS[name].multi_reward:
        return
    for j in range(len(weights)):
        for i in range(j):
            if weights[i] != weights[j] and cast[i] == cast[j]:
                raise ConfigError(
                    f"reward.weights[{j}]",
                    f"{weights[j]} and reward.weights[{i}] = {weights[i]} collapse to one float32 value "
                    f"{float(cast[i])!r}; "
                    f"{name} would weight the two components the same",
                )


def _check_rollout_modes(config: Config) -> None:
    """rollout.weight_sync=shm needs a whole model for the trainer's own child; rollout.async a staleness
    allowance and an importance correction for the one-step lag."""
    r, lora = config.rollout, config.model.lora
    try:
        parse_service_mesh(r.service_mesh, "rollout.service_mesh")
    except ValueError as error:
        raise ConfigError("rollout.service_mesh", str(error).removeprefix("rollout.service_mesh: ")) from None
    if r.weight_sync == "shm":
        reason = ("remote services (rollout.urls) load from disk" if r.urls else
                  "model.lora.push=adapter sends a PEFT folder (set model.lora.push=merged)"
                  if lora.rank and lora.push == "adapter" else
                  "run.weights_dir mirrors each version on disk" if config.run.weights_dir else "")
        if reason:
            raise ConfigError("rollout.weight_sync", f"shm pushes whole models to the trainer's own child service; "
                                                     f"{reason}; use auto or disk")
    engine = ENGINE_TRAITS[r.engine]
    if not engine.starts_locally and not r.urls:
        raise ConfigError("rollout.engine", f"{r.engine} is the API of the services at rollout.urls, which is empty "
                                            "(the trainer's own child service speaks ours)")
    if not engine.loads_lora_adapters and lora.rank and lora.push == "adapter":
        raise ConfigError("model.lora.push", f"adapter: {engine.label} reloads whole models; set "
                                             f"model.lora.push=merged with rollout.engine={r.engine}")
    if config.model.moe.router_replay and config.environment.enabled:
        raise ConfigError("model.moe.router_replay", "replays single-turn rollouts only; multi-turn episodes "
                                                     "(environment.tools or factory) sample each turn in its own "
                                                     "request, whose experts are not joined into the trajectory")
    if r.async_ and r.max_staleness < 1:
        raise ConfigError("rollout.max_staleness", "must be >= 1 with rollout.async=true (each rollout is sampled "
                                                   "by a policy K = max_staleness versions before the one it trains)")
    if r.async_ and config.algorithm.tis_cap is None and config.algorithm.mis_high is None:
        raise ConfigError("algorithm.tis_cap", "must be set (e.g. 2.0), or algorithm.mis_high, with "
                                               "rollout.async=true: the importance weight corrects the lag")
    if r.inflight_updates and not r.async_:
        raise ConfigError("rollout.inflight_updates", "needs rollout.async=true (pushes reach the rounds sampled "
                                                      "ahead of the update)")
    if r.inflight_updates and not engine.inflight_updates:
        able = " or ".join(name for name, traits in ENGINE_TRAITS.items() if traits.inflight_updates)
        raise ConfigError("rollout.inflight_updates", f"needs rollout.engine={able}: {r.engine} does not report "
                                                      "each token's weight version")
    if r.inflight_updates and config.mesh.num_processes > 1:
        raise ConfigError("rollout.inflight_updates", "runs on one process only (mesh.num_processes = "
                                                      f"{config.mesh.num_processes}): a checkpoint holds the "
                                                      "queued rounds of this process")


def _check_environment(config: Config) -> None:
    """environment.*: tool names, the call format and the model's budget, checked only when episodes are on (the
    limits' ranges always: _check_ranges)."""
    e = config.environment
    if not e.enabled:
        if e.reward_components:
            raise ConfigError("environment.reward_components", "needs episodes: set environment.tools or "
                                                               "environment.factory")
        return
    for i, name in enumerate(e.reward_components):
        if name not in config.reward.components:
            raise ConfigError(f"environment.reward_components[{i}]", f"{name!r} is not in reward.components "
                                                                     f"{list(config.reward.components)}")
    if len(set(e.reward_components)) != len(e.reward_components):
        raise ConfigError("environment.reward_components", f"lists a component twice: {list(e.reward_components)}")
    if e.max_model_tokens > config.rollout.max_new_tokens:
        raise ConfigError("environment.max_model_tokens", f"{e.max_model_tokens} exceeds rollout.max_new_tokens = "
                                                          f"{config.rollout.max_new_tokens}, the trajectory's whole "
                                                          "row (the model's tokens and the environment's)")
    if e.call_format not in ("hermes", "llama3_json", "tag"):
        raise ConfigError("environment.call_format", f"unknown {e.call_format!r}; choose hermes, llama3_json or tag")
    if e.call_format == "tag" and (not e.open_tag.strip() or not e.close_tag.strip() or e.open_tag == e.close_tag):
        raise ConfigError("environment.open_tag", "the tag format needs two different, non-blank tags")
    for i, name in enumerate(e.tools):
        if name not in BUILTIN_TOOLS and not _IMPORT_PATH.match(name):
            raise ConfigError(f"environment.tools[{i}]", f"{name!r} is neither a built-in "
                                                         f"({', '.join(BUILTIN_TOOLS)}) nor 'package.module:name'")
    if len(set(e.tools)) != len(e.tools):
        raise ConfigError("environment.tools", f"lists a tool twice: {list(e.tools)}")
    if e.factory is not None and not _IMPORT_PATH.match(e.factory):
        raise ConfigError("environment.factory", f"{e.factory!r} is not 'package.module:name'")
    if not config.data.use_chat_template:
        raise ConfigError("data.use_chat_template", "multi-turn episodes (environment.tools or factory) render "
                                                    "every turn with the chat template: must be true")


def _check_names_and_urls(config: Config) -> None:
    """Every `*_env` key names an environment variable, every rollout.urls entry is an http(s) URL: both reach
    the launchers' shell commands and the services' environment."""
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for field in dataclasses.fields(values):
            name = getattr(values, field.name)
            if field.name.endswith("_env") and name and not _ENV_NAME.fullmatch(name):
                raise ConfigError(f"{section.name}.{field.name}", f"{name!r} is not an environment variable name "
                                                                  "([A-Za-z_][A-Za-z0-9_]*)")
    for i, url in enumerate(config.rollout.urls):
        parts = urllib.parse.urlsplit(url) if _URL_CHARS.fullmatch(url) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"rollout.urls[{i}]", f"{url!r} is not an http(s) URL (scheme://host[:port][/path], "
                                                    "no spaces, quotes or shell characters)")


def validate(config: Config) -> None:
    """Raises ConfigError (one line, naming the key) for the first rule `config` breaks."""
    _check_ranges(config)
    _check_names_and_urls(config)
    _check_environment(config)
    _check_rollout_modes(config)
    lora_spec(config)
    _check_base_dtype(config)
    step_configs(config)
    _check_batches(config)
    _check_rest(config)


def check_model_options(config: Config, model: DecoderConfig) -> None:
    """model.lora.targets and model.moe against the architecture `model.path` holds (known once its config.json is
    read): a mixture of experts' MLP is its experts, which take no adapter; a dense model has no router to replay."""
    if config.model.moe.router_replay and not model.moe:
        raise ConfigError("model.moe.router_replay", f"needs a mixture-of-experts model; {model.family} is dense "
                                                     "(no router to replay)")
    mlp = [t for t in config.model.lora.targets if t in ("gate_proj", "up_proj", "down_proj")]
    if config.model.lora.rank and model.moe and mlp:
        raise ConfigError("model.lora.targets", f"{model.family} routes every MLP through {model.num_experts} "
                                                f"experts, which take no adapter: drop {', '.join(mlp)} (target "
                                                f"attention: q_proj, k_proj, v_proj, o_proj)")


_GCS_URI = re.compile(r"gs://[a-z0-9][a-z0-9._-]{1,61}[a-z0-9](/[^\x00-\x1f]*)?")  # GCS's bucket naming rules


def check_output_dir(run: RunConfig) -> None:
    """ConfigError naming run.output_dir when the run could not create or write it (a file, /proc, a read-only
    disk). It tries the disk, so only the commands that write a run ask it (train, config), not
    those that read one back (evaluate --model RUN_DIR): a folder is made and removed in its nearest existing
    ancestor. A bucket (gs://BUCKET/PATH) is checked for its form and for gcsfs, not reached."""
    if is_remote(run.output_dir):
        if not _GCS_URI.fullmatch(run.output_dir):
            raise ConfigError("run.output_dir", f"{run.output_dir!r} is neither a local folder nor gs://BUCKET/PATH "
                                                "(a bucket name of 3-63 lowercase letters, digits, '-', '_' and '.')")
        if importlib.util.find_spec("gcsfs") is None:
            raise ConfigError("run.output_dir", "gs:// needs gcsfs: pip install -e '.[gcs]'")
        return
    path = os.path.abspath(run.output_dir)
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError("run.output_dir", f"{existing} is not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".write-check-"))
    except OSError as error:
        raise ConfigError("run.output_dir", f"cannot create a folder in {existing}: {error.strerror}") from None
