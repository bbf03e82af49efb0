"""Mesh construction, logical-axis rules and partition specs for parameters and batches."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Tensor innermost (the fastest links), context next: its all-gathers run every layer.
MESH_AXES: tuple[str, ...] = ("data", "fsdp", "context", "tensor")
MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the (data, fsdp, tensor, context) mesh axes; one may be -1 to take the remaining devices."""

    data: int = 1  # pure data parallelism (parameters replicated)
    fsdp: int = -1  # data parallelism with parameters sharded over it (ZeRO-3 style)
    tensor: int = 1  # tensor parallelism: heads, MLP and vocab split
    context: int = 1  # context parallelism: the token axis of every row split (models/context_parallel.py)

    def __post_init__(self):
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor, "context": self.context}
        for name, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or (size <= 0 and size != -1):
                raise ValueError(f"mesh.{name}: must be a positive int or -1, got {size!r}")
        if sum(size == -1 for size in sizes.values()) > 1:
            raise ValueError("mesh: at most one axis may be -1")

    def sizes(self, num_devices: int) -> tuple[int, int, int, int]:
        """The sizes of MESH_AXES, (data, fsdp, context, tensor), for num_devices devices."""
        sizes = [self.data, self.fsdp, self.context, self.tensor]
        known = int(np.prod([s for s in sizes if s != -1]))
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(f"mesh: {num_devices} devices are not divisible by the fixed axes' product {known}")
            sizes[sizes.index(-1)] = num_devices // known
        if int(np.prod(sizes)) != num_devices:
            raise ValueError(f"mesh: data*fsdp*context*tensor = {int(np.prod(sizes))} but there are {num_devices} "
                             f"devices")
        return tuple(sizes)  # type: ignore[return-value]


def make_mesh(shape: MeshShape, devices: Sequence[jax.Device] | None = None, *, dcn_data: int = 1) -> Mesh:
    """A (data, fsdp, context, tensor) mesh over the given devices (default: all), in topology order (see
    `device_grid`)."""
    devices = list(jax.devices() if devices is None else devices)
    return Mesh(device_grid(shape.sizes(len(devices)), devices, dcn_data), MESH_AXES)


def device_grid(sizes: tuple[int, ...], devices: Sequence[Any], dcn_data: int = 1) -> np.ndarray:
    """The devices as a (data, fsdp, context, tensor) array in the order the interconnect favours (`sizes` in that
    order; a 3-tuple is (data, fsdp, tensor) with context 1).

    One slice: `mesh_utils.create_device_mesh` (on TPUs the torus order, so fsdp, context and tensor neighbours are
    ICI neighbours); a subset of a slice it cannot lay out (one chip of four) keeps the devices' order.
    dcn_data > 1: `mesh_utils.create_hybrid_device_mesh`, dcn_data slices of data/dcn_data x fsdp x context x tensor
    devices, data's outer ways crossing between slices over DCN. Slices are TPU devices' slice_index (multi-slice
    pods); on CPU and GPU, where every device of a run reports slice 0, each process is a slice (a GPU host, or a
    loopback process standing in for a slice). ValueError when the slices do not number dcn_data or hold unequal
    shares.
    """
    if len(sizes) == 3:
        sizes = (sizes[0], sizes[1], 1, sizes[2])
    data, fsdp, context, tensor = sizes
    if dcn_data == 1:
        try:
            return mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError):  # no torus layout for this subset: the devices' own order
            return np.asarray(devices, dtype=object).reshape(sizes)
    if data % dcn_data:
        raise ValueError(f"mesh.dcn_data = {dcn_data} does not divide mesh.data = {data}")
    by_process = devices[0].platform != "tpu"
    granules = sorted({d.process_index if by_process else d.slice_index for d in devices})
    if len(granules) != dcn_data:
        raise ValueError(f"mesh.dcn_data = {dcn_data}, but the devices span {len(granules)} "
                         f"{'process(es)' if by_process else 'slice(s)'}")
    return mesh_utils.create_hybrid_device_mesh((data // dcn_data, fsdp, context, tensor), (dcn_data, 1, 1, 1), devices,
                                                process_is_granule=by_process, allow_split_physical_axes=True)


SERVICE_MESH_EXAMPLE = "tensor=4 or tensor=2,data=2"


def parse_service_mesh(text: str, field: str = "--mesh") -> MeshShape:
    """A generation service's mesh, 'tensor=T[,data=D]' (either order), as MeshShape(data=D, fsdp=1, tensor=T).

    "" is one device. The one parser of the service's mesh: drgrpo_jax.serve --mesh, rollout.service_mesh, the
    launchers and the plan all read it here; ValueError naming `field`.
    """
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or name not in ("tensor", "data"):
            raise ValueError(f"{field}: {part!r} is not tensor=N or data=N (e.g. {SERVICE_MESH_EXAMPLE})")
        if name in sizes:
            raise ValueError(f"{field}: {name} is given twice in {text!r}")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{field}: {name} must be a positive int, got {value!r}")
        sizes[name] = int(value)
    return MeshShape(data=sizes.get("data", 1), fsdp=1, tensor=sizes.get("tensor", 1))


def service_mesh(shape: MeshShape, field: str = "--mesh", devices: Sequence[jax.Device] | None = None) -> Mesh | None:
    """The service's (data, fsdp=1, tensor) mesh over the first data x tensor of this process's devices; None for
    one device (the sampler's unsharded programs). ValueError naming `field` when there are fewer devices."""
    wanted = shape.data * shape.tensor
    if wanted == 1:
        return None
    devices = list(jax.local_devices() if devices is None else devices)
    if wanted > len(devices):
        raise ValueError(f"{field}: data x tensor = {shape.data} x {shape.tensor} = {wanted} devices, but this "
                         f"process has {len(devices)}")
    return make_mesh(MeshShape(data=shape.data, fsdp=1, tensor=shape.tensor), devices[:wanted])


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axis (or axes, or None for replicated)."""

    batch: MeshAxes = ("data", "fsdp")  # activations' batch dimension
    vocab: MeshAxes = "tensor"  # embedding / output rows
    # Weights' model dimension, split ZeRO-3 style over the row ways and the context ways alike: a context way holds
    # a 1/context slice of the state instead of a whole copy, and gathers each layer's weights as fsdp does.
    embed: MeshAxes = ("fsdp", "context")
    q_heads: MeshAxes = "tensor"
    kv_heads: MeshAxes = "tensor"
    head_dim: MeshAxes = None
    mlp: MeshAxes = "tensor"
    # A mixture's experts (their weights' leading axis): each fsdp shard stores e / fsdp whole experts, where
    # dense weights split their model dim; no extra mesh axis, so every mesh shape and the service's mesh stand.
    # Tokens are split over fsdp too, so a program traced on the mesh (`traced_on_mesh`) sends them to their
    # experts' shards (models/moe.py's all-to-all) in place of gathering the experts.
    expert: MeshAxes = "fsdp"
    layers: MeshAxes = None  # the stacked-layer axis (scanned; never sharded)
    # Activations' token axis (models/context_parallel.py): each context shard holds an early and a late chunk of
    # every row. A checkpoint restores onto any fsdp x context split (orbax reshards on restore).
    length: MeshAxes = "context"

    def mesh_axes(self, logical: str | None) -> MeshAxes:
        """Mesh axes for one logical axis name (None stays replicated)."""
        if logical is None:
            return None
        if not hasattr(self, logical):
            raise ValueError(f"sharding rules: unknown logical axis {logical!r}")
        return getattr(self, logical)


def traced_on_mesh(fn: Callable, mesh: Mesh) -> Callable:
    """`fn` traced under `mesh` (jax's abstract-mesh context), so the code it runs can see the mesh: a mixture's
    MLP runs expert-parallel there (models/moe.py). For the bodies of programs jitted onto `mesh`."""
    @functools.wraps(fn)
    def on_mesh(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return on_mesh


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    """Mesh axes as a tuple."""
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_to_spec(logical_axes: Sequence[str | None], rules: ShardingRules = ShardingRules()) -> PartitionSpec:
    """PartitionSpec for logical axes; two logical axes on one mesh axis is an error."""
    used: dict[str, str | None] = {}
    spec = []
    for logical in logical_axes:
        axes = rules.mesh_axes(logical)
        for mesh_axis in _as_tuple(axes):
            if mesh_axis in used:
                raise ValueError(
                    f"sharding rules: logical axes {used[mesh_axis]!r} and {logical!r} both map to mesh axis "
                    f"{mesh_axis!r} in {tuple(logical_axes)}")
            used[mesh_axis] = logical
        spec.append(axes)
    return PartitionSpec(*spec)


def named_sharding(name: str, shape: Sequence[int], logical_axes: Sequence[str | None], mesh: Mesh,
                   rules: ShardingRules = ShardingRules()) -> NamedSharding:
    """NamedSharding of one array; a dimension that its mesh axes do not divide is an error naming it."""
    if len(shape) != len(logical_axes):
        raise ValueError(f"{name}: shape {tuple(shape)} has {len(shape)} dims but logical axes {logical_axes}")
    spec = logical_to_spec(logical_axes, rules)
    for dim, logical, axes in zip(shape, logical_axes, spec):
        size = int(np.prod([mesh.shape[a] for a in _as_tuple(axes)]))
        if axes is not None and dim % size:
            raise ValueError(
                f"{name}: dimension {logical!r} of size {dim} is not divisible by mesh axes {axes} (size {size})")
    return NamedSharding(mesh, spec)


def _path_name(path: tuple[Any, ...]) -> str:
    """'blocks/q_proj' from an nnx state path."""
    return "/".join(str(getattr(p, "key", p)) for p in path)


def param_shardings(params: nnx.State, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> nnx.State:
    """A params-shaped tree of NamedShardings from each Param's `logical_axes` metadata."""

    def one(path, variable):
        axes = getattr(variable, "logical_axes", None)
        shape = variable[...].shape
        if axes is None:
            return NamedSharding(mesh, PartitionSpec())
        return named_sharding(_path_name(path), shape, axes, mesh, rules)

    return jax.tree.map_with_path(
        lambda path, v: one(path, v), params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> nnx.Module:
    """The same model with every parameter placed on the mesh by its logical axes."""
    graphdef, state = nnx.split(model)
    shardings = param_shardings(state, mesh, rules)
    # The shardings tree stops at each Variable, a valid pytree prefix of the state.
    return nnx.merge(graphdef, jax.device_put(state, shardings))


def batch_sharding(mesh: Mesh, rules: ShardingRules = ShardingRules()) -> NamedSharding:
    """Sharding of a [B, ...] array: B over the rules' batch axes, the rest replicated. The spec names only B,
    so one sharding fits every field of a batch whatever its rank."""
    return NamedSharding(mesh, PartitionSpec(rules.batch))


def batch_shards(mesh: Mesh, rules: ShardingRules = ShardingRules()) -> int:
    """How many shards a batch's B dimension is split into on `mesh` (the rules' batch axes' sizes multiplied)."""
    return int(np.prod([mesh.shape[axis] for axis in _as_tuple(rules.batch)]))


def place(tree: Any, shardings: Any) -> Any:
    """Puts a tree on global shardings, in one process or many (where device_put cannot): the one way host
    values (a batch's rows, a state) reach the mesh.

    Arrays already spanning several processes (e.g. loaded straight onto the mesh) must carry
    the asked sharding and are kept; other jax arrays and host values move with device_put in one
    process; in several, host values identical on every process (every host's rows after
    `hosts.gather_hosts`) become global arrays shard by shard.
    """

    def one(x, sharding):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if not x.sharding.is_equivalent_to(sharding, x.ndim):
                raise ValueError(f"place: a multi-process array has sharding {x.sharding}, expected {sharding}")
            return x
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(one(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    # `shardings` may be a prefix of `tree` (one sharding per nnx Variable).
    return jax.tree.map(lambda sharding, sub: jax.tree.map(lambda x: one(x, sharding), sub), shardings, tree)
