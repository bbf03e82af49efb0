"""A run's mesh, partition specs and per-device memory, before anything runs (jax.eval_shape only).

    python -m drgrpo_jax.plan --config PATH [section.key=value ...] [--device NAME | --device-memory GiB]
                              [--model-config NAME|PATH] [--serve-batch-size ROWS] [--serve-tensor N]
                              [--format text|json]

--serve-batch-size defaults to rollout.service_batch_size (the services' --max-batch-size).

Parameters and optimizer state are exact: their shapes come from `jax.eval_shape` of the real model
and optax chain, split by the same logical-axis rules the trainer uses. Activations, log-prob chunks
and the generation service's prefill are estimates from the formulas below (docs/scaling_out.md):

  letters: capitals as in the README's shape-letter glossary (S = prompt + budget - 1 trainer tokens
  per row, D, I, Q, C, H, L, V from the model, W log-prob chunk tokens); b rows per device per
  micro-batch, a activation bytes (the parameter dtype), t tensor ways;
  per layer and row, kept for the backward pass:
      S * (4D + (2Q + 2C)H/t + 3I/t) * a      (norm inputs, q/k/v/o, MLP gate/up/product)
    + (Q/t) * S^2 * 4                         (float32 softmax output of the naive attention)
  without remat: L such layers; with remat: L block inputs (S * D * a) plus one layer recomputed;
  both add one layer's float32 attention scores (Q/t * S^2 * 4) live while its softmax is formed.
  log-prob chunks: 3 * W * V/t * 4 (logits, probabilities, their gradient; one chunk at a time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any

from drgrpo_jax.config import Config, load_config, lora_base_dtype, lora_spec
from drgrpo_jax.errors import ConfigError, MissingValueError
from drgrpo_jax.models.config import DecoderConfig, from_hf_config

__all__ = ["DEVICES", "PRESETS", "DeviceSpec", "make_plan", "format_text", "resolve_decoder_config", "main"]

GIB = 1024**3
HEADROOM = 0.9  # usable share of device memory: XLA scratch, fragmentation; launch_gpu.sh sets MEM_FRACTION=0.9
_ITEMSIZE = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: memory per chip/GPU (what JAX sees as one device)."""

    name: str
    memory_bytes: int
    source: str  # where the figure comes from


# TPU: HBM per chip from the Cloud TPU system-architecture pages; GPU: `nvidia-smi` total memory.
DEVICES: dict[str, DeviceSpec] = {d.name: d for d in [
    DeviceSpec("tpu-v4", 32 * GIB, "Cloud TPU v4: 32 GiB HBM2 per chip"),
    DeviceSpec("tpu-v5e", 16 * GIB, "Cloud TPU v5e: 16 GiB HBM2 per chip"),
    DeviceSpec("tpu-v5p", 95 * GIB, "Cloud TPU v5p: 95 GiB HBM2e per chip"),
    DeviceSpec("tpu-v6e", 32 * GIB, "Cloud TPU v6e (Trillium): 32 GiB HBM per chip"),
    DeviceSpec("a100-40gb", 40960 * 1024**2, "A100 SXM4 40GB: 40960 MiB"),
    DeviceSpec("a100-80gb", 81920 * 1024**2, "A100 SXM4 80GB: 81920 MiB"),
    DeviceSpec("h100", 81559 * 1024**2, "H100 SXM5 80GB: 81559 MiB"),
    DeviceSpec("h200", 143771 * 1024**2, "H200 SXM 141GB: 143771 MiB"),
]}
_ALIASES = {"v4": "tpu-v4", "v5e": "tpu-v5e", "v5litepod": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e",
            "a100": "a100-80gb", "h100-80gb": "h100"}

# Architectures from the public Hugging Face config.json files, so a plan needs no download.
PRESETS: dict[str, dict[str, Any]] = {
    "Qwen2.5-Math-1.5B": {
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu"},
    "Qwen2.5-Math-7B": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu"},
}


def device_spec(name: str) -> DeviceSpec:
    """The table entry for a device name or alias; ConfigError naming --device otherwise."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in DEVICES:
        raise ConfigError("--device", f"unknown device {name!r}; known: {', '.join(DEVICES)}")
    return DEVICES[key]


def _preset(name: str) -> str | None:
    """The preset key matching a name or path basename (case-insensitive, 'Qwen/' prefix allowed)."""
    base = os.path.basename(os.path.normpath(name)).lower()
    return next((key for key in PRESETS if key.lower() == base), None)


def resolve_decoder_config(config: Config, model_config: str | None = None) -> tuple[DecoderConfig, str]:
    """(architecture, where it came from): --model-config, then model.path's config.json, then a preset name."""
    from drgrpo_jax.models.hf_io import load_hf_config

    for key, spec in [("--model-config", model_config), ("model.path", config.model.path)]:
        if not spec:
            continue
        if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "config.json")):
            return load_hf_config(spec), f"{spec}/config.json"
        if spec.endswith(".json") and os.path.isfile(spec):
            with open(spec) as f:
                return from_hf_config(json.load(f)), spec
        if (preset := _preset(spec)) is not None:
            return from_hf_config(PRESETS[preset]), f"preset {preset} (public HF config.json)"
        if key == "--model-config":
            raise ConfigError(key, f"{spec!r} is neither a folder with config.json, a .json file, nor a preset "
                                   f"({', '.join(PRESETS)})")
    raise ConfigError("model.path", f"no config.json at {config.model.path!r} and no preset of that name; pass "
                                    f"--model-config (a folder, a config.json or one of {', '.join(PRESETS)})")


# ---------------------------------------------------------------------------------------------
# Exact figures: shapes from jax.eval_shape, split by the logical-axis rules
# ---------------------------------------------------------------------------------------------


def _mesh_sizes(config: Config) -> dict[str, int]:
    return {"data": config.mesh.data, "fsdp": config.mesh.fsdp, "tensor": config.mesh.tensor}


def _shard_elements(name: str, shape: tuple[int, ...], logical_axes: tuple[str | None, ...] | None,
                    sizes: dict[str, int]) -> tuple[int, tuple]:
    """(elements held by one device, PartitionSpec as a tuple); ConfigError when a mesh axis does not divide."""
    from drgrpo_jax.sharding import ShardingRules, logical_to_spec

    if logical_axes is None:  # an optimizer counter: replicated
        return math.prod(shape), ()
    spec = tuple(logical_to_spec(logical_axes, ShardingRules()))
    elements = 1
    for dim, logical, axes in zip(shape, logical_axes, spec):
        ways = math.prod(sizes[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
        if dim % ways:
            mesh_key = f"mesh.{axes if isinstance(axes, str) else axes[-1]}"
            raise ConfigError(mesh_key, f"{name}: dimension {logical!r} of size {dim} is not divisible by mesh "
                                        f"axes {axes} ({ways} ways)")
        elements *= dim // ways
    return elements, spec


def _variables(tree: Any) -> list[tuple[str, Any, tuple | None]]:
    """(path, ShapeDtypeStruct, logical axes or None) for every array leaf of an abstract state."""
    import jax
    from flax import nnx

    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        name = "/".join(str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path)
        if isinstance(leaf, nnx.Variable):
            out.append((name, leaf.get_value(), leaf.get_metadata().get("logical_axes")))
        elif hasattr(leaf, "shape"):
            out.append((name, leaf, None))
    return out


def abstract_state(config: Config, model: DecoderConfig) -> tuple[Any, Any, Any]:
    """(trainable params, optimizer state, frozen LoRA base or None) as abstract trees: the real model, its
    adapters (model.lora) and optax chain under eval_shape, split as `train_step.init_state` splits them."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from drgrpo_jax.models import Transformer
    from drgrpo_jax.models.lora import add_adapters
    from drgrpo_jax.train_step import make_optimizer

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[config.model.dtype]
    spec = lora_spec(config)

    def build():
        base = Transformer(model, rngs=nnx.Rngs(0), dtype=dtype)
        return base if spec is None else add_adapters(base, spec, jax.random.key(0))

    abstract_model = nnx.eval_shape(build)
    frozen = None
    if spec is None:
        _, params = nnx.split(abstract_model, nnx.Param)
    else:
        _, params, *rest = nnx.split(abstract_model, nnx.LoRAParam, nnx.Param)
        frozen = rest[0]
    o, a = config.optimizer, config.algorithm
    optimizer, _ = make_optimizer(o.learning_rate, total_steps=config.train.steps * a.ppo_epochs
                                  * a.minibatches_per_rollout, warmup_steps=o.warmup_steps, decay=o.decay,
                                  weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps,
                                  max_grad_norm=o.max_grad_norm or None)
    return params, jax.eval_shape(optimizer.init, params), frozen


def state_bytes(tree: Any, sizes: dict[str, int]) -> tuple[int, int]:
    """(bytes on one device, bytes in all) of an abstract state sharded by its logical axes."""
    per_device = total = 0
    for name, value, axes in _variables(tree):
        elements, _ = _shard_elements(name, value.shape, axes, sizes)
        per_device += elements * value.dtype.itemsize
        total += math.prod(value.shape) * value.dtype.itemsize
    return per_device, total


def param_groups(params: Any, sizes: dict[str, int]) -> list[dict[str, Any]]:
    """One row per parameter: global shape, logical axes, partition spec, bytes on one device."""
    rows = []
    for name, value, axes in _variables(params):
        elements, spec = _shard_elements(name, value.shape, axes, sizes)
        rows.append({"name": name, "shape": list(value.shape), "dtype": str(value.dtype),
                     "logical_axes": list(axes or ()), "spec": [a if a is None or isinstance(a, str) else list(a)
                                                                 for a in spec],
                     "bytes_per_device": elements * value.dtype.itemsize})
    return rows


# ---------------------------------------------------------------------------------------------
# Estimates: activations, log-prob chunks, the generation service
# ---------------------------------------------------------------------------------------------


def rows_per_device(config: Config) -> int:
    """Responses one device holds in one micro-batch."""
    r, a, m = config.rollout, config.algorithm, config.mesh
    per_update = r.prompts_per_step * r.group_size // a.minibatches_per_rollout
    return max(per_update // config.train.micro_batches // (m.data * m.fsdp), 1)


def activation_bytes(config: Config, model: DecoderConfig, remat: bool) -> int:
    """Activations one device holds in the backward pass of one micro-batch (module formula)."""
    b, a, t = rows_per_device(config), _ITEMSIZE[config.model.dtype], config.mesh.tensor
    S = config.rollout.max_prompt_tokens + config.rollout.max_new_tokens - 1
    D, I, Q, C, H, L = (model.hidden_size, model.intermediate_size, model.num_heads, model.num_kv_heads,
                        model.head_dim, model.num_layers)
    tokens = S * (4 * D + (2 * Q + 2 * C) * H // t + 3 * I // t) * a
    probs = (Q // t) * S * S * 4
    layer = b * (tokens + probs)
    scores = b * (Q // t) * S * S * 4
    masks = 2 * b * S * S  # bool full and sliding-window masks, built once per forward
    kept = L * b * S * D * a + layer if remat else L * layer
    return kept + scores + masks


def logprob_chunk_bytes(config: Config, model: DecoderConfig, chunk: int = 256) -> int:
    """One chunk's float32 logits, probabilities and their gradient on one device."""
    tokens = min(chunk, rows_per_device(config) * config.rollout.max_new_tokens)
    return 3 * tokens * (model.vocab_size // config.mesh.tensor) * 4


def batch_bytes(config: Config) -> int:
    """One optimizer window's Batch arrays on one device (ids, masks, advantages, two log-prob rows)."""
    r, a, m = config.rollout, config.algorithm, config.mesh
    rows = r.prompts_per_step * r.group_size // a.minibatches_per_rollout // (m.data * m.fsdp)
    per_row = r.max_prompt_tokens * 5 + r.max_new_tokens * (4 + 1 + 4 + 4) + 4 + 1
    return rows * per_row


def bucket(n: int, minimum: int = 16) -> int:
    """The service's static size for n (sampling.bucket: powers of two from `minimum`)."""
    return 1 << (max(int(n), minimum, 1) - 1).bit_length()


def service_rows(config: Config, serve_batch_size: int | None) -> int:
    """Rows one service samples at once: --serve-batch-size, else rollout.service_batch_size, else the default.

    The default: the trainer's child takes a whole rollout (or the eval set); URLs split a rollout.
    """
    r = config.rollout
    rollout_rows = r.prompts_per_step * r.group_size
    serve_batch_size = serve_batch_size or r.service_batch_size
    if serve_batch_size is None:
        if r.urls:  # each service gets its share, capped by drgrpo_jax.serve's default --max-batch-size (32)
            return bucket(min(math.ceil(rollout_rows / len(r.urls)), 32), minimum=1)
        return bucket(max(rollout_rows, config.data.eval_size), minimum=1)
    return bucket(serve_batch_size, minimum=1)


def service_memory(config: Config, model: DecoderConfig, weights_bytes: int, rows: int,
                   merge_bytes: int = 0) -> dict[str, int]:
    """One generation-service device: weights, KV cache, the prefill's attention scores and, with LoRA, the
    base copy of the adapted projections kept to merge each new adapter into (`merge_bytes`)."""
    a, r = _ITEMSIZE[config.model.dtype], config.rollout
    prompt, new = bucket(r.max_prompt_tokens), bucket(r.max_new_tokens)
    slots = prompt + new - 1
    kv = 2 * model.num_layers * rows * slots * model.num_kv_heads * model.head_dim * a + rows * slots * 4
    prefill = rows * model.num_heads * (prompt - 1) * slots * (4 + 4)  # float32 scores and softmax
    return {"weights": weights_bytes, "adapter_merge": merge_bytes, "kv_cache": kv, "prefill_attention": prefill,
            "logits": rows * model.vocab_size * 4 * 2}


def trainer_memory(config: Config, model: DecoderConfig, params: Any, opt_state: Any,
                   frozen: Any = None) -> dict[str, int]:
    """Per-device trainer figures in bytes (exact params/adapters/optimizer; estimated activations).

    With LoRA (`frozen` given), `params` are the base weights (frozen: no gradient, no optimizer state) and
    `adapters` the float32 adapters, whose gradients and Adam moments are the only ones; the KL reference
    is the base with the adapters off, so it costs nothing.
    """
    sizes = _mesh_sizes(config)
    trainable_device, trainable_total = state_bytes(params, sizes)
    opt_device, _ = state_bytes(opt_state, sizes)
    # train_step accumulates float32 gradients and holds one micro-batch's gradient in the trainable dtype.
    trainable_itemsize = 4 if frozen is not None else _ITEMSIZE[config.model.dtype]
    grads = trainable_device * 4 // trainable_itemsize + trainable_device
    if frozen is None:
        params_device, params_total, adapters = trainable_device, trainable_total, 0
    else:  # the trainer stores the base as model.lora.base_dtype says; the services load model.path's (total)
        params_device, adapters = stored_base_bytes(config, model, sizes), trainable_device
        params_total = state_bytes(frozen, sizes)[1]
    return {"params": params_device, "adapters": adapters, "optimizer": opt_device, "gradients": grads,
            "reference": params_device if config.algorithm.kl_coef > 0 and frozen is None else 0,
            "activations": activation_bytes(config, model, config.model.remat),
            "logprob_chunks": logprob_chunk_bytes(config, model), "batch": batch_bytes(config),
            "_params_total": params_total}


def stored_base_bytes(config: Config, model: DecoderConfig, sizes: dict[str, int]) -> int:
    """Per-device bytes of the frozen LoRA base as the trainer stores it (model.lora.base_dtype: `lora.store_base`)."""
    import jax.numpy as jnp
    from flax import nnx

    from drgrpo_jax.models import Transformer
    from drgrpo_jax.models.lora import store_base

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[config.model.dtype]
    stored = nnx.eval_shape(lambda: store_base(Transformer(model, rngs=nnx.Rngs(0), dtype=dtype),
                                               lora_base_dtype(config)))
    return state_bytes(nnx.state(stored, nnx.Param), sizes)[0]


def adapted_bytes(frozen: Any, targets: tuple[str, ...]) -> int:
    """Bytes of the base weights LoRA adapts (all devices): what a service keeps a second copy of to merge into."""
    return sum(math.prod(value.shape) * value.dtype.itemsize for name, value, _ in _variables(frozen)
               if name.removeprefix("blocks/") in targets)


def _total(figures: dict[str, int]) -> int:
    return sum(v for k, v in figures.items() if not k.startswith("_"))


# ---------------------------------------------------------------------------------------------
# Advice: which config value to change
# ---------------------------------------------------------------------------------------------


def _try(config: Config, **changes: dict[str, Any]) -> Config | None:
    """The config with section changes applied, or None when it no longer validates."""
    from drgrpo_jax.config import validate

    sections = {name: dataclasses.replace(getattr(config, name), **fields) for name, fields in changes.items()}
    candidate = dataclasses.replace(config, **sections)
    try:
        validate(candidate)
    except ConfigError:
        return None
    return candidate


def _micro_batch_advice(config: Config, model: DecoderConfig, budget: int) -> str:
    """The smallest train.micro_batches (doubling) whose rematerialised activations fit, else the sequence."""
    micro = config.train.micro_batches
    while (micro := micro * 2) <= 4096:
        candidate = _try(config, train={"micro_batches": micro}, model={"remat": True})
        if candidate is None:  # no longer divides the optimizer window over the data-parallel ways
            break
        if activation_bytes(candidate, model, True) <= budget:
            return (f"train.micro_batches={micro} (with model.remat=true): {rows_per_device(candidate)} response(s) "
                    "per device per micro-batch")
    return ("rollout.max_new_tokens or rollout.max_prompt_tokens (one response per device still does not fit), "
            "or raise mesh.tensor (splits heads, MLP and vocabulary)")


def trainer_advice(config: Config, model: DecoderConfig, figures: dict[str, int], usable: int) -> list[str]:
    """Plain sentences naming the config values that bring the trainer under `usable` bytes per device."""
    state = (figures["params"] + figures["adapters"] + figures["optimizer"] + figures["gradients"]
             + figures["reference"])
    rest = _total(figures) - state - figures["activations"]
    advice = []
    if config.model.dtype == "float32":
        advice.append("model.dtype=bfloat16 halves parameters and activations (Adam's moments stay float32)")
    if state > usable * 0.5:
        ways = config.mesh.fsdp * 2 ** math.ceil(math.log2(max(state / (usable * 0.5), 1.0)))
        advice.append(f"mesh.fsdp={ways} (or more devices): parameters, optimizer state and gradients are "
                      f"{state / GIB:.1f} GiB per device at mesh.fsdp={config.mesh.fsdp}")
    budget = usable - state - rest
    if figures["activations"] > budget:
        with_remat = activation_bytes(config, model, True)
        if not config.model.remat:
            advice.append(f"model.remat=true: activations {figures['activations'] / GIB:.1f} -> "
                          f"{with_remat / GIB:.1f} GiB per device")
        if with_remat > budget:
            advice.append(_micro_batch_advice(config, model, budget))
    return advice


def service_advice(config: Config, model: DecoderConfig, weights: int, usable: int, rows: int,
                   merge_bytes: int = 0, tensor: int = 1) -> list[str]:
    """The largest batch one service device holds, or that the weights alone do not fit."""

    def per_device(batch: int) -> int:
        return _total(service_memory(config, model, weights, batch, merge_bytes)) // tensor

    if (weights + merge_bytes) // tensor > usable:
        return [f"the generation service's weights ({weights / GIB:.1f} GiB) exceed one device: drgrpo_jax.serve "
                "uses one device per process, so run the service on a larger device (rollout.urls) or use a "
                "tensor-parallel server (SGLang-JAX, vLLM-TPU) there"]
    fits = rows
    while fits > 1 and per_device(fits) > usable:
        fits //= 2
    if per_device(fits) > usable:
        return ["even one row does not fit: lower rollout.max_new_tokens or rollout.max_prompt_tokens"]
    return [f"start each generation service with --max-batch-size {fits} (and list them in rollout.urls; "
            f"rollout.service_batch_size={fits} starts the trainer's own child so and lets the plan check it); "
            f"{rows} rows at once need {per_device(rows) / GIB:.1f} GiB"]


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


def shares_one_device(config: Config) -> bool:
    """One process, one device and no rollout.urls: the trainer's own child service runs on the same device."""
    m = config.mesh
    return not config.rollout.urls and m.num_processes == 1 and m.data * m.fsdp * m.tensor == 1


def make_plan(config: Config, model: DecoderConfig, *, device: DeviceSpec | None = None,
              serve_batch_size: int | None = None, model_source: str = "", serve_tensor: int = 1) -> dict[str, Any]:
    """The whole plan as one JSON-able dict (bytes as ints).

    `serve_tensor`: devices one generation service splits the model over (an external tensor-parallel server;
    drgrpo_jax.serve uses one), so its per-device figures are divided by it.
    """
    sizes = _mesh_sizes(config)
    params, opt_state, frozen = abstract_state(config, model)
    trainer = trainer_memory(config, model, params, opt_state, frozen)
    params_total = trainer.pop("_params_total")
    rows = service_rows(config, serve_batch_size)
    # drgrpo_jax.serve keeps the adapted base weights to merge each pushed adapter into; merged pushes need none.
    merge = 0 if frozen is None or config.model.lora.push == "merged" else adapted_bytes(frozen,
                                                                                         config.model.lora.targets)
    service = {k: v // serve_tensor for k, v in service_memory(config, model, params_total, rows, merge).items()}
    base = params if frozen is None else frozen
    alternative = "activations_without_remat" if config.model.remat else "activations_with_remat"
    plan: dict[str, Any] = {
        "mesh": {**sizes, "devices": math.prod(sizes.values()), "processes": config.mesh.num_processes},
        "model": {"source": model_source, "family": model.family, "layers": model.num_layers,
                  "hidden_size": model.hidden_size, "vocab_size": model.vocab_size, "dtype": config.model.dtype,
                  "parameters": sum(math.prod(v.shape) for _, v, _ in _variables(base)),
                  "adapter_parameters": 0 if frozen is None else sum(math.prod(v.shape) for _, v, _ in
                                                                     _variables(params)),
                  "lora_rank": config.model.lora.rank, "remat": config.model.remat},
        "param_groups": param_groups(base, sizes) + ([] if frozen is None else param_groups(params, sizes)),
        "trainer": {**trainer, "total": _total(trainer),
                    alternative: activation_bytes(config, model, not config.model.remat),
                    "rows_per_device": rows_per_device(config),
                    "sequence": config.rollout.max_prompt_tokens + config.rollout.max_new_tokens - 1},
        "service": {**service, "total": _total(service), "rows": rows, "tensor_ways": serve_tensor,
                    "devices": "one per service process" if serve_tensor == 1 else f"{serve_tensor} per service"},
        "shared_device": shares_one_device(config), "device": None, "fits": None, "advice": [],
    }
    if device is not None:
        usable = int(device.memory_bytes * HEADROOM)
        fits = {"trainer": plan["trainer"]["total"] <= usable, "service": plan["service"]["total"] <= usable}
        if plan["shared_device"]:  # the trainer's child service lives beside it on the same device
            fits["together"] = plan["trainer"]["total"] + plan["service"]["total"] <= usable
        plan["device"] = {"name": device.name, "memory_bytes": device.memory_bytes, "usable_bytes": usable,
                          "source": device.source}
        plan["fits"] = fits
        if not fits["trainer"]:
            plan["advice"] += [f"trainer: {line}" for line in trainer_advice(config, model, trainer, usable)]
        if not fits["service"]:
            plan["advice"] += [f"service: {line}" for line in service_advice(config, model, params_total, usable,
                                                                               rows, merge, serve_tensor)]
    return plan


def _gib(n: int) -> str:
    return f"{n / GIB:9.2f} GiB"


def format_text(plan: dict[str, Any]) -> str:
    """The plan as a short human report."""
    m, mo, tr, sv = plan["mesh"], plan["model"], plan["trainer"], plan["service"]
    lora = (f"; LoRA rank {mo['lora_rank']}: {mo['adapter_parameters']:,} adapter parameters train, the base is "
            "frozen" if mo["lora_rank"] else "")
    lines = [f"model: {mo['source']}: {mo['family']}, {mo['parameters']:,} parameters, {mo['layers']} layers, "
             f"dtype {mo['dtype']}, remat {mo['remat']}{lora}",
             f"mesh: data={m['data']} fsdp={m['fsdp']} tensor={m['tensor']} -> {m['devices']} devices "
             f"over {m['processes']} process(es)", "", "parameter partition specs (per device):"]
    for g in plan["param_groups"]:
        spec = "P(" + ", ".join("None" if a is None else str(a) for a in g["spec"]) + ")"
        mib = g["bytes_per_device"] / 2**20
        lines.append(f"  {g['name']:<20} {str(tuple(g['shape'])):<24} {spec:<30} {mib:10.1f} MiB")
    lines += ["", f"trainer, per device ({tr['rows_per_device']} response(s) of {tr['sequence']} tokens "
                  "per micro-batch):"]
    for key in ("params", "adapters", "optimizer", "gradients", "reference", "activations", "logprob_chunks", "batch",
                "total"):
        lines.append(f"  {key:<16} {_gib(tr[key])}")
    other = "activations_without_remat" if "activations_without_remat" in tr else "activations_with_remat"
    lines.append(f"  ({other.replace('_', ' ')}: {_gib(tr[other]).strip()})")
    where = "one device" if sv["tensor_ways"] == 1 else f"one of its {sv['tensor_ways']} devices (tensor-parallel)"
    lines += ["", f"generation service, {where} ({sv['rows']} rows at once):"]
    for key in ("weights", "adapter_merge", "kv_cache", "prefill_attention", "logits", "total"):
        lines.append(f"  {key:<17} {_gib(sv[key])}")
    if plan["device"] is None:
        lines += ["", "no target device: pass --device NAME or --device-memory GiB to check the fit"]
        return "\n".join(lines)
    d = plan["device"]
    lines += ["", f"device: {d['name']} ({d['source']}); usable {_gib(d['usable_bytes']).strip()} "
                  f"({HEADROOM:.0%} of {_gib(d['memory_bytes']).strip()})"]
    for part in ("trainer", "service"):
        verdict = "fits" if plan["fits"][part] else "DOES NOT FIT"
        lines.append(f"  {part}: {_gib(plan[part]['total']).strip()} -> {verdict}")
    if "together" in plan["fits"]:
        together = plan["trainer"]["total"] + plan["service"]["total"]
        verdict = "fits" if plan["fits"]["together"] else "DOES NOT FIT"
        lines.append(f"  trainer + its child service on this one device: {_gib(together).strip()} -> {verdict}")
    lines += [f"  change {line}" for line in plan["advice"]]
    return "\n".join(lines)


def _load(config_path: str | None, overrides: list[str]) -> tuple[Config, list[str]]:
    """The config; model.path / data.path left empty are filled with a placeholder (the plan reads neither)."""
    filled: list[str] = []
    while True:
        try:
            return load_config(config_path, overrides + [f"{k}=unset" for k in filled]), filled
        except ConfigError as error:
            unset = isinstance(error, MissingValueError) and error.key in ("model.path", "data.path")
            if not unset or error.key in filled:
                raise
            filled.append(error.key)


def main(argv: list[str] | None = None) -> int:
    """The CLI; a bad config or argument exits 2 with one line."""
    parser = argparse.ArgumentParser(prog="python -m drgrpo_jax.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="the run's YAML (omit for the defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, as for drgrpo_jax.train")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--device", help=f"target device: {', '.join(DEVICES)}")
    target.add_argument("--device-memory", type=float, help="target device memory in GiB")
    parser.add_argument("--model-config", help=f"HF folder, config.json or preset ({', '.join(PRESETS)})")
    parser.add_argument("--serve-batch-size", type=int,
                        help="rows one generation service samples at once (default: rollout.service_batch_size)")
    parser.add_argument("--serve-tensor", type=int, default=1,
                        help="devices one generation service splits the model over (an external tensor-parallel "
                             "server such as SGLang-JAX --tp N; drgrpo_jax.serve uses 1)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # eval_shape needs no accelerator
    try:
        config, filled = _load(args.config, args.overrides)
        model, source = resolve_decoder_config(config if "model.path" not in filled else dataclasses.replace(
            config, model=dataclasses.replace(config.model, path="")), args.model_config)
        device = None
        if args.device:
            device = device_spec(args.device)
        elif args.device_memory is not None:
            if not args.device_memory > 0:
                raise ConfigError("--device-memory", f"must be > 0 GiB, got {args.device_memory}")
            device = DeviceSpec(f"{args.device_memory:g} GiB", int(args.device_memory * GIB), "--device-memory")
        if args.serve_batch_size is not None and args.serve_batch_size < 1:
            raise ConfigError("--serve-batch-size", f"must be >= 1, got {args.serve_batch_size}")
        if args.serve_tensor < 1:
            raise ConfigError("--serve-tensor", f"must be >= 1, got {args.serve_tensor}")
        plan = make_plan(config, model, device=device, serve_batch_size=args.serve_batch_size, model_source=source,
                         serve_tensor=args.serve_tensor)
    except ConfigError as error:
        print(f"python -m drgrpo_jax.plan: config error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(plan) if args.format == "json" else format_text(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
