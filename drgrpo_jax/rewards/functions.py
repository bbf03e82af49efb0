"""Reward functions: the built-in components, the `RewardSpec`s built from a RewardConfig, and the result type.

A function returns a number (the component of its own name) or a dict of named components
(`reward.components` lists the ones the trainer uses; other keys are ignored). rewards/scorer.py runs them in
time-limited worker processes.

`overlong` (DAPO's soft overlong punishment) is a function of the response's length in tokens, not
of its text: the scorer computes it in its own process from the lengths the sampler reports.
"""

from __future__ import annotations

import dataclasses
import functools
import pkgutil
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from drgrpo_jax.config.derived import function_name
from drgrpo_jax.config.schema import RewardConfig
from drgrpo_jax.data.answers import boxed_content, parse_reference
from drgrpo_jax.data.examples import Example
from drgrpo_jax.errors import ConfigError

__all__ = ["CORRECTNESS_REWARDS", "RewardResult", "RewardSpec", "build_reward_fns", "extract_answer",
           "overlong_penalty"]

RewardFn = Callable[[str, Example], "float | dict[str, float]"]  # (completion, example) -> reward(s)


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """One named reward function."""

    name: str
    fn: RewardFn  # workers rebuild it from the RewardConfig, so it never crosses a process boundary


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """Per-response component rewards and what went wrong while scoring them."""

    components_NK: np.ndarray  # float32 [N, K]; what a timed-out or failed call should have given is 0
    names: tuple[str, ...]  # K component names
    weights: tuple[float, ...]  # K weights of the scalar reward
    functions: tuple[str, ...]  # F reward function names
    timeouts_F: np.ndarray  # int [F]: calls killed at the time limit
    errors_F: np.ndarray  # int [F]: calls that raised or killed their worker
    error_messages: tuple[str, ...] = ()  # the first few failures, for the log

    def total_N(self) -> np.ndarray:
        """The scalar reward per response: the weighted sum of the components."""
        return (self.components_NK @ np.asarray(self.weights, np.float32)).astype(np.float32)

    def metrics(self) -> dict[str, float]:
        """Flat scalars for metrics.jsonl."""
        out = {"reward_mean": float(self.total_N().mean()) if len(self.components_NK) else 0.0}
        for k, name in enumerate(self.names):
            out[f"reward/{name}"] = float(self.components_NK[:, k].mean()) if len(self.components_NK) else 0.0
        return out | failure_metrics(self.functions, self.timeouts_F, self.errors_F)


def failure_metrics(functions: Sequence[str], timeouts_F: np.ndarray, errors_F: np.ndarray) -> dict[str, int]:
    """Per-function and total reward timeouts and errors, for metrics.jsonl."""
    out = {}
    for f, name in enumerate(functions):
        out[f"reward/{name}_timeouts"] = int(timeouts_F[f])
        out[f"reward/{name}_errors"] = int(errors_F[f])
    return out | {"reward_timeouts": int(np.sum(timeouts_F)), "reward_errors": int(np.sum(errors_F))}


# ---------------------------------------------------------------------------------------------
# Built-in components
# ---------------------------------------------------------------------------------------------

_ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion: str, answer_format: str) -> str | None:
    """The final answer in `answer_format` ('boxed' or 'answer_tags'); None when absent."""
    if answer_format == "boxed":
        return boxed_content(completion)  # None also when unclosed: the response was cut off mid-answer
    matches = _ANSWER_TAGS.findall(completion)
    return matches[-1].strip() if matches else None


def format_reward(completion: str, example: Example, *, answer_format: str) -> float:
    """1 when the completion states a final answer in the configured format, else 0."""
    answer = extract_answer(completion, answer_format)
    return 1.0 if answer else 0.0


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> Any:
    gold = parse_reference(answer)
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    return gold


def math_verify_reward(completion: str, example: Example, *, answer_format: str) -> float:
    """1 when math-verify finds the completion's answer equal to the reference, else 0."""
    from math_verify import parse, verify  # start-up: as data/answers.py's parse_reference

    gold = _parse_gold(example.answer)
    tagged = extract_answer(completion, "answer_tags") if answer_format == "answer_tags" else None
    predicted = parse(f"${tagged}$" if tagged else completion)  # boxed answers take priority in parse
    return 1.0 if predicted and verify(gold, predicted) else 0.0


@functools.lru_cache(maxsize=64)
def _task_scorer(task: str) -> Callable[[str, Any], float]:
    import reasoning_gym  # start-up: ~1.5 s, paid only by the workers of the task reward (PRELOAD_MODULES)

    return reasoning_gym.get_score_answer_fn(task)


def task_reward(completion: str, example: Example, *, answer_format: str) -> float:
    """The reasoning-gym task's own `score_answer` of the extracted final answer (0 when absent)."""
    if example.entry is None:
        raise ValueError(f"prompt {example.prompt_id} has no reasoning-gym entry to score against")
    answer = extract_answer(completion, answer_format)
    if answer is None:
        return 0.0
    return float(_task_scorer(example.entry["metadata"]["source_dataset"])(answer, example.entry))


def overlong_penalty(lengths_N: np.ndarray, budget: int, buffer: int) -> np.ndarray:
    """DAPO's soft overlong punishment, float32 [N]: 0 up to budget - buffer tokens, then linear to -1 at the budget."""
    lengths = np.asarray(lengths_N, np.float64)
    return np.clip((budget - buffer - lengths) / buffer, -1.0, 0.0).astype(np.float32)


def _length_only(completion: str, example: Example) -> float:
    raise RuntimeError("overlong is computed from token lengths by RewardScorer.score, never from the text")


LENGTH_REWARDS = ("overlong",)  # built-ins computed from the response's length in tokens, in the scorer's process

_BUILTINS: dict[str, Callable[..., float]] = {
    "math_verify": math_verify_reward,
    "format": format_reward,
    "task": task_reward,
}
PRELOAD_MODULES = {"math_verify": "math_verify", "task": "reasoning_gym"}  # imported before a worker says ready
CORRECTNESS_REWARDS = ("math_verify", "task")  # built-ins that score 1 exactly when the final answer is right


def _import_fn(path: str, key: str) -> RewardFn:
    """`package.module:function` -> the function; a ConfigError naming `key` when it cannot be found."""
    module_name, _, attribute = path.partition(":")
    try:
        fn = pkgutil.resolve_name(path)
    except AttributeError:
        fn = None
    except Exception as error:  # ImportError or the module's own import-time failure
        raise ConfigError(key, f"cannot import {module_name!r}: {type(error).__name__}: {error}") from None
    if not callable(fn):
        raise ConfigError(key, f"{module_name!r} has no function {attribute!r}")
    return fn


def build_reward_fns(config: RewardConfig) -> tuple[RewardSpec, ...]:
    """One RewardSpec per `reward.functions` entry; import failures raise ConfigError."""
    specs: list[RewardSpec] = []
    for i, target in enumerate(config.functions):
        fn: RewardFn
        if target in LENGTH_REWARDS:
            fn = _length_only
        elif target in _BUILTINS:
            fn = functools.partial(_BUILTINS[target], answer_format=config.answer_format)
        else:
            fn = _import_fn(target, f"reward.functions[{i}]")
        name = function_name(target)
        if name in {spec.name for spec in specs}:
            raise ConfigError(f"reward.functions[{i}]", f"a second function named {name!r}")
        specs.append(RewardSpec(name, fn))
    return tuple(specs)
