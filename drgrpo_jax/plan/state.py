"""Exact per-device state figures for drgrpo_jax.plan: shapes from jax.eval_shape, split by the logical-axis rules.

Parameters, adapters, optimizer state and gradients of the real model and optax chain, as `train_step.init_state`
splits them; with the activation and log-prob estimates of plan/activations.py, the trainer's figures.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from flax import nnx

from drgrpo_jax.config.derived import lora_base_dtype, lora_spec
from drgrpo_jax.config.schema import Config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.lora import add_adapters, store_base
from drgrpo_jax.models.precision import DTYPES
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.plan.activations import batch_bytes, logprob_chunk_bytes
from drgrpo_jax.seeds import init_key
from drgrpo_jax.sharding import ShardingRules, logical_to_spec
from drgrpo_jax.step.optimizer import make_optimizer

__all__ = ["abstract_state", "adapted_bytes", "gradient_bytes", "mesh_sizes", "param_groups", "state_bytes",
           "trainer_memory", "variables"]


def mesh_sizes(config: Config) -> dict[str, int]:
    """Each mesh axis's ways, by name (sharding.MESH_AXES)."""
    m = config.mesh
    return {"data": m.data, "fsdp": m.fsdp, "tensor": m.tensor, "context": m.context}


def _shard_elements(name: str, shape: tuple[int, ...], logical_axes: tuple[str | None, ...] | None,
                    sizes: dict[str, int]) -> tuple[int, tuple]:
    """(elements held by one device, PartitionSpec as a tuple); ConfigError when a mesh axis does not divide."""
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


def variables(tree: Any) -> list[tuple[str, Any, tuple | None]]:
    """(path, ShapeDtypeStruct, logical axes or None) for every array leaf of an abstract state."""
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
    dtype = DTYPES[config.model.dtype]
    spec = lora_spec(config)

    def build():
        base = Transformer(model, rngs=nnx.Rngs(0), dtype=dtype)
        return base if spec is None else add_adapters(base, spec, init_key(0))  # shapes only

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
    for name, value, axes in variables(tree):
        elements, _ = _shard_elements(name, value.shape, axes, sizes)
        per_device += elements * value.dtype.itemsize
        total += math.prod(value.shape) * value.dtype.itemsize
    return per_device, total


def param_groups(params: Any, sizes: dict[str, int]) -> list[dict[str, Any]]:
    """One row per parameter: global shape, logical axes, partition spec, bytes on one device."""
    rows = []
    for name, value, axes in variables(params):
        elements, spec = _shard_elements(name, value.shape, axes, sizes)
        rows.append({"name": name, "shape": list(value.shape), "dtype": str(value.dtype),
                     "logical_axes": list(axes or ()), "spec": [a if a is None or isinstance(a, str) else list(a)
                                                                 for a in spec],
                     "bytes_per_device": elements * value.dtype.itemsize})
    return rows


def trainer_memory(config: Config, model: DecoderConfig, params: Any, opt_state: Any,
                   frozen: Any = None) -> dict[str, int]:
    """Per-device trainer figures in bytes but the activations (exact params/adapters/optimizer; estimated rest).

    With LoRA (`frozen` given), `params` are the base weights (frozen: no gradient, no optimizer state) and
    `adapters` the float32 adapters, whose gradients and Adam moments are the only ones; the KL reference
    is the base with the adapters off, so it costs nothing.
    """
    sizes = mesh_sizes(config)
    trainable_device, trainable_total = state_bytes(params, sizes)
    opt_device, _ = state_bytes(opt_state, sizes)
    grads = gradient_bytes(config, model, params, frozen, config.model.remat)
    if frozen is None:
        params_device, params_total, adapters = trainable_device, trainable_total, 0
    else:  # the trainer stores the base as model.lora.base_dtype says; the services load model.path's (total)
        params_device, adapters = stored_base_bytes(config, model, sizes), trainable_device
        params_total = state_bytes(frozen, sizes)[1]
    return {"params": params_device, "adapters": adapters, "optimizer": opt_device, "gradients": grads,
            "reference": params_device if config.algorithm.kl_coef > 0 and frozen is None else 0,
            "logprob_chunks": logprob_chunk_bytes(config, model), "batch": batch_bytes(config),
            "_params_total": params_total}


def gradient_bytes(config: Config, model: DecoderConfig, params: Any, frozen: Any, policy: str) -> int:
    """Per-device bytes of train_step's gradients: the float32 running sum and one micro-batch's gradient.

    The micro-batch's is in the trainable dtype. Under remat `full` without LoRA the layer scan adds each layer's
    gradient into the sum where it is made (models/grad_sums.py): only the weights outside the layers and one layer's
    are held beside the sum. `policy` "auto" (not yet resolved) counts the whole micro-batch gradient.
    """
    sizes = mesh_sizes(config)
    trainable = state_bytes(params, sizes)[0]
    held = trainable
    if frozen is None and policy == "full":
        layers = state_bytes(params["blocks"], sizes)[0]
        held = trainable - layers + layers // model.num_layers
    trainable_itemsize = 4 if frozen is not None else DTYPES[config.model.dtype].itemsize
    return trainable * 4 // trainable_itemsize + held


def stored_base_bytes(config: Config, model: DecoderConfig, sizes: dict[str, int]) -> int:
    """Per-device bytes of the frozen LoRA base as the trainer stores it (model.lora.base_dtype: `lora.store_base`)."""
    dtype = DTYPES[config.model.dtype]
    stored = nnx.eval_shape(lambda: store_base(Transformer(model, rngs=nnx.Rngs(0), dtype=dtype),
                                               lora_base_dtype(config)))
    return state_bytes(nnx.state(stored, nnx.Param), sizes)[0]


def adapted_bytes(frozen: Any, targets: tuple[str, ...]) -> int:
    """Bytes of the base weights LoRA adapts (all devices): what a service keeps a second copy of to merge into."""
    return sum(math.prod(value.shape) * value.dtype.itemsize for name, value, _ in variables(frozen)
               if name.removeprefix("blocks/") in targets)
