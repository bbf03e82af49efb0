"""How a model writes tool calls, and reading them back from its text.

Three formats: `hermes` (Hermes/Qwen templates: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
number per turn), `llama3_json` (Llama 3.1's JSON tool calling: the whole turn is `{"name": ..., "parameters":
{...}}`, optionally after `<|python_tag|>`) and `tag` (the Hermes JSON between tags of one's choosing, for models
whose template has no tools). A call that cannot be read is a `MalformedCall`: the model's mistake, answered with
an error message, never an exception.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal, get_args

from drgrpo_jax.errors import FieldError

__all__ = ["CallFormat", "FormatName", "MalformedCall", "ToolCall", "parse_calls"]

FormatName = Literal["hermes", "llama3_json", "tag"]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class MalformedCall:
    text: str  # what the model wrote (bounded)
    reason: str


@dataclasses.dataclass(frozen=True)
class CallFormat:
    """A call format; `open_tag`/`close_tag` are the `tag` format's (hermes uses `<tool_call>` tags)."""

    name: FormatName = "hermes"
    open_tag: str = "<tool_call>"
    close_tag: str = "</tool_call>"

    def __post_init__(self):
        if self.name not in get_args(FormatName):
            raise FieldError("CallFormat", "name", f"unknown {self.name!r}; choose one of {get_args(FormatName)}")
        if self.name == "tag" and (not self.open_tag.strip() or not self.close_tag.strip()
                                   or self.open_tag == self.close_tag):
            raise FieldError("CallFormat", "open_tag", "the tag format needs two different, non-blank tags")

    @property
    def tags(self) -> tuple[str, str]:
        return ("<tool_call>", "</tool_call>") if self.name == "hermes" else (self.open_tag, self.close_tag)

    def example(self, name: str, arguments: dict[str, Any]) -> str:
        """How a call is written in this format (for prompts that describe the tools themselves)."""
        if self.name == "llama3_json":
            return json.dumps({"name": name, "parameters": arguments})
        open_tag, close_tag = self.tags
        return f"{open_tag}\n{json.dumps({'name': name, 'arguments': arguments})}\n{close_tag}"


_QUOTE_LIMIT = 200  # characters of a malformed call quoted back to the model


def _call_from_json(text: str, arguments_key: str) -> ToolCall | MalformedCall:
    """One JSON object {"name": str, arguments_key: object} -> the call, or why it is not one."""
    quoted = text.strip()[:_QUOTE_LIMIT]
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return MalformedCall(quoted, f"not valid JSON ({error.msg} at character {error.pos})")
    if not isinstance(value, dict):
        return MalformedCall(quoted, "a call is a JSON object")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(quoted, "a call needs a \"name\" string")
    arguments = value.get(arguments_key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string (OpenAI's wire form)
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return MalformedCall(quoted, f"\"{arguments_key}\" is a string that is not a JSON object")
    if not isinstance(arguments, dict):
        return MalformedCall(quoted, f"\"{arguments_key}\" must be a JSON object")
    return ToolCall(name, arguments)


def _tagged_calls(text: str, open_tag: str, close_tag: str) -> list[ToolCall | MalformedCall]:
    pattern = re.compile(re.escape(open_tag) + r"(.*?)" + re.escape(close_tag), re.DOTALL)
    calls: list[ToolCall | MalformedCall] = [_call_from_json(m.group(1), "arguments") for m in pattern.finditer(text)]
    rest = pattern.sub("", text)
    if open_tag in rest:  # an opened call never closed (often: the turn ran out of tokens)
        tail = rest[rest.index(open_tag):]
        calls.append(MalformedCall(tail[:_QUOTE_LIMIT], f"{open_tag} without {close_tag}"))
    return calls


def parse_calls(text: str, call_format: CallFormat) -> list[ToolCall | MalformedCall]:
    """The calls in one model turn, in order; [] when the turn calls no tool (its final answer)."""
    if call_format.name == "llama3_json":
        body = text.strip()
        body = body.removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return []
        return [_call_from_json(body, "parameters")]
    return _tagged_calls(text, *call_format.tags)
