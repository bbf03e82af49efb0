"""The generation service's memory per device and the batch that fits: estimates for drgrpo_jax.plan.

A service over a (data, tensor) mesh (`--mesh`, `rollout.service_mesh`) splits its weights and KV cache by the
trainer's logical-axis rules (heads, MLP and vocabulary on tensor) and its rows over data. One of its devices holds:
its share of the weights; the stacked layers' weights once more, split per layer (the sampler's programs slice
them before their loops); with LoRA adapters pushed, a base copy of the adapted projections to merge each adapter
into; and what one sampler batch of its rows holds (`sampler/memory.py`: the KV cache, under router replay the
experts it records, and the larger of the prefill's and the decode loop's temporaries).
tests/plan/test_plan_service.py (and tests/sampler/test_moe_memory.py for a mixture) checks these against the
compiled programs' own memory analysis.
"""

from __future__ import annotations

import math

from drgrpo_jax.config.derived import child_service_batch_size
from drgrpo_jax.config.schema import Config
from drgrpo_jax.config.serve import DEFAULT_MAX_BATCH_SIZE
from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.params import param_specs
from drgrpo_jax.models.precision import DTYPES
from drgrpo_jax.plan.hardware import GIB
from drgrpo_jax.sampler.batch import batch_bucket, bucket
from drgrpo_jax.sampler.memory import batch_memory, batch_peak
from drgrpo_jax.sharding import MeshShape, ShardingRules, logical_to_spec

__all__ = ["indivisible", "prefix_cache_budget", "service_advice", "service_memory", "service_rows", "service_total",
           "smallest_tensor", "total"]

def total(figures: dict[str, int]) -> int:
    """The sum of a figures dict, leaving out private entries ("_...")."""
    return sum(v for k, v in figures.items() if not k.startswith("_"))


def _ways(logical_axes: tuple[str | None, ...], mesh: MeshShape) -> list[int]:
    """Devices each dimension is split over, by the trainer's rules, on the service's mesh."""
    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "context": mesh.context, "tensor": mesh.tensor}
    ways = []
    for entry in logical_to_spec(logical_axes, ShardingRules()):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        ways.append(math.prod(sizes[n] for n in names))
    return ways


def indivisible(model: DecoderConfig, mesh: MeshShape) -> str | None:
    """The first array and dimension the service's mesh does not divide (as check_mesh refuses it), else None."""
    for name, (shape, axes) in param_specs(model).items():
        for dim, logical, ways in zip(shape, axes, _ways(axes, mesh)):
            if dim % ways:
                return f"{name}: dimension {logical!r} of size {dim} does not split over {ways} devices"
    return None


def _weights(model: DecoderConfig, itemsize: int, mesh: MeshShape) -> tuple[int, int]:
    """(every parameter, the stacked layers' parameters) bytes on one device of the mesh."""
    every = layers = 0
    for name, (shape, axes) in param_specs(model).items():
        size = math.prod(shape) * itemsize // math.prod(_ways(axes, mesh))
        every += size
        layers += size if name.startswith("blocks/") else 0
    return every, layers


def service_rows(config: Config, serve_batch_size: int | None) -> int:
    """Rows one service samples at once: --serve-batch-size, else rollout.service_batch_size, else the default.

    The default: the trainer's child takes what the trainer starts it with; URLs split a rollout.
    """
    r = config.rollout
    if not serve_batch_size and r.service_batch_size is None and r.urls:
        # each service gets its share, capped by drgrpo_jax.serve's default --max-batch-size
        share = math.ceil(r.prompts_per_step * r.group_size / len(r.urls))
        return batch_bucket(min(share, DEFAULT_MAX_BATCH_SIZE))
    return batch_bucket(serve_batch_size or child_service_batch_size(config))


def service_memory(config: Config, model: DecoderConfig, rows: int, *, tensor: int = 1, data: int = 1,
                   merge_bytes: int = 0, backend: str = "cpu") -> dict[str, int]:
    """One device of a generation service over a (data, tensor) mesh serving `rows` rows at once (module doc);
    `merge_bytes`: the adapted projections' bytes on all devices (LoRA adapter pushes); `backend` the service's
    (a mixture's dispatch buffers depend on it)."""
    a, r = DTYPES[config.model.dtype].itemsize, config.rollout
    weights, layers = _weights(model, a, MeshShape(data=data, fsdp=1, tensor=tensor))
    batch = batch_memory(model, rows, bucket(r.max_prompt_tokens), bucket(r.max_new_tokens), a, tensor=tensor,
                         data=data, backend=backend, record=config.model.moe.router_replay)
    return {"weights": weights, "layer_split": layers, "adapter_merge": merge_bytes // tensor, **batch}


def prefix_cache_budget(figures: dict[str, int], usable: int) -> int:
    """The prefix cache's budget on one service device at --prefix-cache-bytes -1: a quarter of the batch
    budget, which defaults to half of what the weights leave free (--max-batch-bytes 0). The pool grows to it only
    as prompts repeat; beside batches that fit their half, it fits too (half + an eighth of the free memory)."""
    free = usable - figures["weights"] - figures["layer_split"] - figures["adapter_merge"]
    return max(free, 0) // 2 // 4


def service_total(figures: dict[str, int]) -> int:
    """A service device's peak: what every program holds, and the larger of the prefill's and the decode loop's
    temporaries (they live in different programs)."""
    return figures["weights"] + figures["layer_split"] + figures["adapter_merge"] + batch_peak(figures)


def smallest_tensor(config: Config, model: DecoderConfig, rows: int, usable: int, *, data: int = 1,
                    merge_bytes: int = 0, limit: int = 64, backend: str = "cpu") -> int | None:
    """The fewest devices (tensor ways, dividing heads, MLP and vocabulary) one service's weights and `rows` rows
    fit on, `usable` bytes each; None up to `limit`."""
    for tensor in range(1, limit + 1):
        if indivisible(model, MeshShape(data=data, fsdp=1, tensor=tensor)) is None and service_total(
                service_memory(config, model, rows, tensor=tensor, data=data, merge_bytes=merge_bytes,
                               backend=backend)) <= usable:
            return tensor
    return None


def service_advice(config: Config, model: DecoderConfig, usable: int, rows: int, *, tensor: int = 1, data: int = 1,
                   merge_bytes: int = 0, backend: str = "cpu") -> list[str]:
    """The largest batch one service device holds, or the mesh that the weights need."""

    def per_device(batch: int) -> int:
        return service_total(service_memory(config, model, batch, tensor=tensor, data=data, merge_bytes=merge_bytes,
                                            backend=backend))

    fits = rows
    while fits > data and per_device(fits) > usable:
        fits //= 2
    if per_device(fits) <= usable:
        return [f"start each generation service with --max-batch-size {fits} (and list them in rollout.urls; "
                f"rollout.service_batch_size={fits} starts the trainer's own child so and lets the plan check it); "
                f"{rows} rows at once need {per_device(rows) / GIB:.1f} GiB per device"]
    needed = smallest_tensor(config, model, rows, usable, data=data, merge_bytes=merge_bytes, backend=backend)
    if needed is not None:
        return [f"split each generation service over more devices: --mesh tensor={needed}"
                f"{f',data={data}' if data > 1 else ''} (drgrpo_jax.serve; rollout.service_mesh for the trainer's "
                f"own child and the launchers') holds {rows} rows"]
    return ["even one row does not fit: lower rollout.max_new_tokens or rollout.max_prompt_tokens"]
