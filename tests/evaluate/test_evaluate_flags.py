"""`python -m drgrpo_jax.evaluate`'s command line: its flags are made from the run config's fields (one default, one
help text per setting), every flag name of 0.2 still parses to the same setting, and its API key follows the
trainer's one rule."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from drgrpo_jax.config.schema import (
    Config,
    DataConfig,
    EnvironmentConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
)
from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.evaluate import cli

# Each flag with a run-config counterpart: its dest -> (section, field), and whether a value not given is the run's.
COUNTERPARTS = {
    "k": (TrainConfig, "eval_samples", False),
    "temperature": (TrainConfig, "eval_temperature", False),
    "top_p": (RolloutConfig, "top_p", False),
    "max_new_tokens": (RolloutConfig, "max_new_tokens", True),
    "reward": (RewardConfig, "functions", True),
    "reward_workers": (RewardConfig, "num_workers", False),
    "tools": (EnvironmentConfig, "tools", True),
    "template": (DataConfig, "template", True),
    "system_prompt": (DataConfig, "system_prompt", True),
    "use_chat_template": (DataConfig, "use_chat_template", True),
    "answer_field": (DataConfig, "answer_field", False),
    "tokenizer": (ModelConfig, "tokenizer_path", False),
    "dtype": (ServeConfig, "dtype", False),
    "timeout": (RolloutConfig, "timeout_s", False),
    "api_key_env": (RolloutConfig, "api_key_env", False),
    "engine": (RolloutConfig, "engine", False),
}
REQUIRED = ["--model", "m", "--suite", "s"]
# What 0.2's parser gave for every flag given (its defaults, less the documented changes: docs/changelog.md).
EVERY_FLAG = ["--k", "3", "--temperature", "1.0", "--top-p", "0.9", "--max-new-tokens", "12", "--no-greedy",
              "--size", "5", "--seed", "7", "--step", "2", "--reward", "a", "--reward", "b", "--reward-workers", "3",
              "--tools", "calculator", "--no-tools", "--template", "Q {question}", "--system-prompt", "S",
              "--no-chat-template", "--problem-field", "p", "--answer-field", "x", "--tokenizer", "t", "--dtype",
              "bfloat16", "--max-batch-size", "8", "--batch-prompts", "4", "--timeout", "5", "--api-key-env", "K",
              "--engine", "vllm", "-o", "out"]
GIVEN = {"answer_field": "x", "api_key_env": "K", "batch_prompts": 4, "dtype": "bfloat16", "engine": "vllm",
         "greedy": False, "k": 3, "max_batch_size": 8, "max_new_tokens": 12, "model": ["m"], "no_tools": True,
         "output": "out", "problem_field": "p", "reward": ["a", "b"], "reward_workers": 3, "seed": 7, "size": 5,
         "step": 2, "suite": "s", "system_prompt": "S", "temperature": 1.0, "template": "Q {question}", "timeout": 5.0,
         "tokenizer": "t", "tools": ["calculator"], "top_p": 0.9, "use_chat_template": False}
DEFAULTS = {"answer_field": "answer", "api_key_env": "", "batch_prompts": 64, "dtype": "float32", "engine": "ours",
            "greedy": True, "k": 4, "max_batch_size": 64, "max_new_tokens": None, "model": ["m"], "no_tools": False,
            "output": None, "problem_field": None, "reward": None, "reward_workers": 2, "seed": 1234, "size": 50,
            "step": None, "suite": "s", "system_prompt": None, "temperature": 0.6, "template": None, "timeout": 600.0,
            "tokenizer": None, "tools": None, "top_p": 1.0, "use_chat_template": None}


def _field(section: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(section) if f.name == name)


def _actions() -> dict[str, argparse.Action]:
    return {action.dest: action for action in cli.build_parser()._actions}


def test_every_flag_name_parses_to_the_same_setting():
    assert vars(cli.parse_args(REQUIRED + EVERY_FLAG)) == GIVEN
    assert vars(cli.parse_args(REQUIRED)) == DEFAULTS
    assert set(GIVEN) == set(DEFAULTS)


def test_the_flags_with_a_run_config_counterpart_take_its_default_and_help():
    actions = _actions()
    for dest, (section, name, from_run) in COUNTERPARTS.items():
        field = _field(section, name)
        assert actions[dest].help.removeprefix("off: ").startswith(field.metadata["help"].replace("%", "%%")), dest
        if from_run:
            assert actions[dest].default is None and "(default: the run's" in actions[dest].help, dest
        else:
            assert actions[dest].default == field.default, dest


def test_changing_a_fields_default_changes_the_flags(monkeypatch):
    monkeypatch.setattr(_field(RolloutConfig, "timeout_s"), "default", 42.0)
    monkeypatch.setattr(_field(TrainConfig, "eval_samples"), "default", 6)
    args = cli.parse_args(REQUIRED)
    assert (args.timeout, args.k) == (42.0, 6)
    assert "(default 42)" in _actions()["timeout"].help


def test_a_value_not_given_is_the_runs_else_the_fields_default():
    args = cli.parse_args(REQUIRED)
    run = dataclasses.replace(Config(), rollout=dataclasses.replace(RolloutConfig(), max_new_tokens=24),
                              data=dataclasses.replace(DataConfig(), use_chat_template=False, system_prompt="be brief"))
    assert cli._settings(args, None).max_new_tokens == RolloutConfig().max_new_tokens
    assert cli._settings(args, run).max_new_tokens == 24
    assert cli._data_config(args, None) == DataConfig() and cli._data_config(args, run) == run.data
    given = cli.parse_args(REQUIRED + ["--no-chat-template", "--template", "Q: {question}"])
    assert cli._data_config(given, None) == dataclasses.replace(DataConfig(), use_chat_template=False,
                                                                template="Q: {question}")
    assert cli._reward_config(args, None).functions == RewardConfig().functions


def test_help_shows_defaults_and_what_model_takes(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse's line wrapping undone
    for shown in ("(default 600)", "(default 4)", "(default 0.6)", "(default 1234)", "(default 50)",
                  "(default: the run's, else 256)", "(default: the run's without overlong, else math_verify)",
                  "(default ours)", "(default float32)", "(default 64)"):
        assert shown in text, shown
    assert "resolve_model" not in text
    for form in ("HF folder", "org/name[@revision]", "pkg:", ".gguf", "RUN/checkpoints/N", "http(s)://"):
        assert form in text, form


@pytest.fixture
def suite(tmp_path):
    path = tmp_path / "sums.jsonl"
    path.write_text(json.dumps({"problem": "1+1=", "answer": "2"}) + "\n")
    return str(path)


def test_an_unset_key_variable_is_refused_as_the_trainer_refuses_it(suite, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("DRGRPO_TEST_KEY", raising=False)
    argv = ["--model", "http://a:1", "--suite", suite, "-o", str(tmp_path / "out"), "--api-key-env", "DRGRPO_TEST_KEY"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"{cli.PROG}: error: --api-key-env: environment variable DRGRPO_TEST_KEY is not set or empty"


def test_a_set_key_reaches_the_client(suite, tmp_path, monkeypatch, capsys):
    built = []

    class Built(Exception):
        pass

    def client(urls, **kwargs):
        built.append((kwargs["api_key"], kwargs["timeout_s"]))
        raise Built

    monkeypatch.setattr(cli, "RolloutClient", client)
    monkeypatch.setenv("DRGRPO_TEST_KEY", "secret")
    argv = ["--model", "http://a:1", "--suite", suite, "-o", str(tmp_path / "out"), "--api-key-env", "DRGRPO_TEST_KEY"]
    assert cli.main(argv) == 1 and "Built" in capsys.readouterr().err
    assert built == [("secret", RolloutConfig().timeout_s)]
