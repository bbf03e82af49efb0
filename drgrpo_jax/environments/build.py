"""The run config's `environment:` section -> what the trainer's collection needs: a fresh environment per
episode, its chat renderer, the episode limits, and each example as the environment reads it."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

from drgrpo_jax.config.schema import Config, EnvironmentConfig
from drgrpo_jax.data.examples import Example
from drgrpo_jax.environments.calculator import calculator
from drgrpo_jax.environments.calls import CallFormat
from drgrpo_jax.environments.chat import ChatRenderer
from drgrpo_jax.environments.protocol import Environment
from drgrpo_jax.environments.python_tool import PythonSandbox
from drgrpo_jax.environments.tool_env import ToolEnvironment
from drgrpo_jax.environments.tools import Tool, import_object, make_tool
from drgrpo_jax.environments.trajectory import EpisodeLimits, Trajectory
from drgrpo_jax.errors import ConfigError, PythonSandboxUnavailable

__all__ = ["Episodes", "build_episodes", "build_tools", "read_few_shot"]

_ROLES = ("system", "user", "assistant", "tool")


def read_few_shot(path: str) -> tuple[dict[str, Any], ...]:
    """environment.few_shot's messages; ConfigError naming the key when the file is not a list of chat messages."""
    try:
        with open(path, encoding="utf-8") as f:
            messages = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError("environment.few_shot", f"cannot read {path!r}: {error}") from None
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in _ROLES and isinstance(m.get("content"), str) for m in messages):
        raise ConfigError("environment.few_shot", f"{path!r} must hold a JSON list of {{\"role\": one of {_ROLES}, "
                                                  "\"content\": text}} messages")
    return tuple(messages)


def _tool(name: str, key: str, config: EnvironmentConfig) -> Tool:
    if name == "calculator":
        return make_tool(calculator)
    if name == "python":
        sandbox = PythonSandbox(timeout_s=config.python_timeout_s, memory_mb=config.python_memory_mb,
                                containment=config.python_sandbox)
        try:
            return make_tool(sandbox.tool_function())
        except PythonSandboxUnavailable as error:
            raise ConfigError("environment.python_sandbox", f"jail: {error}; or set environment.python_sandbox=weak, "
                                                            "which does not contain model-written code "
                                                            "(docs/security.md)") from None
    target = import_object(name, key)
    if isinstance(target, Tool):
        return target
    try:
        return make_tool(target)
    except TypeError as error:
        raise ConfigError(key, str(error)) from None


def build_tools(config: EnvironmentConfig) -> tuple[Tool, ...]:
    """environment.tools as Tools; ConfigError naming the entry that cannot be one."""
    return tuple(_tool(name, f"environment.tools[{i}]", config) for i, name in enumerate(config.tools))


@dataclasses.dataclass(frozen=True)
class Episodes:
    """What collection needs to run episodes (train/collect.py)."""

    make_environment: Callable[[], Environment]
    renderer: Callable[[Environment], ChatRenderer]
    limits: EpisodeLimits
    template: str  # data.template: the user's opening message, {question} replaced
    reward_components: tuple[str, ...] = ()  # environment.reward_components: scored from each episode itself

    def given_rewards(self, trajectories: Sequence[Trajectory]) -> dict[str, list[float]]:
        """The episodes' own reward components, for the scorer's `given` columns."""
        return {name: [t.reward_component(name) for t in trajectories] for name in self.reward_components}

    def example(self, example: Example) -> dict[str, Any]:
        """The example as an environment reads it: `prompt` (the templated question), question, answer, id."""
        return {"prompt": self.template.replace("{question}", example.question), "question": example.question,
                "answer": example.answer, "prompt_id": example.prompt_id}


def build_episodes(config: Config, tokenizer: Any) -> Episodes:
    """The episodes of `config.environment` (it must be enabled)."""
    e = config.environment
    call_format = CallFormat(e.call_format, open_tag=e.open_tag, close_tag=e.close_tag)
    if e.factory is not None:
        factory = import_object(e.factory, "environment.factory")
        if not callable(factory):
            raise ConfigError("environment.factory", f"{e.factory!r} is not callable")
        make_environment = factory
    else:
        tools = build_tools(e)
        system = config.data.system_prompt or None
        few_shot = read_few_shot(e.few_shot) if e.few_shot else ()

        def make_environment() -> Environment:
            return ToolEnvironment(tools, call_format=call_format, max_tool_calls=e.max_tool_calls,
                                   timeout_s=e.tool_timeout_s, system_prompt=system, few_shot=few_shot)

    limits = EpisodeLimits(max_turns=e.max_turns, max_turn_tokens=min(e.max_turn_tokens, e.max_model_tokens),
                           max_model_tokens=e.max_model_tokens, max_total_tokens=config.rollout.max_new_tokens)
    return Episodes(make_environment, lambda env: ChatRenderer(tokenizer, env.tools, call_format), limits,
                    config.data.template, tuple(e.reward_components))
