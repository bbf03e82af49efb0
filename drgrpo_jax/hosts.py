"""Multi-host coordination of the trainer: starting `jax.distributed`, every process's rows, and failing on every
process together.

The last two are collectives: every process must reach each call, in the same order. On one process
they cost nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from drgrpo_jax.errors import ConfigError, HostFailure, RewardError, RolloutError

__all__ = ["AUTO", "fail_together", "failure_code", "gather_hosts", "host_array", "remote_failure", "start_distributed"]


AUTO = "auto"  # mesh.coordinator_address: JAX detects the cluster


def start_distributed(address: str | None, num_processes: int = 1, process_id: int = 0,
                      port: int | None = None) -> None:
    """jax.distributed.initialize, before any device is touched; nothing when `address` is None (one host).

    "auto": no arguments, JAX detects the cluster (TPU VM pods and multi-slice, GKE JobSet or indexed Job,
    SLURM, Open MPI); `port` overrides the coordinator port it picks (JAX reads JAX_COORDINATOR_PORT). "host:port"
    with the count and id: detection is off. Either way the process takes every device of its host
    (`local_device_ids=[]`): JAX's SLURM and Open MPI detection would otherwise pin a process to the one GPU of
    its local rank, while a scheduler that binds GPUs per task already narrows CUDA_VISIBLE_DEVICES itself.
    ConfigError naming mesh.coordinator_address when "auto" finds no cluster.
    """
    if address is None:
        return
    if address != AUTO:
        jax.distributed.initialize(address, num_processes=num_processes, process_id=process_id,
                                   local_device_ids=[], cluster_detection_method="deactivate")
        return
    if port is not None:
        os.environ["JAX_COORDINATOR_PORT"] = str(port)
    try:
        jax.distributed.initialize(local_device_ids=[])
    except ValueError as error:  # what detection left unset ("coordinator_address should be defined.")
        raise ConfigError("mesh.coordinator_address", f"auto, but no cluster was detected ({error}): run under a TPU "
                          "VM pod, GKE JobSet or indexed Job, SLURM (srun) or Open MPI (mpirun), or give host:port "
                          "with mesh.num_processes and mesh.process_id") from None


def gather_hosts(tree: Any) -> Any:
    """Every process's pytree of numpy arrays (same shapes everywhere), stacked on a new leading host axis.

    A collective: every process must call it. dtypes come back as they went in (the all-gather
    itself narrows 64-bit values when jax_enable_x64 is off).
    """
    if jax.process_count() == 1:
        return jax.tree.map(lambda x: np.asarray(x)[None], tree)
    gathered = multihost_utils.process_allgather(tree, tiled=False)
    return jax.tree.map(lambda g, x: np.asarray(g).astype(np.asarray(x).dtype), gathered, tree)


# The types a failure is reported as to the other processes (code = index + 1; anything else is
# len + 1). RewardError and RolloutError are raised there as themselves, so `except RolloutError`
# behaves alike on every process; a ConfigError is not re-raised as one (no key of the other
# process's config is wrong): it and anything else become a HostFailure naming the type.
_CODED: tuple[type[Exception], ...] = (RewardError, RolloutError, ConfigError)
_SAME_TYPE: tuple[type[Exception], ...] = (RewardError, RolloutError)


def failure_code(error: Exception | None) -> int:
    """0 = no error; i + 1 = an error of _CODED[i]; len(_CODED) + 1 = anything else."""
    if error is None:
        return 0
    return next((i + 1 for i, kind in enumerate(_CODED) if isinstance(error, kind)), len(_CODED) + 1)


def remote_failure(codes: np.ndarray, what: str) -> Exception | None:
    """The error to raise for the first process whose failure code is nonzero; None when none failed."""
    failed = np.flatnonzero(codes)
    if not failed.size:
        return None
    first, code = int(failed[0]), int(codes[failed[0]])
    kind = _CODED[code - 1] if code <= len(_CODED) else Exception
    if kind in _SAME_TYPE:
        return kind(f"{what} failed on process {first} (see its log)")
    return HostFailure(what, first, kind.__name__)


@contextlib.contextmanager
def fail_together(what: str) -> Iterator[None]:
    """Runs the block; if it raised on any process, raises on every one (`what` names the work).

    The block's error is held until a small all-gather of failure codes, so no process waits
    forever in a later collective for one that died; also a barrier: no process leaves before
    every process has finished the block.
    """
    error = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised by _all_hosts_ok, on every process together
        error = e
    _all_hosts_ok(error, what)


def _all_hosts_ok(error: Exception | None, what: str) -> None:
    """Raises on every process when `error` happened on any: a small all-gather first, so none waits forever.

    Also a barrier: no process passes it before every process has reached it.
    """
    code = failure_code(error)
    codes = gather_hosts(np.asarray([code], np.int32))[:, 0] if jax.process_count() > 1 else np.asarray([code])
    if error is not None:
        raise error
    failure = remote_failure(codes, what)
    if failure is not None:
        raise failure


def host_array(x: Any) -> np.ndarray:
    """A whole array as numpy on this host (gathered across processes when it spans several)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
