"""The weight push: each new policy version exported and sent to every generation service.

`WeightPublisher` writes version v as an HF folder under run_dir/weights/v{v} (a PEFT adapter folder with
LoRA), mirrored to run.weights_dir when set; `publish_weights` has the services load it through
`/update_weights_from_disk`. The trainer's own child service can instead take each version from a
shared-memory segment (`SegmentPusher`, `drgrpo_jax.named_tensors`) through `/update_weights_from_tensor`:
`sync_mode` picks shared memory unless a push must be a folder (a LoRA adapter push, a mirrored run,
services at rollout.urls). Either way the service ends with the same bits.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import jax
import numpy as np
from flax import nnx

from drgrpo_jax import named_tensors
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.hosts import fail_together, host_array
from drgrpo_jax.models.hf_io import save_pretrained
from drgrpo_jax.models.lora import adapter_arrays, merged_model, save_adapter
from drgrpo_jax.weight_folders import copy_folder, is_remote, remove_folder, versions_in

if TYPE_CHECKING:

    from drgrpo_jax.config.schema import Config
    from drgrpo_jax.rollout.client import RolloutClient

__all__ = ["SegmentPusher", "WeightPublisher", "check_room", "host_tensors", "publish_weights", "sync_mode"]


def sync_mode(config: Config, *, local_child: bool) -> Literal["shm", "disk"]:
    """How this run's pushes travel: shm for its own child service when nothing needs a folder, else disk."""
    r, lora = config.rollout, config.model.lora
    needs_folder = (lora.rank > 0 and lora.push == "adapter") or bool(config.run.weights_dir)
    if r.weight_sync == "disk" or not local_child or needs_folder:
        return "disk"  # the config refuses weight_sync=shm in those cases, naming why
    if not named_tensors.available():
        if r.weight_sync == "shm":
            raise ConfigError("rollout.weight_sync", f"shm needs a writable {named_tensors.SEGMENT_DIR} "
                                                     "(Linux); use auto or disk")
        return "disk"
    return "shm"


def check_room(config: Config, mode: Literal["shm", "disk"], params: nnx.State, frozen: nnx.State | None = None
               ) -> Literal["shm", "disk"]:
    """`mode`, or disk when shared memory cannot hold two versions of the pushed model (the loaded one and the
    next) under auto; a ConfigError under rollout.weight_sync=shm."""
    if mode == "disk":
        return mode
    pushed = frozen if frozen is not None else params  # a merged LoRA push is the size of the base
    needed, free = 2 * sum(leaf.nbytes for leaf in jax.tree.leaves(pushed)), named_tensors.free_bytes()
    if needed <= free:
        return mode
    why = f"{named_tensors.SEGMENT_DIR} has {free / 2**20:.0f} MiB free, two versions need {needed / 2**20:.0f} MiB"
    if config.rollout.weight_sync == "shm":
        raise ConfigError("rollout.weight_sync", f"shm: {why} (enlarge it, e.g. docker --shm-size, or use disk)")
    print(f"rollout.weight_sync=auto: pushing through disk, {why}", file=sys.stderr, flush=True)
    return "disk"


def host_tensors(graphdef: nnx.GraphDef, params: nnx.State, frozen: nnx.State | None = None
                 ) -> dict[str, np.ndarray]:
    """Every parameter as a host array under its path ("layers/q_proj"); given `frozen` (LoRA with
    model.lora.push=merged), the base with the adapters merged in, as `WeightPublisher.export_merged` writes it."""
    if frozen is not None:
        host_params, host_frozen = jax.tree.map(host_array, (params, frozen))
        params = nnx.state(merged_model(nnx.merge(graphdef, host_params, host_frozen)), nnx.Param)
    return {"/".join(str(p) for p in path): host_array(variable[...]) for path, variable in nnx.to_flat_state(params)}


class SegmentPusher:
    """Pushes whole-model versions to the trainer's own child service through shared memory, each a new segment
    in a private folder of this pusher's (`named_tensors.make_folder`), made at the first push. A segment is removed
    once the child has loaded the next: by then the child holds copies of its arrays (or maps its pages, which
    outlive the removal), so a batch still sampling the older version (--inflight-updates) reads no removed file."""
    def __init__(self, graphdef: nnx.GraphDef, *, merged_lora: bool = False):
        self.graphdef, self.merged_lora = graphdef, merged_lora
        self._current: str | None = None  # the segment the child loaded last (kept for a restarted child)
        self._folder: str | None = None
        named_tensors.remove_orphans()
        atexit.register(self.close)

    def push(self, client: RolloutClient, params: nnx.State, version: int, *, rollback: bool = False,
             frozen: nnx.State | None = None) -> str:
        """Writes version `version` to a new segment and has the child load it; returns "shm:<segment>".

        On any failure (the child refuses, dies for good, an interrupt) the new segment is deleted and the
        error raised; the previous one stays until the next push or `close`.
        """
        tensors = host_tensors(self.graphdef, params, frozen if self.merged_lora else None)
        if self._folder is None:
            self._folder = named_tensors.make_folder()
        name = named_tensors.segment_name(self._folder, version)  # a fresh name per push, even of one version
        try:
            entries = named_tensors.write_segment(name, tensors)
            del tensors
            client.update_weights_from_segment(name, [e.to_json() for e in entries], version, rollback=rollback)
        except BaseException:
            named_tensors.remove_segment(name)
            raise
        previous, self._current = self._current, name
        if previous is not None:
            named_tensors.remove_segment(previous)
        return f"shm:{name}"

    def close(self) -> None:
        """Deletes the last segment and the folder (idempotent; also run at interpreter exit)."""
        folder, self._folder, self._current = self._folder, None, None
        if folder is not None:
            named_tensors.remove_folder(folder)
        atexit.unregister(self.close)

    def __enter__(self) -> SegmentPusher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class WeightPublisher:
    """Exports params to root/v{version} (process 0 writes; every process joins the gather).

    With `mirror` (run.weights_dir: a folder every service reads, or gs://bucket/path) each version
    is also copied to mirror/v{version}, which is then the path the services are told to load.
    With `lora` (the adapters' LoraSpec), params are LoRA adapters
    and each version is a PEFT adapter folder naming `base_model`, a few MB instead of the whole model.
    """
    def __init__(self, root: str, graphdef: Any, keep: int = 2, mirror: str | None = None, *,
                 lora: Any = None, base_model: str = "", push_merged: bool = False):
        self.root, self.graphdef, self.keep = os.path.abspath(root), graphdef, keep
        self.mirror = mirror if mirror is None or is_remote(mirror) else os.path.abspath(mirror)
        self.lora, self.base_model, self.push_merged = lora, base_model, push_merged

    def export(self, params: Any, path: str, tokenizer: Any = None) -> str:
        """Writes `params` as an HF folder (a PEFT adapter folder with LoRA) at `path` atomically."""
        host_params = jax.tree.map(host_array, params)  # a collective in multi-host runs
        if jax.process_index() == 0:
            with _atomic_folder(path) as tmp:
                if self.lora is None:
                    save_pretrained(nnx.merge(self.graphdef, host_params), tmp, tokenizer=tokenizer)
                else:
                    save_adapter(adapter_arrays(host_params), self.lora, tmp, base_model=self.base_model)
                    if tokenizer is not None:
                        tokenizer.save_pretrained(tmp)
        return path

    def export_merged(self, params: Any, frozen: Any, path: str, tokenizer: Any = None) -> str:
        """Writes the base with the LoRA adapters merged in as an HF folder at `path` atomically."""
        host_params, host_frozen = jax.tree.map(host_array, (params, frozen))
        if jax.process_index() == 0:
            with _atomic_folder(path) as tmp:
                save_pretrained(merged_model(nnx.merge(self.graphdef, host_params, host_frozen)), tmp,
                                tokenizer=tokenizer)
        return path

    def local_path(self, version: int) -> str:
        """The trainer's own copy of version `version`."""
        return os.path.join(self.root, f"v{version}")

    def publish(self, params: Any, version: int, frozen: Any = None) -> str:
        """Exports version `version` (and mirrors it), keeps the newest `keep`; returns the path services load.

        With LoRA and `push_merged`, the version is the merged model (`frozen`: the base), not the adapter.
        """
        if self.lora is not None and self.push_merged:
            path = self.export_merged(params, frozen, self.local_path(version))
        else:
            path = self.export(params, self.local_path(version))
        if jax.process_index() != 0:
            return path if self.mirror is None else f"{self.mirror.rstrip('/')}/v{version}"
        _prune(self.root, version, self.keep)
        if self.mirror is None:
            return path
        target = f"{self.mirror.rstrip('/')}/v{version}"
        remove_folder(target)  # a partial copy left by a run that died mid-copy
        copy_folder(path, target)
        _prune(self.mirror, version, self.keep)
        return target


@contextlib.contextmanager
def _atomic_folder(path: str) -> Iterator[str]:
    """A new temporary folder that replaces `path` once the block has written it (a crash leaves `path` as it was).
    A link at either name is removed, never written through."""
    tmp = path + ".tmp"
    _remove_entry(tmp)  # a crash's leftover
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    os.mkdir(tmp)  # created new: whatever appears there after the removal fails the export, not receives it
    yield tmp
    _remove_entry(path)
    os.replace(tmp, path)


def _remove_entry(path: str) -> None:
    """Deletes the folder at `path`, or the link or file there (rmtree refuses a link and would leave it)."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _prune(root: str, version: int, keep: int) -> None:
    """Deletes all but the newest `keep` versions up to `version`, and every version above it."""
    versions = versions_in(root)
    older = [v for v in versions if v < version]
    # Versions above this one were written by a run that died after its last checkpoint: stale.
    for stale in older[:max(len(older) - keep + 1, 0)] + [v for v in versions if v > version]:
        remove_folder(f"{root.rstrip('/')}/v{stale}")


def publish_weights(publisher: WeightPublisher, client: RolloutClient | None, params: nnx.State, version: int,
                    *, rollback: bool = False, frozen: nnx.State | None = None,
                    pusher: SegmentPusher | None = None) -> str:
    """Exports version `version` (process 0 writes) and, given a client, pushes it to every URL (process 0);
    given a `pusher` (the trainer's own child service, rollout.weight_sync), through shared memory instead.

    With LoRA, `params` are the adapters and `frozen` the base (needed when model.lora.push is merged).

    `rollback`: the services may hold a newer version (a resumed run's first push) and go back to this one.

    Every process waits for it and raises with it if it fails anywhere, so no host samples before the
    services hold the new weights.
    """
    with fail_together(f"publishing weight version {version}"):
        if pusher is not None and client is not None:  # one process: no disk round trip
            return pusher.push(client, params, version, rollback=rollback, frozen=frozen)
        path = publisher.publish(params, version, frozen)  # every process joins its gather
        if client is not None and jax.process_index() == 0:
            client.update_weights(path, version, rollback=rollback)
    return path
