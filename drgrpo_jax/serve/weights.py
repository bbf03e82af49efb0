"""The served weights: one immutable `Weights` generation, loaded from an HF folder, a PEFT adapter merged
into the base, or named tensors from a shared-memory segment (the trainer's in-memory push), and the checks
a new generation passes before it is swapped in. On a service mesh (--mesh) every generation lands already split:
each parameter goes straight from the host to its shards by the trainer's logical-axis rules, never whole on one
device."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from drgrpo_jax.errors import InvalidWeights
from drgrpo_jax.models.hf_io import build_model, load_hf_config
from drgrpo_jax.models.lora import is_adapter_folder, load_adapter, merge_adapters, read_adapter_config
from drgrpo_jax.models.precision import DTYPES  # ServeConfig.dtype -> parameter and KV-cache dtype
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.sampler.programs import check_mesh
from drgrpo_jax.sharding import param_shardings


@dataclasses.dataclass(frozen=True)
class Weights:
    """One immutable generation of served weights; swapped as a whole."""

    graphdef: nnx.GraphDef
    state: nnx.State
    config: Any  # drgrpo_jax.models.DecoderConfig
    version: str
    path: str
    adapter: dict[str, Any] | None = None  # the LoRA adapter merged into the base: path, rank, alpha, targets
    mesh: Mesh | None = None  # the service's mesh the state is split over (None: one device)


def load_weights(path: str, dtype: str, version: str, mesh: Mesh | None = None) -> Weights:
    """Reads a checkpoint from disk (no device state is touched before it has loaded); on a mesh each parameter
    goes to its shards only (`build_model`)."""
    model = from_pretrained(path, dtype=DTYPES[dtype], mesh=mesh)
    graphdef, state = nnx.split(model)
    return Weights(graphdef, state, model.config, str(version), path, mesh=mesh)


def load_served(path: str, dtype: str, version: str, mesh: Mesh | None = None) -> tuple[Weights, Weights]:
    """(base, served) from --model: a model serves itself; a PEFT adapter folder serves the base its
    adapter_config.json names (base_model_name_or_path) with the adapter merged in. On a mesh an HF folder's
    config is checked against it first (--mesh named), before any weight is read."""
    base_path = path
    if is_adapter_folder(path):
        _, base_path = read_adapter_config(path)
        if not base_path:
            raise ValueError(f"{path}: adapter_config.json names no base_model_name_or_path; start the service with "
                             "--model BASE and push the adapter to /update_weights_from_disk")
    if mesh is not None and os.path.isdir(base_path):
        check_mesh(load_hf_config(base_path), mesh)
    base = load_weights(base_path, dtype, version, mesh)
    return (base, base) if base_path == path else (base, with_adapter(base, path, version))


def with_adapter(base: Weights, folder: str, version: str, shown_path: str | None = None) -> Weights:
    """`base` with the PEFT LoRA adapter in `folder` merged into its weights (W + alpha / r * A B).

    Merging keeps decoding as fast as the base's and its compiled programs (same tree, same graphdef); the
    base stays beside it so the next adapter merges into the original weights. ValueError naming what does
    not fit the served model.
    """
    spec, adapters = load_adapter(folder, base.config)
    merged = nnx.state(merge_adapters(nnx.merge(base.graphdef, base.state), spec, adapters))
    if base.mesh is not None:  # W + A B computed shard by shard; pinned to the base's own layout
        merged = jax.device_put(merged, param_shardings(merged, base.mesh))
    new = Weights(base.graphdef, merged, base.config, str(version), shown_path or folder,
                  adapter={"path": shown_path or folder, "rank": spec.rank, "alpha": spec.alpha,
                           "targets": list(spec.targets)}, mesh=base.mesh)
    check_compatible(base, new)
    return new


def check_compatible(old: Weights, new: Weights) -> None:
    """Raises ValueError naming the first difference that would make `new` a different model."""
    if new.config != old.config:
        diffs = [f.name for f in dataclasses.fields(old.config)
                 if getattr(old.config, f.name) != getattr(new.config, f.name)]
        raise ValueError(f"model config differs from the served model in {diffs}")
    old_leaves = jax.tree_util.tree_leaves_with_path(old.state)
    new_leaves = jax.tree_util.tree_leaves_with_path(new.state)
    if [p for p, _ in old_leaves] != [p for p, _ in new_leaves]:
        raise ValueError("parameter tree differs from the served model")
    for (keypath, a), (_, b) in zip(old_leaves, new_leaves):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"{jax.tree_util.keystr(keypath)}: shape/dtype {b.shape} {b.dtype} "
                             f"does not match the served {a.shape} {a.dtype}")
        if not bool(jnp.all(jnp.isfinite(b))):
            raise ValueError(f"{jax.tree_util.keystr(keypath)}: contains NaN or inf")


def weights_from_tensors(served: Weights, tensors: Mapping[str, np.ndarray], dtype: str, version: str,
                         path: str) -> Weights:
    """The served model with every parameter read from `tensors` (keyed by parameter path, in this package's
    layout), cast as `load_weights` casts; ValueError naming a missing or unknown tensor or a wrong shape."""
    read: set[str] = set()

    def take(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"tensors: {name} is missing")
        read.add(name)
        return tensors[name]

    model = build_model(served.config, take, dtype=DTYPES[dtype], mesh=served.mesh)
    if unknown := sorted(set(tensors) - read):
        raise ValueError(f"tensors: {unknown[0]} is not a parameter of the served model")
    _, state = nnx.split(model)
    return Weights(served.graphdef, state, served.config, str(version), path, mesh=served.mesh)


def check_newer(current: str, new: str) -> None:
    """Integer versions may not go backwards (an equal one re-pushes the same version); InvalidWeights if they do."""
    if current.isdigit() and new.isdigit() and int(new) < int(current):
        raise InvalidWeights(f"weight_version: {new} is older than the served version {current}")
