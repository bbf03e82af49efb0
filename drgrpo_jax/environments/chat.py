"""Chat messages to token ids through the tokenizer's chat template, for the opening and for every later turn.

The opening is rendered once (`tools=` passed to the template when it renders tools itself). Each later
environment turn is rendered as the template's text *after* an assistant turn and tokenised alone, then appended
to the ids the model produced: earlier turns are never decoded and re-tokenised. A template without tools
(`native_tools` False) gets the tools described in a system message and tool results as user messages between
`<tool_response>` tags, the form Hermes-style models are trained on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from drgrpo_jax.environments.calls import CallFormat
from drgrpo_jax.environments.protocol import Message
from drgrpo_jax.environments.tools import Tool

__all__ = ["ChatRenderer", "template_renders_tools"]

_MARK = "MODELTURNMARK"  # the placeholder assistant content whose position shows where a turn's text ends


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template takes `tools=` (it mentions them)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template


class ChatRenderer:
    """Renders an episode's messages to ids with `tokenizer`'s chat template."""

    def __init__(self, tokenizer: Any, tools: Sequence[Tool] = (), call_format: CallFormat | None = None,
                 native_tools: bool | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("environment: the tokenizer has no chat template; multi-turn episodes need one")
        self.tokenizer, self.tools = tokenizer, tuple(tools)
        self.call_format = call_format or CallFormat()
        self.native_tools = template_renders_tools(tokenizer) if native_tools is None else native_tools
        if self.native_tools and self.call_format.name == "tag":
            self.native_tools = False  # the tag format is for templates that do not render tools
        self._turn_end = self._assistant_turn_end()

    def _render(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        tools = [tool.schema() for tool in self.tools] if self.native_tools and self.tools else None
        return self.tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _assistant_turn_end(self) -> str:
        """The text the template writes after an assistant turn's content (e.g. '<|im_end|>\\n')."""
        text = self._render([{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}], False)
        return text[text.rindex(_MARK) + len(_MARK):]

    @property
    def turn_stop_id(self) -> int | None:
        """The token that ends an assistant turn in this template (its first token after the content)."""
        ids = self.encode(self._turn_end)
        return ids[0] if ids else None

    def tools_description(self) -> str:
        """The system text that describes the tools to a model whose template does not."""
        lines = ["You may call these tools. Write each call on its own as shown, then wait for its result:"]
        for tool in self.tools:
            schema = tool.schema()["function"]
            lines.append(json.dumps(schema))
        if self.tools:
            example = self.tools[0]
            first = next(iter(example.arguments.model_fields), None)
            lines.append("A call: " + self.call_format.example(example.name, {first: "..."} if first else {}))
        lines.append("When you are done, write your answer without a tool call.")
        return "\n".join(lines)

    def _as_template_messages(self, messages: Sequence[Message]) -> list[Message]:
        """Tool messages as user messages between <tool_response> tags when the template does not render tools."""
        if self.native_tools:
            return list(messages)
        out: list[Message] = []
        for message in messages:
            if message.get("role") == "tool":
                out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
            else:
                out.append(message)
        return out

    def opening_messages(self, messages: Sequence[Message]) -> list[Message]:
        """The episode's opening as the template sees it (the tools' description added when it does not)."""
        messages = self._as_template_messages(messages)
        if self.native_tools or not self.tools:
            return messages
        description = self.tools_description()
        if messages and messages[0].get("role") == "system":
            return [{"role": "system", "content": f"{messages[0]['content']}\n\n{description}"}, *messages[1:]]
        return [{"role": "system", "content": description}, *messages]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def opening_ids(self, messages: Sequence[Message]) -> list[int]:
        """The prompt: the opening messages and the template's generation prompt, as ids."""
        return self.encode(self._render(self.opening_messages(messages), True))

    def continuation_ids(self, messages: Sequence[Message], model_stopped: bool) -> list[int]:
        """The ids after a model turn: the rest of the template's end of that turn, the environment's messages and
        the next generation prompt. `model_stopped`: the turn ended with its stop token (the first token of the
        template's turn end, already among the model's ids); otherwise the whole turn end is added."""
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
        base_text = self._render(base, False)
        full_text = self._render(base + self._as_template_messages(messages), True)
        if not full_text.startswith(base_text):
            raise ValueError("environment: the chat template renders earlier turns differently once later ones "
                             "follow; token-exact episodes need a template that only appends")
        turn_end = self._turn_end
        if model_stopped:
            stop_ids = self.encode(turn_end)[:1]
            stop_text = self.tokenizer.decode(stop_ids) if stop_ids else ""
            turn_end = turn_end[len(stop_text):] if turn_end.startswith(stop_text) else turn_end
        return self.encode(turn_end + full_text[len(base_text):])
