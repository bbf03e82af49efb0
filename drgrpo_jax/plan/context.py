"""mesh.context in the plan: what the split sends per layer, each context size's per-device memory, and the
smallest size that fits.

A context size is tried two ways: on the same devices (its ways taken from the row-splitting ways, fsdp kept where
it can be, and train.micro_batches raised so that a device holds as many rows as before, each that many times
shorter), and on that many times the devices (data, fsdp and tensor kept). The figures of each candidate are the
planner's own (`planner.make_plan` passes its trainer estimate in), so the table and the plan never disagree.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from drgrpo_jax.config.rules import validate
from drgrpo_jax.config.schema import Config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.plan.activations import gathered_kv_bytes, model_call
from drgrpo_jax.plan.hardware import GIB

__all__ = ["context_advice", "context_sizes", "context_table", "context_traffic", "more_devices", "same_devices",
           "variant"]

# (trainer figures, remat policy) of a candidate config: the planner's estimate, passed in.
TrainerEstimate = Callable[[Config], tuple[dict[str, int], str]]


def context_traffic(config: Config, model: DecoderConfig) -> dict[str, int]:
    """Bytes one device receives for the split, per layer of one micro-batch and per optimizer step.

    Forward: the keys and values of the other ways - 1 of mesh.context's ways, (ways - 1) / ways of the whole row's
    (`gathered_kv_bytes`) for each of its b rows. Backward, at most twice that: the gather again where remat
    recomputes the layer, and the reduce-scatter of the keys' and values' gradients. A step: both, over every layer
    and micro-batch. 0 with one way.
    """
    ways = config.mesh.context
    rows, S = model_call(config)
    forward = rows * gathered_kv_bytes(config, model, S) * (ways - 1) // ways
    per_step = (forward + 2 * forward) * model.num_layers * config.train.micro_batches
    return {"forward_per_layer": forward, "backward_per_layer": 2 * forward, "per_step": per_step}


def context_sizes(config: Config) -> list[int]:
    """The context sizes the table tries: 1, 2, 4, ... up to the mesh's device count (at least 8)."""
    return [2**k for k in range(int(math.log2(max(config.mesh.devices, 8))) + 1)]


def variant(config: Config, **changes: dict[str, Any]) -> Config | None:
    """The config with fields of its sections changed (`train={"micro_batches": 4}`), or None when it no longer
    validates."""
    sections = {name: dataclasses.replace(getattr(config, name), **fields) for name, fields in changes.items()}
    candidate = dataclasses.replace(config, **sections)
    try:
        validate(candidate)
    except ConfigError:
        return None
    return candidate


def same_devices(config: Config, context: int) -> Config | None:
    """mesh.context = `context` on the mesh's devices: the row ways data x fsdp shrink (or grow) to fit, fsdp kept
    where it divides them, and train.micro_batches scaled so a device holds as many rows a micro-batch; None when
    the devices or the window do not split so."""
    m = config.mesh
    row_ways, rest = divmod(m.devices, m.tensor * context)
    if rest or row_ways < 1:
        return None
    fsdp = math.gcd(m.fsdp, row_ways)
    micro, left = divmod(config.train.micro_batches * m.data * m.fsdp, row_ways)
    if left or micro < 1:
        return None
    return variant(config, mesh={"context": context, "data": row_ways // fsdp, "fsdp": fsdp},
                  train={"micro_batches": micro})


def more_devices(config: Config, context: int) -> Config | None:
    """mesh.context = `context` with data, fsdp and tensor kept: the mesh takes context / mesh.context times the
    devices; None when it does not validate."""
    return variant(config, mesh={"context": context})


def _row(candidate: Config, model: DecoderConfig, estimate: TrainerEstimate, usable: int) -> dict[str, Any]:
    figures, policy = estimate(candidate)
    m, total = candidate.mesh, sum(v for k, v in figures.items() if not k.startswith("_"))
    return {"context": m.context, "data": m.data, "fsdp": m.fsdp, "tensor": m.tensor, "devices": m.devices,
            "micro_batches": candidate.train.micro_batches, "remat_policy": policy,
            "activations": figures["activations"], "total": total, "fits": total <= usable,
            "traffic_per_layer": context_traffic(candidate, model)["forward_per_layer"]}


def context_table(config: Config, model: DecoderConfig, estimate: TrainerEstimate, usable: int
                  ) -> list[dict[str, Any]]:
    """One row per context size and way of placing it (`same_devices`, then `more_devices` where that differs)
    whose fsdp x context splits the model's state, each with its mesh, micro-batches, activations, per-device
    total, whether it fits `usable` bytes and the forward's bytes received per layer for the split."""
    rows, seen = [], set()
    for context in context_sizes(config):
        for candidate in (same_devices(config, context), more_devices(config, context)):
            if candidate is None:
                continue
            m = candidate.mesh
            key = (m.data, m.fsdp, m.tensor, m.context, candidate.train.micro_batches)
            if key in seen:
                continue
            seen.add(key)
            try:
                rows.append(_row(candidate, model, estimate, usable))
            except ConfigError:  # fsdp x context does not divide the model's dims: not a mesh this model can take
                continue
    return rows


def context_advice(config: Config, table: list[dict[str, Any]]) -> str | None:
    """The smallest mesh.context above the current one that fits: on the same devices if one does, else on more;
    None when no row of the table fits."""
    larger = [r for r in table if r["fits"] and r["context"] > config.mesh.context]
    same = [r for r in larger if r["devices"] == config.mesh.devices]
    if same:
        r = same[0]
        return (f"mesh.context={r['context']} with mesh.data={r['data']} mesh.fsdp={r['fsdp']} "
                f"train.micro_batches={r['micro_batches']}: each row's tokens split {r['context']} ways, "
                f"{r['total'] / GIB:.2f} GiB per device on the same {r['devices']} devices")
    if larger:
        r = min(larger, key=lambda row: (row["devices"], row["context"]))
        return (f"mesh.context={r['context']} on {r['devices']} devices (mesh.data={r['data']} "
                f"mesh.fsdp={r['fsdp']} mesh.tensor={r['tensor']} kept): each row's tokens split {r['context']} "
                f"ways, {r['total'] / GIB:.2f} GiB per device")
    return None
