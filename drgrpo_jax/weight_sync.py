"""Weight pushes without a disk round trip (rollout.weight_sync): the trainer's own child service takes each
version from a shared-memory segment (`tensor_segment`) through `/update_weights_from_tensor`.

`sync_mode` picks the path: the child service gets shared memory (auto or shm) unless a push must be a
folder: LoRA adapter pushes (model.lora.push=adapter: a PEFT folder of a few MB, merged by the service) and
runs that mirror every version (run.weights_dir); services at rollout.urls always load from disk (their own
machines), through `/update_weights_from_disk` as before. A segment holds every parameter under its path in
this package's layout and dtype, exactly the arrays the disk path writes, so the service ends with the same
bits either way. The last segment stays until the next push replaces it (a child that dies is restarted on
its first weights and reloads it), and is deleted when the run ends; segments of a trainer that was killed
are deleted by the next one (`tensor_segment.remove_orphans`).
"""

from __future__ import annotations

import atexit
import itertools
import sys
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from drgrpo_jax import tensor_segment
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.outputs import host_array

if TYPE_CHECKING:
    from flax import nnx

    from drgrpo_jax.config import Config
    from drgrpo_jax.rollout import RolloutClient

__all__ = ["SegmentPusher", "check_room", "host_tensors", "sync_mode"]


def sync_mode(config: Config, *, local_child: bool) -> Literal["shm", "disk"]:
    """How this run's pushes travel: shm for its own child service when nothing needs a folder, else disk."""
    r, lora = config.rollout, config.model.lora
    needs_folder = (lora.rank > 0 and lora.push == "adapter") or bool(config.run.weights_dir)
    if r.weight_sync == "disk" or not local_child or needs_folder:
        return "disk"  # the config refuses weight_sync=shm in those cases, naming why
    if not tensor_segment.available():
        if r.weight_sync == "shm":
            raise ConfigError("rollout.weight_sync", f"shm needs a writable {tensor_segment.SEGMENT_DIR} "
                                                     "(Linux); use auto or disk")
        return "disk"
    return "shm"


def check_room(config: Config, mode: Literal["shm", "disk"], params: nnx.State, frozen: nnx.State | None = None
               ) -> Literal["shm", "disk"]:
    """`mode`, or disk when shared memory cannot hold two versions of the pushed model (the loaded one and the
    next) under auto; a ConfigError under rollout.weight_sync=shm."""
    import jax

    if mode == "disk":
        return mode
    pushed = frozen if frozen is not None else params  # a merged LoRA push is the size of the base
    needed, free = 2 * sum(leaf.nbytes for leaf in jax.tree.leaves(pushed)), tensor_segment.free_bytes()
    if needed <= free:
        return mode
    why = f"{tensor_segment.SEGMENT_DIR} has {free / 2**20:.0f} MiB free, two versions need {needed / 2**20:.0f} MiB"
    if config.rollout.weight_sync == "shm":
        raise ConfigError("rollout.weight_sync", f"shm: {why} (enlarge it, e.g. docker --shm-size, or use disk)")
    print(f"rollout.weight_sync=auto: pushing through disk, {why}", file=sys.stderr, flush=True)
    return "disk"


def host_tensors(graphdef: nnx.GraphDef, params: nnx.State, frozen: nnx.State | None = None
                 ) -> dict[str, np.ndarray]:
    """Every parameter as a host array under its path ("layers/q_proj"); given `frozen` (LoRA with
    model.lora.push=merged), the base with the adapters merged in, as `WeightPublisher.export_merged` writes it."""
    from flax import nnx

    if frozen is not None:
        import jax

        from drgrpo_jax.models.lora import merged_model

        host_params, host_frozen = jax.tree.map(host_array, (params, frozen))
        params = nnx.state(merged_model(nnx.merge(graphdef, host_params, host_frozen)), nnx.Param)
    return {"/".join(str(p) for p in path): host_array(variable[...]) for path, variable in nnx.to_flat_state(params)}


class SegmentPusher:
    """Pushes whole-model versions to the trainer's own child service through shared memory."""

    def __init__(self, graphdef: nnx.GraphDef, *, merged_lora: bool = False):
        self.graphdef, self.merged_lora = graphdef, merged_lora
        self._current: str | None = None  # the segment the child loaded last (kept for a restarted child)
        self._count = itertools.count()  # a fresh name per push, even when a version is pushed again
        tensor_segment.remove_orphans()
        atexit.register(self.close)

    def push(self, client: RolloutClient, params: nnx.State, version: int, *, rollback: bool = False,
             frozen: nnx.State | None = None) -> str:
        """Writes version `version` to a new segment and has the child load it; returns "shm:<segment>".

        On any failure (the child refuses, dies for good, an interrupt) the new segment is deleted and the
        error raised; the previous one stays until the next push or `close`.
        """
        tensors = host_tensors(self.graphdef, params, frozen if self.merged_lora else None)
        name = tensor_segment.segment_name(f"{version}.{next(self._count)}")
        try:
            entries = tensor_segment.write_segment(name, tensors)
            del tensors
            client.update_weights_from_segment(name, [e.to_json() for e in entries], version, rollback=rollback)
        except BaseException:
            tensor_segment.remove_segment(name)
            raise
        previous, self._current = self._current, name
        if previous is not None:
            tensor_segment.remove_segment(previous)
        return f"shm:{name}"

    def close(self) -> None:
        """Deletes the last segment (idempotent; also run at interpreter exit)."""
        current, self._current = self._current, None
        if current is not None:
            tensor_segment.remove_segment(current)
        atexit.unregister(self.close)

    def __enter__(self) -> SegmentPusher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
