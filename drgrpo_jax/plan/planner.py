"""The plan: a run's mesh, partition specs and per-device memory against a target device, as one JSON-able dict
(`make_plan`), and the advice naming the config values that make it fit.

Parameters and optimizer state are exact (`jax.eval_shape` of the real model and optax chain, split by the
trainer's logical-axis rules); activations, log-prob chunks and the generation service are estimates
(plan/activations.py, plan/service.py, docs/scaling_out.md). `model.remat: auto` is chosen by plan/remat.py, for
the plan and, through `auto_remat`, for the trainer's own device. The command line: plan/cli.py.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import gguf

from drgrpo_jax.config.load import resolve_model_path
from drgrpo_jax.config.rules import check_model_options
from drgrpo_jax.config.schema import Config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.hub_ids import CONFIG_FILES, hub_id, snapshot
from drgrpo_jax.models.config import DecoderConfig, from_hf_config
from drgrpo_jax.models.gguf_io import gguf_hf_config
from drgrpo_jax.models.hf_io import load_hf_config
from drgrpo_jax.plan.activations import (
    activation_bytes,
    activations_by_policy,
    local_tokens,
    model_call,
    rows_per_device,
    stores_probabilities,
)
from drgrpo_jax.plan.context import context_advice, context_table, context_traffic, variant
from drgrpo_jax.plan.hardware import DEVICES, GIB, PRESETS, DeviceSpec, preset_name
from drgrpo_jax.plan.remat import resolve_remat
from drgrpo_jax.plan.service import (
    indivisible,
    prefix_cache_budget,
    service_advice,
    service_memory,
    service_rows,
    service_total,
    smallest_tensor,
    total,
)
from drgrpo_jax.plan.state import (
    abstract_state,
    adapted_bytes,
    gradient_bytes,
    mesh_sizes,
    param_groups,
    trainer_memory,
    variables,
)
from drgrpo_jax.sharding import parse_service_mesh

__all__ = ["HEADROOM", "auto_remat", "device_backend", "device_memory_bytes", "make_plan", "resolve_decoder_config",
           "shares_one_device", "trainer_advice"]

HEADROOM = 0.9  # usable share of device memory: XLA scratch, fragmentation; the hosts launcher sets MEM_FRACTION=0.9


def _architecture(key: str, spec: str) -> tuple[DecoderConfig, str] | None:
    """(architecture, where from) of one spec, or None when it names none (a preset or a local file missing)."""
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "config.json")):
        return load_hf_config(spec), f"{spec}/config.json"
    if spec.startswith("pkg:") or spec.endswith(".gguf"):  # the architecture from the GGUF's header
        path = resolve_model_path(spec, key)
        return from_hf_config(gguf_hf_config(gguf.GGUFReader(path))), path
    if spec.endswith(".json") and os.path.isfile(spec):
        with open(spec) as f:
            return from_hf_config(json.load(f)), spec
    hub = hub_id(spec)
    if (preset := preset_name(spec)) is not None and (hub is None or hub.revision is None):
        return from_hf_config(PRESETS[preset]), f"preset {preset} (public HF config.json)"
    if hub is not None:  # the architecture alone: config.json of the snapshot (fetched when online)
        folder = snapshot(hub, key, files=CONFIG_FILES)
        return load_hf_config(folder), f"{hub} config.json ({folder})"
    return None


def resolve_decoder_config(config: Config, model_config: str | None = None) -> tuple[DecoderConfig, str]:
    """(architecture, where from): --model-config, then model.path: a local config.json or GGUF header, a preset
    of that name, or a Hub id's config.json (the snapshot's config.json alone is fetched). A file that cannot be
    read as an architecture is a ConfigError naming the key."""
    for key, spec in [("--model-config", model_config), ("model.path", config.model.path)]:
        if not spec:
            continue
        try:
            found = _architecture(key, spec)
        except ConfigError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as error:  # unreadable JSON, a config missing fields
            raise ConfigError(key, f"cannot read an architecture from {spec!r}: {type(error).__name__}: "
                                   f"{error}") from None
        if found is not None:
            return found
        if key == "--model-config":
            raise ConfigError(key, f"{spec!r} is neither a folder with config.json, a .json file, a Hub id "
                                   f"org/name[@revision], nor a preset ({', '.join(PRESETS)})")
    raise ConfigError("model.path", f"no config.json at {config.model.path!r} and no preset of that name; pass "
                                    f"--model-config (a folder, a config.json or one of {', '.join(PRESETS)})")


# ---------------------------------------------------------------------------------------------
# The device and the remat policy the trainer takes on it (plan/remat.py)
# ---------------------------------------------------------------------------------------------


def device_backend(device: DeviceSpec | None) -> str:
    """The JAX backend a device runs, which decides the attention "auto" picks: tpu, gpu, else cpu."""
    if device is None or device.name not in DEVICES:
        return "cpu"
    return "tpu" if device.name.startswith("tpu") else "gpu"


def device_memory_bytes(device: Any) -> int:
    """A jax device's memory: its allocator's limit on accelerators, the host's RAM on CPU."""
    try:
        stats = device.memory_stats()
    except (AttributeError, NotImplementedError, RuntimeError):  # CPU clients may have no allocator statistics
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def auto_remat(config: Config, model: DecoderConfig, device: Any) -> str:
    """The policy `model.remat: auto` gives the trainer on `device` (a jax device): the plan's pick for its memory."""
    spec = DeviceSpec(str(device.device_kind), device_memory_bytes(device), "the trainer's own device")
    return make_plan(config, model, device=spec, backend=device.platform)["model"]["remat_policy"]


# ---------------------------------------------------------------------------------------------
# Advice: which config value to change
# ---------------------------------------------------------------------------------------------


def _micro_batch_advice(config: Config, model: DecoderConfig, budget: int, backend: str) -> str:
    """The smallest train.micro_batches (doubling) whose rematerialised activations fit, else the sequence."""
    micro = config.train.micro_batches
    while (micro := micro * 2) <= 4096:
        candidate = variant(config, train={"micro_batches": micro}, model={"remat": "full"})
        if candidate is None:  # no longer divides the optimizer window over the data-parallel ways
            break
        if activation_bytes(candidate, model, "full", backend) <= budget:
            return (f"train.micro_batches={micro} (with model.remat=full): {rows_per_device(candidate)} response(s) "
                    "per device per micro-batch")
    return ("rollout.max_new_tokens or rollout.max_prompt_tokens (one response per device still does not fit), "
            "or raise mesh.tensor (splits heads, MLP and vocabulary) or mesh.context (splits each row's tokens)")


def trainer_advice(config: Config, model: DecoderConfig, figures: dict[str, int], usable: int,
                   backend: str = "cpu") -> list[str]:
    """Plain sentences naming the config values that bring the trainer under `usable` bytes per device."""
    state = (figures["params"] + figures["adapters"] + figures["optimizer"] + figures["gradients"]
             + figures["reference"])
    rest = total(figures) - state - figures["activations"]
    advice = []
    if config.model.dtype == "float32":
        advice.append("model.dtype=bfloat16 halves parameters and activations (Adam's moments stay float32)")
    if state > usable * 0.5:
        ways = config.mesh.fsdp * 2 ** math.ceil(math.log2(max(state / (usable * 0.5), 1.0)))
        advice.append(f"mesh.fsdp={ways} (or more devices): parameters, optimizer state and gradients are "
                      f"{state / GIB:.1f} GiB per device at mesh.fsdp={config.mesh.fsdp}")
    budget = usable - state - rest
    if figures["activations"] > budget:
        with_remat = activation_bytes(config, model, "full", backend)
        if config.model.remat not in ("full", "auto"):
            advice.append(f"model.remat=full: activations {figures['activations'] / GIB:.1f} -> "
                          f"{with_remat / GIB:.1f} GiB per device")
        if with_remat > budget:
            advice.append(_micro_batch_advice(config, model, budget, backend))
    return advice


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


def shares_one_device(config: Config) -> bool:
    """One process, one device and no rollout.urls: the trainer's own child service runs on the same device."""
    m = config.mesh
    return not config.rollout.urls and m.num_processes == 1 and m.devices == 1


def _trainer(config: Config, model: DecoderConfig, state: tuple[Any, Any, Any], budget: int | None,
             backend: str) -> tuple[dict[str, int], dict[str, int], str]:
    """(trainer figures per device, activations by remat policy, the policy taken) of a config: exact state
    (`state`: its abstract params, optimizer state and frozen base), estimated activations under the policy
    model.remat takes with `budget` bytes beside the rest (None: no device)."""
    params, opt_state, frozen = state
    trainer = trainer_memory(config, model, params, opt_state, frozen)
    trainer.pop("_params_total")
    by_policy = activations_by_policy(config, model, backend)
    policy = resolve_remat(config, by_policy, None if budget is None else budget - total(trainer), backend)
    trainer["activations"] = by_policy[policy]
    trainer["gradients"] = gradient_bytes(config, model, params, frozen, policy)
    return trainer, by_policy, policy


def make_plan(config: Config, model: DecoderConfig, *, device: DeviceSpec | None = None,
              serve_batch_size: int | None = None, model_source: str = "", serve_mesh: str | None = None,
              serve_tensor: int = 1, backend: str | None = None) -> dict[str, Any]:
    """The whole plan as one JSON-able dict (bytes as ints).

    `serve_mesh`: one generation service's mesh, tensor=T[,data=D] (drgrpo_jax.serve --mesh; default: the
    config's rollout.service_mesh, else one device; `serve_tensor` N alone means tensor=N); its figures are one of
    its devices'. `backend` (tpu, gpu, cpu; default: the device's) decides which attention "auto" runs, and so
    whether activations hold [S, S] probabilities.
    """
    if serve_mesh is None:
        serve_mesh = config.rollout.service_mesh or (f"tensor={serve_tensor}" if serve_tensor > 1 else "")
    try:
        mesh = parse_service_mesh(serve_mesh, "--serve-mesh")
    except ValueError as error:
        raise ConfigError("--serve-mesh", str(error).removeprefix("--serve-mesh: ")) from None
    if (why := indivisible(model, mesh)) is not None:
        raise ConfigError("--serve-mesh", f"{serve_mesh}: {why}")
    check_model_options(config, model)
    sizes = mesh_sizes(config)
    backend = backend or device_backend(device)
    params, opt_state, frozen = state = abstract_state(config, model)
    rows = service_rows(config, serve_batch_size)
    # drgrpo_jax.serve keeps the adapted base weights to merge each pushed adapter into; merged pushes need none.
    merge = 0 if frozen is None or config.model.lora.push == "merged" else adapted_bytes(frozen,
                                                                                         config.model.lora.targets)
    service = service_memory(config, model, rows, tensor=mesh.tensor, data=mesh.data, merge_bytes=merge,
                             backend=backend)
    base = params if frozen is None else frozen
    usable = None if device is None else int(device.memory_bytes * HEADROOM)
    shared = service_total(service) if shares_one_device(config) else 0  # the trainer's child service on its device
    trainer, by_policy, policy = _trainer(config, model, state, None if usable is None else usable - shared, backend)
    calls, length = model_call(config)
    plan: dict[str, Any] = {
        "mesh": {**sizes, "devices": config.mesh.devices, "processes": config.mesh.num_processes,
                 "dcn_data": config.mesh.dcn_data, "dcn_axes": ["data"] if config.mesh.dcn_data > 1 else []},
        "model": {"source": model_source, "family": model.family, "layers": model.num_layers,
                  "hidden_size": model.hidden_size, "vocab_size": model.vocab_size, "dtype": config.model.dtype,
                  "parameters": sum(math.prod(v.shape) for _, v, _ in variables(base)),
                  "adapter_parameters": 0 if frozen is None else sum(math.prod(v.shape) for _, v, _ in
                                                                     variables(params)),
                  "lora_rank": config.model.lora.rank, "remat": config.model.remat, "remat_policy": policy},
        "param_groups": param_groups(base, sizes) + ([] if frozen is None else param_groups(params, sizes)),
        "trainer": {**trainer, "total": total(trainer), "activations_by_remat": by_policy,
                    "activations_without_remat": by_policy["none"], "activations_with_remat": by_policy["full"],
                    "attention_probabilities": stores_probabilities(config.model.attention_impl, length, backend),
                    "rows_per_device": rows_per_device(config), "model_call_rows": calls, "sequence": length,
                    "packed": bool(config.train.pack_rows), "tokens_per_device": local_tokens(config, length),
                    "context_traffic": context_traffic(config, model), "context_table": None},
        "service": {**service, "total": service_total(service), "rows": rows, "tensor_ways": mesh.tensor,
                    "data_ways": mesh.data, "mesh": serve_mesh, "devices": mesh.tensor * mesh.data,
                    "smallest_tensor": None},
        "shared_device": shares_one_device(config), "device": None, "fits": None, "advice": [],
    }
    if device is not None and usable is not None:
        fits = {"trainer": plan["trainer"]["total"] <= usable, "service": plan["service"]["total"] <= usable}
        if plan["shared_device"]:  # the trainer's child service lives beside it on the same device
            fits["together"] = plan["trainer"]["total"] + plan["service"]["total"] <= usable
        plan["device"] = {"name": device.name, "memory_bytes": device.memory_bytes, "usable_bytes": usable,
                          "source": device.source}
        plan["fits"] = fits
        if not fits["trainer"]:
            def estimate(candidate: Config) -> tuple[dict[str, int], str]:
                figures, _, chosen = _trainer(candidate, model, state, usable, backend)
                return figures, chosen

            table = plan["trainer"]["context_table"] = context_table(config, model, estimate, usable)
            advice = trainer_advice(config, model, trainer, usable, backend)
            if (split := context_advice(config, table)) is not None:
                advice.append(split)
            plan["advice"] += [f"trainer: {line}" for line in advice]
        if cache := config.rollout.service_prefix_cache_bytes:  # -1: the service's own share of its budget
            plan["service"]["prefix_cache"] = prefix_cache_budget(plan["service"], usable) if cache < 0 else cache
        plan["service"]["smallest_tensor"] = smallest_tensor(config, model, rows, usable, data=mesh.data,
                                                             merge_bytes=merge, backend=backend)
        if not fits["service"]:
            plan["advice"] += [f"service: {line}" for line in service_advice(
                config, model, usable, rows, tensor=mesh.tensor, data=mesh.data, merge_bytes=merge,
                backend=backend)]
    return plan
