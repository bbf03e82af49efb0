"""The environment protocol: what a multi-turn episode asks of the task it runs.

An episode starts from a problem (`reset(example)` -> the opening chat messages). After each model turn,
`step(text)` answers with an `Observation`: the messages that go back to the model (tool results, a user's reply),
whether the episode is done, and reward components earned by that turn (summed over the episode, GDPO-style
parts beside the outcome reward). The driver (environments/trajectory.py) owns the tokens; an environment sees
and returns text and chat messages only, so it needs no tokenizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from drgrpo_jax.environments.tools import Tool

__all__ = ["Environment", "Message", "Observation"]

Message = dict[str, Any]  # a chat message: {"role": ..., "content": ...} (tool messages also carry "name")


@dataclasses.dataclass(frozen=True)
class Observation:
    """The environment's answer to one model turn."""

    messages: Sequence[Message] = ()  # what the model reads next (ignored when done)
    done: bool = False
    rewards: Mapping[str, float] = dataclasses.field(default_factory=dict)  # this turn's reward components
    tool_calls: int = 0  # calls this turn ran (successful or not)
    tool_errors: int = 0  # calls that raised, timed out or hit a limit
    malformed_calls: int = 0  # calls that could not be read, or named no tool, or had bad arguments
    tool_seconds: float = 0.0


@runtime_checkable
class Environment(Protocol):
    """One episode's task. A fresh environment per episode (the driver asks `make_environment()` for each)."""

    @property
    def tools(self) -> Sequence[Tool]:
        """The tools rendered into the prompt; () for an environment without tools."""
        ...

    def reset(self, example: Mapping[str, Any]) -> list[Message]:
        """The opening messages of the episode on this problem."""
        ...

    def step(self, text: str) -> Observation:
        """The answer to the model's turn (its decoded text, special tokens left out)."""
        ...
