"""The two records every other module of data/ and its callers pass around: one example, one dataset."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["Example", "PromptDataset"]


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with its reference answer."""

    prompt_id: str  # stable across runs and resumes: source name / row index in the source
    question: str
    answer: str
    entry: Mapping[str, Any] | None = None  # reasoning-gym's raw entry, for the task's own score_answer


@dataclasses.dataclass(frozen=True)
class PromptDataset:
    """A training split and a held-out evaluation split."""

    name: str
    train: tuple[Example, ...]
    eval: tuple[Example, ...]
