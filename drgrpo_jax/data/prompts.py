"""The prompt of an example: the config's template, inside the tokenizer's chat template when it has one."""

from __future__ import annotations

from typing import Any

from drgrpo_jax.config.schema import DataConfig
from drgrpo_jax.data.examples import Example

__all__ = ["render_prompt", "tokenize_prompt"]


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(example: Example, config: DataConfig, tokenizer: Any = None) -> str:
    """The prompt text: the template, inside the tokenizer's chat template when it has one and it is on."""
    # str.replace, not str.format: templates hold LaTeX braces such as \boxed{}.
    user = config.template.replace("{question}", example.question)
    if config.use_chat_template and tokenizer is not None and _has_chat_template(tokenizer):
        messages = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
        messages.append({"role": "user", "content": user})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{config.system_prompt}\n\n{user}" if config.system_prompt else user


def tokenize_prompt(example: Example, config: DataConfig, tokenizer: Any) -> list[int]:
    """Prompt token ids; a chat template already holds its special tokens, so none are added again."""
    text = render_prompt(example, config, tokenizer)
    chat = config.use_chat_template and _has_chat_template(tokenizer)
    return list(tokenizer(text, add_special_tokens=not chat)["input_ids"])
