"""Reward components, scored in worker processes with a hard per-call time limit.

math-verify times itself out with `signal.alarm`, which only works in a process's main thread,
and user functions may hang or crash: every call therefore runs in a worker process; a call
past `reward.timeout_s` gets its worker killed and replaced, scores 0 and is counted, as is
a call that raises or kills its worker. A NaN or infinite reward stops the run (RewardError).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import multiprocessing
import multiprocessing.connection
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from drgrpo_jax.config import ConfigError, RewardConfig
from drgrpo_jax.data import Example

__all__ = ["RewardError", "RewardResult", "RewardScorer", "RewardSpec", "build_reward_fns", "extract_answer"]

RewardFn = Callable[[str, Example], float]  # (completion, example) -> reward


class RewardError(RuntimeError):
    """A reward that cannot be trusted (NaN/inf) or a worker that cannot start: the run stops."""


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """One named reward component."""

    name: str
    fn: RewardFn  # workers rebuild it from the RewardConfig, so it never crosses a process boundary
    weight: float


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """Per-response component rewards and what went wrong while scoring them."""

    components_NK: np.ndarray  # float32 [N, K]; a timed-out or failed call scores 0
    names: tuple[str, ...]  # K component names
    weights: tuple[float, ...]  # K weights of the scalar reward
    timeouts_K: np.ndarray  # int [K]: calls killed at the time limit
    errors_K: np.ndarray  # int [K]: calls that raised or killed their worker
    error_messages: tuple[str, ...] = ()  # the first few failures, for the log

    def total_N(self) -> np.ndarray:
        """The scalar reward per response: the weighted sum of the components."""
        return (self.components_NK @ np.asarray(self.weights, np.float32)).astype(np.float32)

    def metrics(self) -> dict[str, float]:
        """Flat scalars for metrics.jsonl."""
        out = {"reward_mean": float(self.total_N().mean()) if len(self.components_NK) else 0.0}
        for k, name in enumerate(self.names):
            out[f"reward/{name}"] = float(self.components_NK[:, k].mean()) if len(self.components_NK) else 0.0
            out[f"reward/{name}_timeouts"] = int(self.timeouts_K[k])
            out[f"reward/{name}_errors"] = int(self.errors_K[k])
        out["reward_timeouts"] = int(self.timeouts_K.sum())
        out["reward_errors"] = int(self.errors_K.sum())
        return out


# ---------------------------------------------------------------------------------------------
# Built-in components
# ---------------------------------------------------------------------------------------------

_ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...}, braces balanced; None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for position in range(begin, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            if depth == 0:
                return text[begin:position].strip()
            depth -= 1
    return None  # unclosed: the response was cut off mid-answer


def extract_answer(completion: str, answer_format: str) -> str | None:
    """The final answer in `answer_format` ('boxed' or 'answer_tags'); None when absent."""
    if answer_format == "boxed":
        return _last_boxed(completion)
    matches = _ANSWER_TAGS.findall(completion)
    return matches[-1].strip() if matches else None


def format_reward(completion: str, example: Example, *, answer_format: str) -> float:
    """1 when the completion states a final answer in the configured format, else 0."""
    answer = extract_answer(completion, answer_format)
    return 1.0 if answer else 0.0


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> Any:
    from math_verify import parse

    text = answer if ("$" in answer or "\\boxed" in answer) else f"${answer}$"
    gold = parse(text)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    return gold


def math_verify_reward(completion: str, example: Example, *, answer_format: str) -> float:
    """1 when math-verify finds the completion's answer equal to the reference, else 0."""
    from math_verify import parse, verify

    gold = _parse_gold(example.answer)
    tagged = extract_answer(completion, "answer_tags") if answer_format == "answer_tags" else None
    predicted = parse(f"${tagged}$" if tagged else completion)  # boxed answers take priority in parse
    return 1.0 if predicted and verify(gold, predicted) else 0.0


@functools.lru_cache(maxsize=64)
def _task_scorer(task: str) -> Callable[[str, Any], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def task_reward(completion: str, example: Example, *, answer_format: str) -> float:
    """The reasoning-gym task's own `score_answer` of the extracted final answer (0 when absent)."""
    if example.entry is None:
        raise ValueError(f"prompt {example.prompt_id} has no reasoning-gym entry to score against")
    answer = extract_answer(completion, answer_format)
    if answer is None:
        return 0.0
    return float(_task_scorer(example.entry["metadata"]["source_dataset"])(answer, example.entry))


_BUILTINS: dict[str, Callable[..., float]] = {
    "math_verify": math_verify_reward,
    "format": format_reward,
    "task": task_reward,
}
_PRELOAD = {"math_verify": "math_verify", "task": "reasoning_gym"}  # imported before a worker says ready


def _import_fn(path: str, key: str) -> RewardFn:
    """`package.module:function` -> the function; a ConfigError naming `key` when it cannot be found."""
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError or the module's own import-time failure
        raise ConfigError(key, f"cannot import {module_name!r}: {type(error).__name__}: {error}") from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise ConfigError(key, f"{module_name!r} has no function {attribute!r}")
    return fn


def build_reward_fns(config: RewardConfig) -> tuple[RewardSpec, ...]:
    """One RewardSpec per `reward.functions` entry; import failures raise ConfigError."""
    weights = config.weights or (1.0,) * len(config.functions)
    specs = []
    for i, (target, weight) in enumerate(zip(config.functions, weights, strict=True)):
        if target in _BUILTINS:
            name, fn = target, functools.partial(_BUILTINS[target], answer_format=config.answer_format)
        else:
            name, fn = target.rpartition(":")[2], _import_fn(target, f"reward.functions[{i}]")
        if name in {spec.name for spec in specs}:
            raise ConfigError(f"reward.functions[{i}]", f"a second component named {name!r}")
        specs.append(RewardSpec(name, fn, float(weight)))
    return tuple(specs)


# ---------------------------------------------------------------------------------------------
# Workers
# ---------------------------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this worker when its parent dies, so a hung call cannot outlive a killed trainer."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the EOF on the pipe still ends an idle worker
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _worker_main(fd: int, parent_pid: int) -> None:
    """Worker loop: a RewardConfig first, then (call id, component, completion, example) in, results out."""
    _die_with_parent(parent_pid)
    conn = multiprocessing.connection.Connection(fd)
    config = conn.recv()
    fns = tuple(spec.fn for spec in build_reward_fns(config))
    for target in config.functions:  # pay the imports before 'ready', so they never eat a call's time limit
        if target in _PRELOAD:
            importlib.import_module(_PRELOAD[target])
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
            value = fns[k](completion, example)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                conn.send(("bad", call_id, f"{type(value).__name__} {value!r:.40}"))
                continue
            conn.send(("ok", call_id, float(value)))
        except Exception as error:
            conn.send(("error", call_id, f"{type(error).__name__}: {error}"))


# A fresh interpreter, not multiprocessing's spawn: spawn re-runs the parent's __main__ (the
# trainer, a notebook, a script without a main guard), and fork would copy JAX's threads.
_WORKER_COMMAND = "import sys; from drgrpo_jax.rewards import _worker_main; _worker_main(*map(int, sys.argv[1:]))"


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

    def __init__(self, config: RewardConfig):
        self.specs = build_reward_fns(config)  # import errors surface here, in the parent
        self.timeout_s = config.timeout_s
        self._config = config
        self._workers = [self._start() for _ in range(config.num_workers)]

    @property
    def names(self) -> tuple[str, ...]:
        """The K component names, in reward.functions order."""
        return tuple(spec.name for spec in self.specs)

    def _start(self) -> _Worker:
        parent_conn, child_conn = multiprocessing.Pipe()
        # The worker imports what this process can (user reward modules next to the script or tests).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        process = subprocess.Popen(
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

    def score(self, completions: Sequence[str], examples: Sequence[Example]) -> RewardResult:
        """Scores completion i against examples[i] with every component; raises RewardError on NaN/inf."""
        if len(completions) != len(examples):
            raise ValueError(f"score: {len(completions)} completions for {len(examples)} examples")
        num, num_components = len(completions), len(self.specs)
        scores_NK = np.zeros((num, num_components), np.float32)
        timeouts_K = np.zeros(num_components, np.int64)
        errors_K = np.zeros(num_components, np.int64)
        messages: list[str] = []
        non_numbers: list[tuple[int, int, str]] = []  # (response, component, what it returned)
        pending = collections.deque((i, k) for i in range(num) for k in range(num_components))

        def fail(i: int, k: int, counter: np.ndarray, why: str) -> None:
            counter[k] += 1
            if len(messages) < 5:
                messages.append(f"{self.specs[k].name} on {examples[i].prompt_id}: {why}")

        while pending or any(w.call for w in self._workers):
            for worker in self._workers:  # hand out work
                if worker.ready and worker.call is None and pending:
                    i, k = pending.popleft()
                    worker.call = (i, k, time.monotonic() + self.timeout_s)
                    try:
                        worker.conn.send((i * num_components + k, k, completions[i], examples[i]))
                    except (OSError, ValueError):  # died while idle; the call goes to a fresh worker
                        pending.appendleft((i, k))
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
                    fail(worker.call[0], worker.call[1], errors_K, f"worker died (exit code {code})")
                    self._replace(worker)
                    continue
                if status == "ready":
                    worker.ready = True
                    continue
                i, k = divmod(call_id, num_components)
                if status == "ok":
                    scores_NK[i, k] = value
                elif status == "bad":
                    non_numbers.append((i, k, value))
                else:
                    fail(i, k, errors_K, value)
                worker.call = None
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.call and now > worker.call[2]:
                    fail(worker.call[0], worker.call[1], timeouts_K, f"over {self.timeout_s} s")
                    self._replace(worker)
                elif not worker.ready and now - worker.started > self.STARTUP_TIMEOUT_S:
                    raise RewardError(f"a reward worker did not start within {self.STARTUP_TIMEOUT_S:.0f} s")
        if non_numbers:  # raised only now, with no call in flight, so the pool stays usable
            i, k, what = non_numbers[0]
            raise RewardError(
                f"reward component {self.specs[k].name!r} returned {what}, not a number, for prompt "
                f"{examples[i].prompt_id} (response {i}); {len(non_numbers)} such value(s) in this batch"
            )
        self._check_finite(scores_NK, examples)
        return RewardResult(
            scores_NK, self.names, tuple(s.weight for s in self.specs), timeouts_K, errors_K, tuple(messages)
        )

    def _check_finite(self, scores_NK: np.ndarray, examples: Sequence[Example]) -> None:
        """A NaN/inf reward would poison every advantage of its group: stop and say where it came from."""
        bad = np.argwhere(~np.isfinite(scores_NK))
        if len(bad):
            i, k = (int(x) for x in bad[0])
            raise RewardError(
                f"reward component {self.specs[k].name!r} returned {scores_NK[i, k]} for prompt "
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

