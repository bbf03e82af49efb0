"""LoRA: stacked low-rank adapters on the decoder's projections, PEFT adapter folders out and in, merging.

Shape letters (docs/shape_letters.md): L layers, X and Y a projection's input and output features (several axes
for the head-shaped ones: q_proj [D, Q, H], o_proj [Q, H, D]), and Z the adapter rank r. Each targeted projection
W [L, *X, *Y] gets A [L, *X, Z] (random) and B [L, Z, *Y] (zeros: a fresh adapter leaves the model unchanged) as
`nnx.LoRAParam`s beside it in `Blocks`; `transformer._project` adds (alpha / r) * dropout(x) A B to x W, and
`nnx.split(model, nnx.LoRAParam, nnx.Param)` separates what trains from the frozen base. Not qwix's LoRA nor
`nnx.LoRA`: our stacked weights, sliced inside `lax.scan` into a custom-VJP GEMM, are neither a matched module's
own dot operand nor per-layer `Linear`s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from drgrpo_jax.models.config import LORA_TARGETS, DecoderConfig, LoraSpec
from drgrpo_jax.models.hf_io import read_safetensors, write_safetensors
from drgrpo_jax.models.params import param_specs
from drgrpo_jax.models.quant import SCALE_SUFFIX, dequantize, quantize
from drgrpo_jax.models.transformer import Transformer

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "add_adapters", "adapter_arrays", "adapter_specs", "is_adapter_folder",
           "load_adapter", "merge_adapters", "merged_model", "read_adapter_config", "save_adapter", "store_base"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Our projection name -> its module under transformers' decoder layer.
HF_MODULES = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
              "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
              "down_proj": "mlp.down_proj"}
_IN_DIMS = {"o_proj": 2}  # input axes of a projection's weight (after L); the others have one
_PEFT_PREFIX = "base_model.model."
ArrayLike = jax.Array | np.ndarray  # adapters on the device, or on the host (exports, loaded folders)


def adapter_specs(config: DecoderConfig, spec: LoraSpec) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """(shape, logical axes) of every adapter array, keyed by its name in `Blocks` ("q_proj_lora_a", ...).

    A shares its projection's input axes and B its output axes, so adapters shard like their weights;
    the rank axis is replicated.
    """
    base = param_specs(config)
    absent = [t for t in spec.targets if f"blocks/{t}" not in base]
    if absent:
        raise ValueError(f"lora.targets: {config.family} has no {', '.join(absent)} (a mixture of experts' MLP takes "
                         f"no adapter: target attention, {', '.join(LORA_TARGETS[:4])})")
    out = {}
    for target in spec.targets:
        (L, *shape), (layers, *axes) = base[f"blocks/{target}"]
        n_in = _IN_DIMS.get(target, 1)
        out[f"{target}_lora_a"] = ((L, *shape[:n_in], spec.rank), (layers, *axes[:n_in], None))
        out[f"{target}_lora_b"] = ((L, spec.rank, *shape[n_in:]), (layers, None, *axes[n_in:]))
    return out


def add_adapters(model: Transformer, spec: LoraSpec, key: jax.Array) -> Transformer:
    """`model` with float32 adapters on `spec.targets` (A as PEFT's default init, B = 0): unchanged outputs."""
    model.runtime = dataclasses.replace(model.runtime, lora=spec)
    for index, (name, (shape, axes)) in enumerate(adapter_specs(model.config, spec).items()):
        if name.endswith("_lora_a"):
            # PEFT: kaiming_uniform(a=sqrt(5)) on [r, in], i.e. uniform(+-1/sqrt(in)).
            bound = 1.0 / math.sqrt(math.prod(shape[1:-1]))
            value = jax.random.uniform(jax.random.fold_in(key, index), shape, jnp.float32, -bound, bound)
        else:
            value = jnp.zeros(shape, jnp.float32)
        setattr(model.blocks, name, nnx.LoRAParam(value, logical_axes=axes))
    return model


def store_base(model: Transformer, base_dtype: str) -> Transformer:
    """`model` (in place, like `add_adapters`) with its decoder projections stored as `base_dtype`.

    "bfloat16" casts them; "int8" quantises them per output channel and adds each one's float32 scales
    ("q_proj_scale" [L, *Y], sharded like the weight's output axes) beside it as a Param, frozen with the base.
    Embeddings, norms and biases keep model.dtype, and with them the residual stream. "float32" casts to it.
    """
    specs = param_specs(model.config)
    for name in (n for n in LORA_TARGETS if f"blocks/{n}" in specs):  # a mixture's experts keep model.dtype
        variable = getattr(model.blocks, name)
        if base_dtype != "int8":
            variable.set_value(variable[...].astype(base_dtype))
            continue
        in_dims = _IN_DIMS.get(name, 1)
        q, scale = _quantize(variable[...], in_dims)
        layers, *axes = specs[f"blocks/{name}"][1]
        variable.set_value(q)
        setattr(model.blocks, name + SCALE_SUFFIX, nnx.Param(scale, logical_axes=(layers, *axes[in_dims:])))
    return model


_quantize = jax.jit(quantize, static_argnums=1)


def adapter_arrays(adapters: nnx.State) -> dict[str, jax.Array]:
    """The adapter state (`nnx.split(model, nnx.LoRAParam, ...)`'s) as {"q_proj_lora_a": [L, *X, Z], ...}."""
    out = {}
    for path, variable in nnx.to_flat_state(adapters):
        out[str(path[-1])] = variable[...] if isinstance(variable, nnx.Variable) else variable
    return out


# ---------------------------------------------------------------- merging


def merged_weight(w: jax.Array, a: ArrayLike, b: ArrayLike, scale: float) -> jax.Array:
    """W + scale * A B for stacked [L, *X, *Y] weights, in float32, returned in W's dtype."""
    L, Z = a.shape[0], a.shape[-1]
    delta = jnp.einsum("lxz,lzy->lxy", jnp.asarray(a, jnp.float32).reshape(L, -1, Z),
                       jnp.asarray(b, jnp.float32).reshape(L, Z, -1), precision=jax.lax.Precision.HIGHEST)
    return (jnp.asarray(w, jnp.float32) + scale * delta.reshape(w.shape)).astype(w.dtype)


def merge_adapters(model: Transformer, spec: LoraSpec, adapters: Mapping[str, ArrayLike]) -> Transformer:
    """A plain Transformer (no adapters) equal to `model` with the adapters merged into their weights.

    `model` may carry adapters itself (they are dropped); arrays of untargeted weights are shared, not copied.
    A base stored narrower (`store_base`) comes out in model.dtype (the embedding's), int8 dequantised.
    """
    runtime = dataclasses.replace(model.runtime, lora=None)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(model.config, rngs=nnx.Rngs(0), runtime=runtime)))
    source = {"/".join(str(p) for p in path): v[...] for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    for path, variable in nnx.to_flat_state(state):
        name = "/".join(str(p) for p in path)
        value = source[name]
        target = name.removeprefix("blocks/")
        if name.startswith("blocks/") and target in LORA_TARGETS:
            if (scale := source.get(name + SCALE_SUFFIX)) is not None:
                value = jax.vmap(dequantize)(value, scale)
            if value.dtype != source["embed"].dtype:
                value = value.astype(source["embed"].dtype)
        if name.startswith("blocks/") and target in spec.targets:
            value = merged_weight(value, adapters[f"{target}_lora_a"], adapters[f"{target}_lora_b"], spec.scale)
        variable.set_value(value)
    return nnx.merge(graphdef, state)


def merged_model(model: Transformer) -> Transformer:
    """A model with adapters as the plain Transformer of its merged weights (what `save_pretrained` writes)."""
    if model.runtime.lora is None:
        return model
    return merge_adapters(model, model.runtime.lora, adapter_arrays(nnx.state(model, nnx.LoRAParam)))


# ---------------------------------------------------------------- PEFT folders


def _peft_name(target: str, layer: int, matrix: str) -> str:
    """PEFT's tensor name (what `peft.PeftModel.from_pretrained` loads): lora_A [r, in], lora_B [out, r], in and
    out flattened in HF order, which is ours flattened (q_proj's outputs are (Q, H) head-major in both)."""
    return f"{_PEFT_PREFIX}model.layers.{layer}.{HF_MODULES[target]}.lora_{matrix}.weight"


def save_adapter(adapters: Mapping[str, ArrayLike], spec: LoraSpec, path: str, *, base_model: str = "") -> None:
    """Writes a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors, float32) at `path`."""
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for target in spec.targets:
        a = np.asarray(adapters[f"{target}_lora_a"], np.float32)
        b = np.asarray(adapters[f"{target}_lora_b"], np.float32)
        for layer in range(a.shape[0]):  # [L, *X, r]
            tensors[_peft_name(target, layer, "A")] = np.ascontiguousarray(a[layer].reshape(-1, spec.rank).T)
            tensors[_peft_name(target, layer, "B")] = np.ascontiguousarray(b[layer].reshape(spec.rank, -1).T)
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    peft_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": alpha,
                   "lora_dropout": spec.dropout, "target_modules": sorted(spec.targets), "bias": "none",
                   "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
                   "layers_to_transform": None, "init_lora_weights": True, "inference_mode": True,
                   "base_model_name_or_path": base_model}
    write_safetensors(os.path.join(path, ADAPTER_WEIGHTS), tensors)
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config, f, indent=2)


def is_adapter_folder(path: str) -> bool:
    """Whether `path` is a PEFT adapter folder (it holds adapter_config.json)."""
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def read_adapter_config(path: str) -> tuple[LoraSpec, str]:
    """(the adapter's LoraSpec, its base_model_name_or_path) from a PEFT folder; ValueError for what we cannot apply."""
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        peft = json.load(f)
    if peft.get("peft_type") != "LORA":
        raise ValueError(f"adapter: peft_type {peft.get('peft_type')!r} is not LORA")
    for key, plain in [("fan_in_fan_out", False), ("use_rslora", False), ("use_dora", False), ("bias", "none"),
                       ("modules_to_save", None), ("layers_to_transform", None)]:
        if peft.get(key, plain) not in (plain, [], {}):
            raise ValueError(f"adapter: {key}={peft[key]!r} is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if peft.get(key):
            raise ValueError(f"adapter: {key} (per-module ranks) is not supported")
    targets = peft.get("target_modules")
    if not isinstance(targets, list) or not targets or not set(targets) <= set(LORA_TARGETS):
        raise ValueError(f"adapter: target_modules must list some of {list(LORA_TARGETS)}, got {targets!r}")
    spec = LoraSpec(rank=int(peft["r"]), alpha=float(peft["lora_alpha"]), dropout=float(peft.get("lora_dropout", 0.0)),
                    targets=tuple(t for t in LORA_TARGETS if t in targets))
    return spec, str(peft.get("base_model_name_or_path") or "")


def load_adapter(path: str, config: DecoderConfig) -> tuple[LoraSpec, dict[str, np.ndarray]]:
    """A PEFT LoRA folder as (spec, float32 stacked arrays in our layout) for a model of `config`; ValueError
    naming the tensor when one is missing, extra or of the wrong shape."""
    spec, _ = read_adapter_config(path)
    tensors = read_safetensors(os.path.join(path, ADAPTER_WEIGHTS))
    expected = adapter_specs(config, spec)
    out = {}
    for target in spec.targets:
        shape_a, shape_b = expected[f"{target}_lora_a"][0], expected[f"{target}_lora_b"][0]
        a_layers, b_layers = [], []
        for layer in range(config.num_layers):
            name_a, name_b = _peft_name(target, layer, "A"), _peft_name(target, layer, "B")
            for name, want in [(name_a, (spec.rank, math.prod(shape_a[1:-1]))),
                               (name_b, (math.prod(shape_b[2:]), spec.rank))]:
                if name not in tensors:
                    raise ValueError(f"adapter: tensor {name} is missing")
                if tuple(tensors[name].shape) != want:
                    raise ValueError(f"adapter: {name} has shape {tuple(tensors[name].shape)}, the model needs {want}")
            a_layers.append(tensors.pop(name_a).astype(np.float32).T.reshape(shape_a[1:]))
            b_layers.append(tensors.pop(name_b).astype(np.float32).T.reshape(shape_b[1:]))
        out[f"{target}_lora_a"], out[f"{target}_lora_b"] = np.stack(a_layers), np.stack(b_layers)
    if tensors:
        raise ValueError(f"adapter: {len(tensors)} tensors this model has no place for, e.g. {sorted(tensors)[0]}")
    for name, value in out.items():
        if not np.all(np.isfinite(value)):
            raise ValueError(f"adapter: {name} contains NaN or inf")
    return spec, out
