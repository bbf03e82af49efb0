"""The reward worker pool: every reward call runs in a worker process with a hard time limit.

math-verify times itself out with `signal.alarm`, which only works in a process's main thread,
and user functions may hang or crash: every call therefore runs in a worker process; a call
past `reward.timeout_s` gets its worker killed and replaced, scores 0 and is counted, as is
a call that raises or kills its worker. A NaN or infinite reward stops the run (RewardError).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import importlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from drgrpo_jax.config.derived import component_names
from drgrpo_jax.config.schema import RewardConfig
from drgrpo_jax.data.examples import Example
from drgrpo_jax.errors import RewardError
from drgrpo_jax.rewards.functions import (
    LENGTH_REWARDS,
    PRELOAD_MODULES,
    RewardResult,
    build_reward_fns,
    overlong_penalty,
)

__all__ = ["RewardScorer"]


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def _checked(value: Any) -> tuple[str, Any]:
    """One call's answer as sent back: ("ok", float or {key: float}) or ("bad", (key or None, what it was))."""
    if _is_number(value):
        return "ok", float(value)
    if isinstance(value, dict):
        for key, item in value.items():
            if not _is_number(item):
                return "bad", (str(key), f"{type(item).__name__} {item!r:.40}")
        return "ok", {str(key): float(item) for key, item in value.items()}
    return "bad", (None, f"{type(value).__name__} {value!r:.40}")


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this worker when its parent dies, so a hung call cannot outlive a killed trainer."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the EOF on the pipe still ends an idle worker
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _worker_main(fd: int, parent_pid: int) -> None:
    """Worker loop: a RewardConfig first, then (call id, component, completion, example) in, results out.

    SIGTERM is the trainer's to answer (it saves and exits 42), so the worker ignores it (`_WORKER_COMMAND`): a
    scheduler that signals every process of the job (`scancel --signal=TERM`, a pod's eviction) must not kill the
    workers mid-step. The trainer stops them itself (`close`), and they die with it (`_die_with_parent`)."""
    _die_with_parent(parent_pid)
    conn = multiprocessing.connection.Connection(fd)
    config = conn.recv()
    fns = tuple(spec.fn for spec in build_reward_fns(config))
    for target in config.functions:  # pay the imports before 'ready', so they never eat a call's time limit
        if target in PRELOAD_MODULES:
            importlib.import_module(PRELOAD_MODULES[target])
    conn.send(("ready", None, None))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        call_id, k, completion, example = task
        try:
            status, value = _checked(fns[k](completion, example))
            conn.send((status, call_id, value))
        except Exception as error:
            conn.send(("error", call_id, f"{type(error).__name__}: {error}"))


# A fresh interpreter, not multiprocessing's spawn: spawn re-runs the parent's __main__ (the
# trainer, a notebook, a script without a main guard), and fork would copy JAX's threads.
# The worker starts with SIGTERM blocked (`_start_worker`) and ignores it before unblocking it, so a job-wide signal
# while the pool starts spares it too (a pending TERM is dropped once ignored).
_WORKER_COMMAND = ("import signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM}); "
                   "from drgrpo_jax.rewards.scorer import _worker_main; _worker_main(*map(int, sys.argv[1:]))")


def _start_worker(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """Popen with SIGTERM blocked in this thread across the fork: the child inherits the block."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return subprocess.Popen(args, **kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@dataclasses.dataclass
class _Worker:
    """One worker process as the scorer sees it."""

    process: subprocess.Popen
    conn: multiprocessing.connection.Connection
    started: float
    ready: bool = False
    call: tuple[int, int, float] | None = None  # (response index, component, deadline)


class RewardScorer:
    """A pool of reward workers; `score` never waits on one call longer than `reward.timeout_s`."""

    STARTUP_TIMEOUT_S = 300.0  # a worker not ready by then is a broken environment, not a slow reward

    def __init__(self, config: RewardConfig, *, budget: int | None = None):
        self.specs = build_reward_fns(config)  # import errors surface here, in the parent
        self.budget = budget  # the generation budget (rollout.max_new_tokens) the length rewards measure against
        self._by_length = [f for f, spec in enumerate(self.specs) if spec.name in LENGTH_REWARDS]
        if self._by_length and budget is None:
            raise ValueError("RewardScorer: the overlong reward needs the generation budget (budget=)")
        self.names = component_names(config)
        self.weights = tuple(float(w) for w in config.weights) or (1.0,) * len(self.names)
        self._column = {name: k for k, name in enumerate(self.names)}
        self._dicts_allowed = bool(config.components)  # without reward.components, each function is one number
        self.timeout_s = config.timeout_s
        self._config = config
        self._workers = [self._start() for _ in range(config.num_workers)]

    def _start(self) -> _Worker:
        parent_conn, child_conn = multiprocessing.Pipe()
        # The worker imports what this process can (user reward modules next to the script or tests).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        process = _start_worker(
            [sys.executable, "-c", _WORKER_COMMAND, str(child_conn.fileno()), str(os.getpid())],
            pass_fds=(child_conn.fileno(),),
            env=env,
        )
        child_conn.close()
        parent_conn.send(self._config)
        return _Worker(process, parent_conn, time.monotonic())

    def _replace(self, worker: _Worker) -> None:
        """Kill `worker` (hung or dead) and start a fresh one in its place."""
        worker.process.kill()
        worker.process.wait(timeout=10)
        worker.conn.close()
        self._workers[self._workers.index(worker)] = self._start()

    def score(self, completions: Sequence[str], examples: Sequence[Example],
              lengths: Sequence[int] | np.ndarray | None = None,
              given: Mapping[str, Sequence[float]] | None = None) -> RewardResult:
        """Scores completion i against examples[i] with every function; raises RewardError on a bad component.

        A missing or non-numeric component stops the run naming the prompt id and the component, unless the call
        that should have given it timed out or failed: that is already counted, and scores 0.

        `lengths`: each completion's length in tokens, needed by the length rewards (overlong).
        `given`: components the caller already has, one value per completion (an episode's own rewards,
        environment.reward_components); a reward function that gives one too stops the run.
        """
        if len(completions) != len(examples):
            raise ValueError(f"score: {len(completions)} completions for {len(examples)} examples")
        if self._by_length and (lengths is None or len(lengths) != len(completions)):
            raise ValueError("score: the overlong reward needs one token length per completion")
        num, num_functions = len(completions), len(self.specs)
        scores_NK = np.zeros((num, len(self.names)), np.float32)
        given_NK = np.zeros(scores_NK.shape, bool)  # which components some call supplied
        failed_N = np.zeros(num, bool)  # a call timed out or failed: its components score 0, counted
        timeouts_F = np.zeros(num_functions, np.int64)
        errors_F = np.zeros(num_functions, np.int64)
        messages: list[str] = []
        problems: list[str] = []  # values that stop the run, raised once no call is in flight
        pending = collections.deque((i, f) for i in range(num) for f in range(num_functions)
                                    if f not in self._by_length)
        for name, values in (given or {}).items():
            if name not in self._column:
                raise ValueError(f"score: given component {name!r} is not in reward.components {list(self.names)}")
            if len(values) != num:
                raise ValueError(f"score: {len(values)} values of given component {name!r} for {num} completions")
            scores_NK[:, self._column[name]], given_NK[:, self._column[name]] = values, True
        for f in self._by_length:
            name = self.specs[f].name
            if name in self._column and self.budget is not None and lengths is not None:  # checked above
                penalty = overlong_penalty(np.asarray(lengths), self.budget, self._config.overlong_buffer)
                scores_NK[:, self._column[name]], given_NK[:, self._column[name]] = penalty, True

        def fail(i: int, f: int, counter: np.ndarray, why: str) -> None:
            counter[f] += 1
            failed_N[i] = True
            if len(messages) < 5:
                messages.append(f"{self.specs[f].name} on {examples[i].prompt_id}: {why}")

        while pending or any(w.call for w in self._workers):
            for worker in self._workers:  # hand out work
                if worker.ready and worker.call is None and pending:
                    i, f = pending.popleft()
                    worker.call = (i, f, time.monotonic() + self.timeout_s)
                    try:
                        worker.conn.send((i * num_functions + f, f, completions[i], examples[i]))
                    except (OSError, ValueError):  # died while idle; the call goes to a fresh worker
                        pending.appendleft((i, f))
                        worker.call = None
                        self._replace(worker)
            now = time.monotonic()
            deadlines = [w.call[2] for w in self._workers if w.call] or [now + 1.0]
            ready = multiprocessing.connection.wait([w.conn for w in self._workers], max(0.0, min(deadlines) - now))
            for worker in [w for w in self._workers if w.conn in ready]:
                try:
                    status, call_id, value = worker.conn.recv()
                except (EOFError, OSError):  # the worker died: a crash in native code, os._exit, OOM kill
                    code = worker.process.wait(timeout=10)
                    if worker.call is None:
                        raise RewardError(f"a reward worker exited while starting (exit code {code})") from None
                    fail(worker.call[0], worker.call[1], errors_F, f"worker died (exit code {code})")
                    self._replace(worker)
                    continue
                if status == "ready":
                    worker.ready = True
                    continue
                i, f = divmod(call_id, num_functions)
                if status == "error":
                    fail(i, f, errors_F, value)
                else:
                    problem = self._record(status, value, i, f, scores_NK, given_NK, examples)
                    if problem:
                        problems.append(problem)
                worker.call = None
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.call and now > worker.call[2]:
                    fail(worker.call[0], worker.call[1], timeouts_F, f"over {self.timeout_s} s")
                    self._replace(worker)
                elif not worker.ready and now - worker.started > self.STARTUP_TIMEOUT_S:
                    raise RewardError(f"a reward worker did not start within {self.STARTUP_TIMEOUT_S:.0f} s")
        if problems:  # raised only now, with no call in flight, so the pool stays usable
            raise RewardError(f"{problems[0]}; {len(problems)} such value(s) in this batch")
        self._check_complete(given_NK | failed_N[:, None], examples)
        self._check_finite(scores_NK, examples)
        return RewardResult(scores_NK, self.names, self.weights, tuple(s.name for s in self.specs),
                            timeouts_F, errors_F, tuple(messages))

    def _record(self, status: str, value: Any, i: int, f: int, scores_NK: np.ndarray, given_NK: np.ndarray,
                examples: Sequence[Example]) -> str | None:
        """Puts call (response i, function f)'s answer in its component columns; what is wrong with it, if anything."""
        function, where = self.specs[f].name, f"for prompt {examples[i].prompt_id} (response {i})"
        if status == "bad":
            key, what = value
            name = function if key is None else key
            return f"reward component {name!r} returned {what}, not a number, {where}"
        if isinstance(value, dict):
            if not self._dicts_allowed:
                return (f"reward function {function!r} returned a dict {where}; list the keys to use in "
                        "reward.components")
            items = [(key, v) for key, v in value.items() if key in self._column]
        elif function in self._column:
            items = [(function, value)]
        else:
            return (f"reward function {function!r} returned a number {where}, but {function!r} is not in "
                    f"reward.components {list(self.names)}")
        for key, v in items:
            k = self._column[key]
            if given_NK[i, k]:
                return f"reward component {key!r} was given twice (by two functions, or by one and the episode) {where}"
            scores_NK[i, k], given_NK[i, k] = v, True
        return None

    def _check_complete(self, given_NK: np.ndarray, examples: Sequence[Example]) -> None:
        """Every component of every response came from some call (or its call failed and was counted)."""
        missing = np.argwhere(~given_NK)
        if len(missing):
            i, k = (int(x) for x in missing[0])
            raise RewardError(
                f"reward component {self.names[k]!r} is missing for prompt {examples[i].prompt_id} (response {i}): "
                f"no reward function returned it; {len(missing)} missing value(s) in this batch"
            )

    def _check_finite(self, scores_NK: np.ndarray, examples: Sequence[Example]) -> None:
        """A NaN/inf reward would poison every advantage of its group: stop and say where it came from."""
        bad = np.argwhere(~np.isfinite(scores_NK))
        if len(bad):
            i, k = (int(x) for x in bad[0])
            raise RewardError(
                f"reward component {self.names[k]!r} returned {scores_NK[i, k]} for prompt "
                f"{examples[i].prompt_id} (response {i}); {len(bad)} non-finite value(s) in this batch"
            )

    def close(self) -> None:
        """Stops every worker (asks politely, then kills)."""
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, ValueError):
                pass
        for worker in self._workers:
            try:
                worker.process.wait(timeout=2)
            except subprocess.TimeoutExpired:  # busy in a hung call
                worker.process.kill()
                worker.process.wait(timeout=5)
            worker.conn.close()
        self._workers = []

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

