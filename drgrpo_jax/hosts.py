"""Multi-host coordination of the trainer: every process's rows, and failing on every process together.

Both are collectives: every process must reach each call, in the same order. On one process
they cost nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from drgrpo_jax.config import ConfigError

__all__ = ["fail_together", "gather_hosts"]


def gather_hosts(tree: Any) -> Any:
    """Every process's pytree of numpy arrays (same shapes everywhere), stacked on a new leading host axis.

    A collective: every process must call it. dtypes come back as they went in (the all-gather
    itself narrows 64-bit values when jax_enable_x64 is off).
    """
    import jax

    if jax.process_count() == 1:
        return jax.tree.map(lambda x: np.asarray(x)[None], tree)
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(tree, tiled=False)
    return jax.tree.map(lambda g, x: np.asarray(g).astype(np.asarray(x).dtype), gathered, tree)


def _failure_types() -> tuple[type[Exception], ...]:
    """Errors re-raised as themselves on every process (code = index + 1); anything else as a RuntimeError."""
    from drgrpo_jax.rewards import RewardError
    from drgrpo_jax.rollout import RolloutError

    return ConfigError, RewardError, RolloutError


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
    import jax

    types = _failure_types()
    code = 0 if error is None else next((i + 1 for i, t in enumerate(types) if isinstance(error, t)), len(types) + 1)
    codes = gather_hosts(np.asarray([code], np.int32))[:, 0] if jax.process_count() > 1 else np.asarray([code])
    if error is not None:
        raise error
    failed = np.flatnonzero(codes)
    if failed.size:
        first = int(failed[0])
        kind = types[codes[first] - 1] if codes[first] <= len(types) else RuntimeError
        message = f"{what} failed on process {first} (see its log)"
        raise ConfigError("process", message) if kind is ConfigError else kind(message)
