"""Orbax checkpoints of the whole train state plus a small JSON of host state (data position, weight version).

Each save is atomic: orbax writes into a temporary folder and renames it when complete, so a
crash mid-save leaves the previous checkpoint as the latest loadable one (tested by SIGKILL).
Arrays are stored uncompressed: orbax's zstd held a compressed copy of the whole state in memory until the
write, which set the trainer's peak memory, and float weights barely compress. Checkpoints written compressed by
earlier versions restore as before.

Each array's checksum is saved with it (the `checksums` JSON item of the same atomic step folder) and checked after
a restore, before training resumes: a mismatch is a damaged checkpoint, as a truncated file is (`restore_latest`
falls back to the previous one). A `state` array's checksum is computed where the array lives, by the devices that
hold it: a sum of per-element hashes, reduced across shards, so it is the same for any sharding and on every
process of a multi-host run, with no gather to one host; process 0 writes the JSON. The `rounds` tree (numpy, on the
host) is hashed with BLAKE2b. The checksums find corruption (a flipped block, a wrong file), not an attacker who can
also rewrite the JSON. Checkpoints written before checksums existed restore unchecked, which is said once.

A restore that fails leaves nothing running behind it: orbax runs each restore on an event loop of its own and
closes it as soon as one read fails, with the other reads of the checkpoint still in flight; each would later
complete into the closed loop ("RuntimeError: Event loop is closed", printed as an ignored exception). While
`restore` runs, a loop made in its thread lets the tasks still pending finish before it closes
(`_loops_that_finish_their_tasks`).

The folder may be a bucket (`gs://bucket/run/checkpoints`): orbax writes it through tensorstore and etils.epath
(`pip install -e '.[gcs]'`), and a save there is made atomic by a commit marker instead of a rename.

Preemption: `preempted(step)` asks orbax's preemption sync point (JAX's, once `jax.distributed` is up: XLA takes
SIGTERM then and every process learns of it at the same step), or, in a one-process run, whether SIGTERM came
(the Checkpointer's own handler only sets a flag). A preempted step is due for a save; the trainer then exits
with RESTART_EXIT_CODE, which the launchers treat as "restart".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from drgrpo_jax.errors import ConfigError, CorruptCheckpoint
from drgrpo_jax.weight_folders import absolute, as_epath

__all__ = ["RESTART_EXIT_CODE", "Checkpointer", "Restored", "abstract_state_like", "device_checksums",
           "host_checksums"]

log = logging.getLogger(__name__)

RESTART_EXIT_CODE = 42  # a preempted run saved and stopped: relaunch it (xpk and the JobSets restart on 42)
CHECKSUMS = "checksums"  # the JSON item beside `state` and `host`: {item: {array name: "dtype checksum"}}
LANE_SEEDS = (0x243F6A88, 0x85A308D3)  # two independent 32-bit sums make a 64-bit checksum


@dataclasses.dataclass(frozen=True)
class Restored:
    """A checkpoint read back."""

    step: int
    state: Any  # the train-state pytree, as the abstract state asked (dtypes, shardings)
    host: dict[str, Any]  # JSON host state saved beside it
    rounds: Any = None  # the numpy tree saved as `rounds` (rollout.inflight_updates: the queued rounds), if asked


def abstract_state_like(state: Any, shardings: Any = None) -> Any:
    """ShapeDtypeStructs for `state` (arrays or ShapeDtypeStructs) with the given or current shardings.

    `shardings` is a pytree matching `state`, one Sharding for every leaf, or None (keep each
    leaf's own sharding; a leaf without one goes to the first local device).
    """
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        one = shardings
        shardings = jax.tree.map(lambda leaf: one, state)
    elif shardings is None:
        shardings = jax.tree.map(lambda leaf: getattr(leaf, "sharding", None) or default, state)
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding), state, shardings
    )


def _mix(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: each input bit flips about half of the output's."""
    x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
    x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _words(array: jax.Array) -> jax.Array:
    """The array's bits as uint32 words (a 64-bit item: two words on a new last axis)."""
    if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
        array = jax.random.key_data(array)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}.get(array.dtype.itemsize)
    if array.dtype == jnp.bool_ or unsigned is None:  # bool, and sub-byte integers: their values are their bits
        return array.astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(array, unsigned).astype(jnp.uint32)


def _row_major_index(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major position (mod 2**32), built an axis at a time: a sharded array is never reshaped."""
    index, stride = jnp.zeros(shape, jnp.uint32), 1
    for axis in reversed(range(len(shape))):
        index += jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def _checksum(array: jax.Array) -> jax.Array:
    """uint32[2]: per lane, the wrapping sum of a hash of each word with its position (any order of shards sums to
    the same value); one changed word changes it but with probability 2**-64."""
    words = _words(array)
    index = _row_major_index(words.shape)
    return jnp.stack([jnp.sum(_mix(words ^ _mix(index ^ jnp.uint32(seed))), dtype=jnp.uint32)
                      for seed in LANE_SEEDS])


_checksums = jax.jit(lambda arrays: [_checksum(array) for array in arrays])


def _array_name(path: tuple[Any, ...]) -> str:
    """'params/embed_VD': the same whether orbax reads a container back as a list or a tuple, a dict or a dataclass."""
    return "/".join(str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))) for key in path)


def device_checksums(tree: Any) -> dict[str, str]:
    """Each array's "dtype checksum" by name, computed by the devices that hold it (one program per set of
    devices): the same for any sharding, and on every process, as the reduction leaves the sum on all."""
    named = [(_array_name(path), jnp.asarray(leaf)) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]
    by_devices: dict[frozenset, list[int]] = {}
    for i, (_, array) in enumerate(named):
        by_devices.setdefault(frozenset(array.sharding.device_set), []).append(i)
    sums: dict[int, np.ndarray] = {}
    for indices in by_devices.values():
        sums.update(zip(indices, jax.device_get(_checksums([named[i][1] for i in indices])), strict=True))
    return {name: f"{array.dtype} {int(sums[i][0]):08x}{int(sums[i][1]):08x}" for i, (name, array) in enumerate(named)}


def host_checksums(tree: Any) -> dict[str, str]:
    """Each numpy array's "dtype checksum" by name: BLAKE2b of its bytes (the `rounds` tree, kept on the host)."""
    return {_array_name(path): f"{np.asarray(leaf).dtype} "
                               f"{hashlib.blake2b(np.ascontiguousarray(leaf).tobytes(), digest_size=8).hexdigest()}"
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


CHECKSUM_OF = {"state": device_checksums, "rounds": host_checksums}  # each saved tree's checksum


def verify(item: str, tree: Any, saved: dict[str, str]) -> None:
    """CorruptCheckpoint naming the first array of `tree` whose checksum differs from `saved`'s (an array read back
    as another dtype than it was saved in is not compared)."""
    for name, value in CHECKSUM_OF[item](tree).items():
        expected = saved.get(name)
        if expected is not None and expected.split()[0] == value.split()[0] and expected != value:
            raise CorruptCheckpoint(f"{item} array {name} differs from the checksum saved with it")


class _LoopThatFinishesItsTasks(asyncio.SelectorEventLoop):
    """An event loop that, when closed, first lets the tasks still pending finish. Each awaits a tensorstore read,
    whose completion is posted to the loop from tensorstore's thread (`call_soon_threadsafe`) even when the task
    was cancelled, so cancelling them (as asyncio.run does) still left a late callback for a closed loop."""

    def close(self) -> None:
        while (pending := asyncio.all_tasks(self)) and not self.is_running() and not self.is_closed():
            self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()


class _FinishingLoopsInOneThread(asyncio.AbstractEventLoopPolicy):
    """The policy in force, except that a loop made in `thread` is a _LoopThatFinishesItsTasks (other threads,
    such as a running service's, are left as they were)."""

    def __init__(self, previous: asyncio.AbstractEventLoopPolicy, thread: int):
        self._previous, self._thread = previous, thread

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        if threading.get_ident() == self._thread:
            return _LoopThatFinishesItsTasks()
        return self._previous.new_event_loop()

    def get_event_loop(self) -> asyncio.AbstractEventLoop:
        return self._previous.get_event_loop()

    def set_event_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._previous.set_event_loop(loop)

    def get_child_watcher(self) -> Any:  # Python < 3.14: asyncio's subprocesses in another thread ask for it
        return self._previous.get_child_watcher()  # type: ignore[attr-defined,unused-ignore]

    def set_child_watcher(self, watcher: Any) -> None:
        self._previous.set_child_watcher(watcher)  # type: ignore[attr-defined,unused-ignore]


@contextlib.contextmanager
def _loops_that_finish_their_tasks() -> Iterator[None]:
    """While inside, an event loop made in this thread (orbax's `run_sync` makes one per restore) lets its pending
    tasks finish before it closes. An event loop policy is asyncio's one hook on the loops another library makes
    (deprecated from Python 3.14, still honoured by `asyncio.new_event_loop` there)."""
    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_FinishingLoopsInOneThread(previous, threading.get_ident()))
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(previous)


class Checkpointer:
    """Saves every `save_every` steps (and when forced), keeps the newest `keep`, restores exactly."""

    def __init__(self, directory: str | os.PathLike[str], *, save_every: int, keep: int, async_save: bool = False,
                 catch_sigterm: bool = False):
        """catch_sigterm (the trainer; from the main thread): in a one-process run SIGTERM only marks the next
        step preempted (`preempted`), until `close`."""
        self.directory = absolute(directory)
        self.save_every = save_every
        # The cadence is ours (step % save_every): orbax's own interval also saves the first step.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            cleanup_tmp_directories=True,  # remove what a crashed save left behind
            enable_async_checkpointing=async_save,
        )
        handlers = {"state": ocp.PyTreeCheckpointHandler(use_compression=False), "host": ocp.JsonCheckpointHandler(),
                    "rounds": ocp.PyTreeCheckpointHandler(use_compression=False),
                    CHECKSUMS: ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self._preempted: dict[int, bool] = {}  # each step's answer: the sync point is asked once per step
        self._said_unchecked = False  # a checkpoint without checksums is named once
        self._sigterm = threading.Event()
        self._handling_sigterm = catch_sigterm and not jax.distributed.is_initialized()  # else XLA's notifier has it
        if self._handling_sigterm:
            self._previous_handler = signal.signal(signal.SIGTERM, lambda signum, frame: self._sigterm.set())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step; None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of every complete checkpoint kept, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_host_state(self) -> dict[str, Any] | None:
        """The newest checkpoint's host JSON alone (read before anything is built to restore its arrays into)."""
        step = self.latest_step()
        if step is None:
            return None
        return dict(self._manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))["host"])

    def should_resume(self, resume: bool | None) -> bool:
        """train.resume: null resumes when a checkpoint exists; true requires one; false refuses to overwrite."""
        latest = self.latest_step()
        if resume is None:
            return latest is not None
        if resume and latest is None:
            raise ConfigError("train.resume", f"true, but {self.directory} holds no checkpoint")
        if not resume and latest is not None:
            raise ConfigError(
                "train.resume",
                f"false, but {self.directory} holds checkpoints up to step {latest}; "
                "resume, or choose another run.output_dir",
            )
        return bool(resume)

    def preempted(self, step: int) -> bool:
        """Whether the run saves `step` and stops: orbax's preemption sync point (the same step on every process)
        or SIGTERM in a one-process run. Every process must ask at every step, in order (`due` asks)."""
        if step not in self._preempted:
            self._preempted[step] = self._manager.reached_preemption(step) or self._sigterm.is_set()
        return self._preempted[step]

    def due(self, step: int, *, force: bool = False) -> bool:
        """Whether `save(step, ..., force=force)` would save: on the cadence, forced or preempted, and not saved yet."""
        wanted = self.preempted(step) or force or step % self.save_every == 0  # asks the sync point every step
        return wanted and step not in self._manager.all_steps()

    def save(self, step: int, state: Any, host: dict[str, Any], *, force: bool = False, rounds: Any = None) -> bool:
        """Saves when `step` is due (save_every, `force` for the last step, or preemption); True when it saved.
        `rounds`: a tree of numpy arrays saved beside the state in the same atomic step folder (the queued rounds of
        rollout.inflight_updates)."""
        if not self.due(step, force=force):
            return False  # off the cadence, or the end of a run that just saved this step
        # force: `due` made orbax's decision already (its preemption check included); its own interval would
        # also save the first step.
        trees = {"state": state, **({} if rounds is None else {"rounds": rounds})}
        checksums = {item: CHECKSUM_OF[item](tree) for item, tree in trees.items()}
        return self._manager.save(
            step,
            args=ocp.args.Composite(host=ocp.args.JsonSave(dict(host)), **{CHECKSUMS: ocp.args.JsonSave(checksums)},
                                    **{item: ocp.args.PyTreeSave(tree) for item, tree in trees.items()}),
            force=True,
        )

    def restore(self, step: int, abstract_state: Any, shardings: Any = None, *, rounds: bool = False) -> Restored:
        """Checkpoint `step` with the structure, dtypes and shardings of `abstract_state` (or `shardings`); `rounds`:
        also its `rounds` tree, as saved (numpy arrays). CorruptCheckpoint when an array differs from its checksum."""
        target = abstract_state_like(abstract_state, shardings)
        state_args = ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
        extra = {"rounds": ocp.args.PyTreeRestore()} if rounds else {}
        checked = self._has_checksums(step)
        if checked:
            extra[CHECKSUMS] = ocp.args.JsonRestore()
        with _loops_that_finish_their_tasks():  # a failed read leaves no other read pending on a closed loop
            restored = self._manager.restore(step, args=ocp.args.Composite(state=state_args,
                                                                           host=ocp.args.JsonRestore(), **extra))
        for item in (("state", "rounds") if rounds else ("state",)) if checked else ():
            verify(item, restored[item], restored[CHECKSUMS].get(item, {}))
        return Restored(step, restored["state"], dict(restored["host"]), restored["rounds"] if rounds else None)

    def _has_checksums(self, step: int) -> bool:
        """Whether checkpoint `step` holds its arrays' checksums (written before they existed: said once)."""
        if (as_epath(self.directory) / str(step) / CHECKSUMS).exists():
            return True
        if not self._said_unchecked:
            log.warning("checkpoint step %d in %s has no checksums (written before drgrpo_jax saved them): its "
                        "arrays are restored unchecked", step, self.directory)
            self._said_unchecked = True
        return False

    def restore_latest(self, abstract_state: Any, shardings: Any = None, *, rounds: bool = False) -> Restored | None:
        """The newest checkpoint that reads back whole (see `restore`); None when there is none.

        A damaged one (a truncated file, a corrupt array: anything its restore raises) is named in one warning
        line, set aside as `<step>.damaged` so the run can save that step again, and the next older one is
        tried; when every checkpoint is damaged the newest one's error is raised.
        """
        steps = self.all_steps()
        first_error: Exception | None = None
        for step in reversed(steps):
            try:
                return self.restore(step, abstract_state, shardings, rounds=rounds)
            except Exception as error:  # noqa: BLE001 - whatever a damaged checkpoint raises, an older one may do
                first_error = first_error or error
                older = [s for s in steps if s < step]
                reason = " ".join(f"{type(error).__name__}: {error}".split())[:300]
                log.warning("checkpoint step %d in %s is damaged (%s); %s", step, self.directory, reason,
                            f"resuming from step {older[-1]}" if older else "no older checkpoint to resume from")
                self._set_aside(step)
        if first_error is not None:
            raise first_error
        return None

    def _set_aside(self, step: int) -> None:
        """Renames a damaged step's folder out of orbax's sight (kept for a post-mortem; process 0 only)."""
        if jax.process_index() == 0:
            folder = as_epath(self.directory) / str(step)
            target, n = folder.with_name(f"{step}.damaged"), 1
            while target.exists():
                target, n = folder.with_name(f"{step}.damaged{n}"), n + 1
            if folder.is_dir():
                folder.rename(target)
        self._manager.reload()

    def wait(self) -> None:
        """Blocks until an async save is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finishes pending saves, releases the manager and gives SIGTERM back to its previous handler."""
        self._manager.wait_until_finished()
        self._manager.close()
        if self._handling_sigterm:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._handling_sigterm = False

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
