"""Flags made from typed config fields (drgrpo_jax/config/flags.py) and the services' one API-key rule
(drgrpo_jax/config/api_keys.py)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Literal

import pytest

from drgrpo_jax.config.api_keys import api_key
from drgrpo_jax.config.flags import add_field_flag, add_flag, default_note, field_choices
from drgrpo_jax.config.schema import _f
from drgrpo_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Section:
    timeout_s: float = _f(600.0, "seconds per request")
    engine: Literal["ours", "sglang"] = _f("ours", "the API")
    tools: tuple[str, ...] = _f((), "tools to call")
    chat: bool = _f(True, "wrap the prompt in the chat template")
    share: float = _f(0.5, "a share of the memory, in %")
    internal: int = _f(0, "set by a launcher", hidden=True)
    yaml_only: int = _f(0, "a YAML key only", flag=None)


def _parser(**flags) -> tuple[argparse.ArgumentParser, dict[str, argparse.Action]]:
    parser = argparse.ArgumentParser()
    actions = {name: add_field_flag(parser, Section, name, **options) for name, options in flags.items()}
    return parser, actions


def test_a_flag_takes_type_default_choices_and_help_from_its_field():
    parser, actions = _parser(timeout_s={"flag": "--timeout", "dest": "timeout"}, engine={})
    assert parser.parse_args([]).timeout == 600.0 and parser.parse_args(["--timeout", "5"]).timeout == 5.0
    assert actions["timeout_s"].help == "seconds per request (default 600)"
    assert actions["engine"].choices == ["ours", "sglang"] and parser.parse_args([]).engine == "ours"
    with pytest.raises(SystemExit):
        parser.parse_args(["--engine", "vllm"])


def test_a_flag_follows_its_fields_default(monkeypatch):
    monkeypatch.setattr(Section.__dataclass_fields__["timeout_s"], "default", 30.0)
    parser, actions = _parser(timeout_s={})
    assert parser.parse_args([]).timeout_s == 30.0 and actions["timeout_s"].help.endswith("(default 30)")


def test_a_value_taken_first_from_elsewhere_defaults_to_none_and_says_so():
    parser, actions = _parser(timeout_s={"fallback": "the run's"}, tools={"fallback": "the run's"},
                              chat={"flag": "--no-chat", "fallback": "the run's"})
    assert vars(parser.parse_args([])) == {"timeout_s": None, "tools": None, "chat": None}
    assert vars(parser.parse_args(["--tools", "a", "--tools", "b", "--no-chat"]))["tools"] == ["a", "b"]
    assert parser.parse_args(["--no-chat"]).chat is False
    assert actions["timeout_s"].help.endswith("(default: the run's, else 600)")
    assert actions["tools"].help.endswith("(default: the run's, else none)")
    assert actions["chat"].help == "off: wrap the prompt in the chat template (default: the run's, else on)"


def test_given_only_flags_show_the_fields_default_hidden_and_yaml_only_fields_are_not_shown():
    parser, actions = _parser(timeout_s={"given_only": True}, internal={"given_only": True},
                              yaml_only={"given_only": True})
    assert parser.parse_args([]).timeout_s is None and actions["timeout_s"].help.endswith("(default 600)")
    assert actions["internal"].help == argparse.SUPPRESS and actions["yaml_only"] is None


def test_help_text_is_safe_for_argparse_and_shows_what_it_takes():
    parser, _ = _parser(share={})
    assert "in % (default 0.5)" in parser.format_help()  # a literal % does not break --help
    add_flag(parser, "--size", type=int, default=50, help="problems per task")
    add_flag(parser, "--off", dest="on", action="store_false", help="a switch")
    assert "problems per task (default 50)" in parser.format_help()
    assert parser.parse_args([]).on is True  # a switch keeps argparse's own default
    assert default_note("{q}\nline") == " (default {q}\\nline)" and default_note(("a", "b")) == " (default a,b)"
    assert default_note("") == default_note(False) == "" and field_choices(Section, "timeout_s") is None


def test_the_api_key_rule_reads_the_variable_and_names_the_setting_that_named_it(monkeypatch):
    monkeypatch.setenv("EVAL_KEY", " secret \n")
    assert api_key("EVAL_KEY") == "secret" and api_key("") is None
    for value in (None, "  "):
        if value is None:
            monkeypatch.delenv("EVAL_KEY")
        else:
            monkeypatch.setenv("EVAL_KEY", value)
        for key in ("rollout.api_key_env", "--api-key-env"):
            with pytest.raises(ConfigError) as error:
                api_key("EVAL_KEY", key)
            assert str(error.value) == f"{key}: environment variable EVAL_KEY is not set or empty"
    with pytest.raises(ConfigError, match=r"^rollout\.api_key_env: "):  # the trainer's key by default
        api_key("EVAL_KEY")
