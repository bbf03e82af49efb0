"""Evaluation suites: seeded reasoning-gym task mixes (generated offline) and the user's JSONL files.

`--suite` is one of: a named mix (`SUITES`), `rg:TASK[,TASK...]` (reasoning-gym tasks with their default
options), or a path to a JSONL file with `problem` (or `question`) and `answer` fields (MATH500, AIME,
GSM8K: answers after a `####` marker are cut there). Both load through data/sources.py, as training's data does.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any

from drgrpo_jax.data.answers import GSM8K_MARKER
from drgrpo_jax.data.examples import Example
from drgrpo_jax.data.sources import RowFields, read_rows, row_examples, source_name, task_examples
from drgrpo_jax.errors import ConfigError

__all__ = ["SUITES", "Suite", "load_suite"]

# name -> ((reasoning-gym task, its options), ...): the problems of each task are generated from the seed.
SUITES: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    # The quickstart's task: sums of two one-digit terms (configs/quickstart.yaml).
    "chain_sum_1digit": (("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),),
    # Harder integer arithmetic, four tasks in equal parts.
    "arithmetic": (
        ("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}),
        ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
        ("basic_arithmetic", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2,
                              "operators": ("+", "-", "*"), "allow_negation": False}),
        ("gcd", {"min_value": 1, "max_value": 100}),
    ),
}


@dataclasses.dataclass(frozen=True)
class Suite:
    """Problems with reference answers, each labelled with the task (or file) it came from."""

    name: str
    examples: tuple[Example, ...]
    tasks: tuple[str, ...]  # one label per example: per-task rows of the report

    def task_names(self) -> list[str]:
        """The distinct task labels, in order of first appearance."""
        return list(dict.fromkeys(self.tasks))


def _reasoning_gym(name: str, tasks: tuple[tuple[str, dict[str, Any]], ...], size: int, seed: int) -> Suite:
    """`size` problems of each task, generated with `seed` (the same seed gives the same problems)."""
    examples, labels = [], []
    for task, options in tasks:
        examples += task_examples(task, options, size, seed, keys=("--suite", "--suite"))
        labels += [task] * size
    return Suite(name, tuple(examples), tuple(labels))


def _jsonl(path: str, size: int, problem_field: str | None, answer_field: str) -> Suite:
    """The first `size` rows (0 = all) of a JSONL file of problems and answers."""
    name = source_name(path)
    fields = RowFields((problem_field,) if problem_field else ("problem", "question"), answer_field, GSM8K_MARKER,
                       keys=("--problem-field", "--answer-field"))
    rows = read_rows(path, "jsonl", keys=("--suite", "--suite", "--suite"))
    examples = row_examples(rows[:size] if size else rows, name, fields, path)
    if not examples:
        raise ConfigError("--suite", f"{path} holds no problems")
    return Suite(name, tuple(examples), (name,) * len(examples))


def load_suite(spec: str, *, size: int, seed: int, problem_field: str | None = None,
               answer_field: str = "answer") -> Suite:
    """The suite `spec` names; ConfigError naming the flag when it cannot be read.

    `size`: problems per reasoning-gym task, or the first rows of a file (0 = all of them).
    """
    if spec.endswith(".jsonl") or os.path.isfile(spec):
        if not os.path.isfile(spec):
            raise ConfigError("--suite", f"no such file {spec!r}")
        return _jsonl(spec, size, problem_field, answer_field)
    if size < 1:
        raise ConfigError("--size", f"a reasoning-gym suite needs at least 1 problem per task, got {size}")
    if spec.startswith("rg:"):
        names = [task.strip() for task in spec[3:].split(",") if task.strip()]
        tasks: tuple[tuple[str, dict[str, Any]], ...] = tuple((name, {}) for name in names)
        if not tasks:
            raise ConfigError("--suite", "rg: needs at least one reasoning-gym task (rg:chain_sum,products)")
        return _reasoning_gym(spec, tasks, size, seed)
    if spec in SUITES:
        return _reasoning_gym(spec, SUITES[spec], size, seed)
    close = difflib.get_close_matches(spec, list(SUITES), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ConfigError("--suite", f"unknown suite {spec!r}: {hint}give one of {', '.join(SUITES)}, "
                                 "rg:TASK[,TASK...] or a .jsonl file")
