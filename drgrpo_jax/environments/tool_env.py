"""ToolEnvironment: a question, tools the model may call, and the tool results sent back as tool messages.

A turn that calls no tool is the model's final answer and ends the episode. Every call is answered, in order:
with the tool's result, or with an error message when the call could not be read (malformed JSON, an unknown
tool, arguments the schema refuses: counted as `malformed_calls`) or the tool failed (it raised, timed out or hit
a limit: `tool_errors`). Nothing a model writes and nothing a tool does stops the run.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from drgrpo_jax.environments.calls import CallFormat, MalformedCall, parse_calls
from drgrpo_jax.environments.protocol import Message, Observation
from drgrpo_jax.environments.tools import Tool
from drgrpo_jax.errors import ToolArgumentError

__all__ = ["ToolEnvironment", "tool_message"]

MAX_RESULT_CHARS = 2000  # of one tool result sent back to the model


def tool_message(name: str, content: str) -> Message:
    """A tool result as the chat templates' tool message."""
    return {"role": "tool", "name": name, "content": content}


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + " ...[cut]"


class ToolEnvironment:
    """The question of `example[prompt_key]` with `tools`. `max_tool_calls`: calls per episode (later ones are
    answered with an error and end the episode); `timeout_s`: the longest an in-process tool may take before its
    call is answered with an error (the Python tool enforces its own limits in its worker). `few_shot`: messages
    (a worked episode: user, assistant calling a tool, tool result, assistant answering) put before the question,
    so a model that was never trained on the call format sees it used once."""

    def __init__(self, tools: Sequence[Tool], *, call_format: CallFormat | None = None, max_tool_calls: int = 8,
                 timeout_s: float = 30.0, system_prompt: str | None = None, prompt_key: str = "prompt",
                 few_shot: Sequence[Message] = ()):
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"ToolEnvironment.tools: names must differ, got {names}")
        if max_tool_calls < 0 or timeout_s <= 0:
            raise ValueError("ToolEnvironment: max_tool_calls must be >= 0 and timeout_s > 0")
        self.tools = tuple(tools)
        self.call_format = call_format or CallFormat()
        self.max_tool_calls, self.timeout_s = max_tool_calls, timeout_s
        self.system_prompt, self.prompt_key = system_prompt, prompt_key
        self.few_shot = tuple(dict(message) for message in few_shot)
        self._by_name = {tool.name: tool for tool in tools}
        self.calls_made = 0

    def reset(self, example: Mapping[str, Any]) -> list[Message]:
        self.calls_made = 0
        question = example[self.prompt_key]
        opening = [*self.few_shot, {"role": "user", "content": str(question)}]
        return ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + opening

    def _run(self, tool: Tool, arguments: Mapping[str, Any]) -> str:
        """The tool's result; raises what the tool raised, TimeoutError past timeout_s."""
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tool-{tool.name}")
        try:
            return _text(pool.submit(tool.fn, **arguments).result(timeout=self.timeout_s))
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no result within {self.timeout_s:g} s") from None
        finally:
            pool.shutdown(wait=False)  # a hanging thread is left behind; its call is already answered

    def step(self, text: str) -> Observation:
        calls = parse_calls(text, self.call_format)
        if not calls:
            return Observation(done=True)
        messages: list[Message] = []
        ran = errors = malformed = 0
        seconds = 0.0
        for call in calls:
            if self.calls_made >= self.max_tool_calls:
                messages.append(tool_message("error", f"error: no more tool calls (the limit is "
                                                      f"{self.max_tool_calls}); give your final answer"))
                return Observation(messages, done=True, tool_calls=ran, tool_errors=errors,
                                   malformed_calls=malformed, tool_seconds=seconds)
            self.calls_made += 1
            if isinstance(call, MalformedCall):
                malformed += 1
                messages.append(tool_message("error", f"error: malformed tool call ({call.reason}): {call.text}"))
                continue
            tool = self._by_name.get(call.name)
            if tool is None:
                malformed += 1
                messages.append(tool_message(call.name, f"error: no tool named {call.name!r}; the tools are "
                                                        f"{sorted(self._by_name)}"))
                continue
            try:
                arguments = tool.checked_arguments(call.arguments)
            except ToolArgumentError as error:
                malformed += 1
                messages.append(tool_message(call.name, f"error: {error}"))
                continue
            ran += 1
            start = time.monotonic()
            try:
                result = self._run(tool, arguments)
            except Exception as error:  # whatever a tool raises is the model's to read, never the run's
                errors += 1
                result = f"error: {type(error).__name__}: {error}"
            seconds += time.monotonic() - start
            messages.append(tool_message(call.name, _text(result)))
        return Observation(messages, done=False, tool_calls=ran, tool_errors=errors, malformed_calls=malformed,
                           tool_seconds=seconds)
