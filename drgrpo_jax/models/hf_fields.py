"""config.json's fields read with their type and range checked: one `FieldError` naming the field for the first
that is not (`config.json.num_hidden_layers: must be a positive int, got 0`), whatever a hostile file holds."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from drgrpo_jax.errors import FieldError

# What the errors name the fields of.
SOURCE = "config.json"
REQUIRED = object()  # `read_field`'s default for a field config.json must name


def is_int(value: Any) -> bool:
    """An int, not a bool (JSON true is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# A field's kind -> (the test its value passes, what the error says it must be).
KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "count": (lambda v: is_int(v) and v > 0, "a positive int"),
    "id": (lambda v: is_int(v) and v >= 0, "an int >= 0"),
    "positive": (lambda v: _is_number(v) and v > 0, "a finite number > 0"),
    "scale": (lambda v: _is_number(v) and v >= 0, "a finite number >= 0"),
    "flag": (lambda v: isinstance(v, bool), "true or false"),
    "text": (lambda v: isinstance(v, str), "a string"),
    "object": (lambda v: isinstance(v, dict), "a JSON object"),
    "list": (lambda v: isinstance(v, list), "a list"),
}


def shown(value: Any) -> str:
    """A value as an error shows it: its repr, cut to one short line (a hostile file's value may be huge)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def read_field(hf: dict[str, Any], key: str, kind: str, default: Any = REQUIRED, where: str = "") -> Any:
    """config.json's `key` checked to be of `kind` (`KINDS`); null or absent is `default`, or a FieldError naming
    the field (`where` the dict it sits in: "rope_scaling.") when it is required."""
    value = hf.get(key)
    if value is None:
        if default is REQUIRED:
            raise FieldError(SOURCE, where + key, "is required and missing")
        return default
    test, expected = KINDS[kind]
    if not test(value):
        raise FieldError(SOURCE, where + key, f"must be {expected}, got {shown(value)}")
    return value


def read_choice(hf: dict[str, Any], key: str, choices: tuple[str, ...], default: str, where: str = "") -> str:
    """config.json's `key`, one of `choices` (`default` when null or absent)."""
    value = hf.get(key)
    if value is None:
        return default
    if value not in choices:
        raise FieldError(SOURCE, where + key, f"{shown(value)} is not supported (supported: {list(choices)})")
    return value


def read_token_ids(hf: dict[str, Any], key: str) -> tuple[int, ...]:
    """An HF token id field (null, an id or a list of them) as a tuple."""
    value = hf.get(key)
    ids = value if isinstance(value, list) else [] if value is None else [value]
    if not all(KINDS["id"][0](token) for token in ids):
        raise FieldError(SOURCE, key, f"must be an int >= 0 or a list of them, got {shown(value)}")
    return tuple(ids)
