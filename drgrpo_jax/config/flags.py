"""Command-line flags made from typed config fields: a flag takes its type, choices, default and help text from
one dataclass field (`schema._f`), so a setting's default and its description are written once. The generation
service's flags (`serve.add_flags`) and the evaluator's (drgrpo_jax/evaluate/cli.py) are made here.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

__all__ = ["add_field_flag", "add_flag", "default_note", "field_choices"]


def _shown(value: Any) -> str:
    """A default as --help shows it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value).replace("\n", "\\n")  # argparse folds a help's newlines into spaces


def default_note(value: Any, fallback: str = "") -> str:
    """` (default X)`, or ` (default: FALLBACK, else X)` for a value taken first from elsewhere (the run's); ''
    when there is nothing to show (an empty value, a switch that is off)."""
    empty = value is None or value is False or value in ("", ())
    if fallback:
        return f" (default: {fallback}, else {'none' if empty else _shown(value)})"
    return "" if empty else f" (default {_shown(value)})"


def _described(text: str, value: Any, fallback: str) -> str:
    """`text` ending with its default, as argparse wants it (a literal % doubled); a text that already says its
    default is left as written."""
    if "default" not in text:
        text += default_note(value, fallback)
    return text.replace("%", "%%")


def add_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *names: str, help: str, default: Any = None,
             **options: Any) -> argparse.Action:
    """A flag of a command's own (no config field says it) whose help shows its default (None: argparse's own, as
    a switch's)."""
    given = {} if default is None else {"default": default}
    return parser.add_argument(*names, help=_described(help, default, ""), **given, **options)


def field_choices(section: type, name: str) -> list[str] | None:
    """The values a `Literal` field allows (None for any other type): the schema stays the one list of them."""
    hint = typing.get_type_hints(section)[name]
    return list(typing.get_args(hint)) if typing.get_origin(hint) is typing.Literal else None


def _field(section: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(section) if f.name == name)


def add_field_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, section: type, name: str,
                   flag: str | None = None, *, note: str = "", fallback: str = "", given_only: bool = False,
                   **options: Any) -> argparse.Action | None:
    """The flag of field `name` of the dataclass `section`, its value stored under the field's name.

    `flag`: the option (default: the field's `flag` metadata, else --the-field-name; None there: the field has no
    flag). Type, choices (metadata `choices` or the field's Literal), metavar and help come from the field: a bool
    is a switch (a `--no-...` flag turns it off), a tuple a repeated flag. The flag's default is the field's,
    except None where a value not given comes first from `fallback` (named in the help: "the run's") or, with
    `given_only`, from the caller's own merge; a repeated flag always defaults to None (argparse appends to its
    default). `note` follows the field's help; `options` override what argparse is given (dest, default, ...).
    """
    field = _field(section, name)
    meta = field.metadata
    flag = flag or meta.get("flag", "--" + name.replace("_", "-"))
    if flag is None:
        return None
    value, kind = field.default, type(field.default)
    negated = kind is bool and flag.startswith("--no-")
    taken: dict[str, Any] = {"action": "store_const", "const": not negated} if kind is bool else {
        "action": "append" if kind is tuple else "store", "type": kind if kind in (int, float) else None,
        "choices": meta.get("choices") or field_choices(section, name), "metavar": meta.get("metavar")}
    taken["dest"] = name
    taken["default"] = None if fallback or given_only or kind is tuple else value
    taken.update(options)
    shown = value if taken["default"] is None else taken["default"]
    text = ("off: " if negated else "") + meta["help"] + note
    taken["help"] = argparse.SUPPRESS if meta.get("hidden") else _described(text, shown, fallback)
    return parser.add_argument(flag, **taken)
