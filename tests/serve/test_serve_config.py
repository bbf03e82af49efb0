"""The service's settings (drgrpo_jax/config/serve.py): its flags and its YAML are made from ServeConfig's fields,
and a bad key fails as a run config's does, naming serve.<key>."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from drgrpo_jax.config.serve import ServeConfig, add_flags, load_serve_config
from drgrpo_jax.errors import ConfigError


def test_every_flag_is_a_field_with_its_help_and_no_default_of_its_own():
    parser = argparse.ArgumentParser()
    add_flags(parser)
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    fields = {f.name: f for f in dataclasses.fields(ServeConfig) if f.metadata.get("flag", "") is not None}
    assert set(actions) == set(fields)
    for name, action in actions.items():
        assert action.default is None  # not given: the YAML's value, else the field's default
        if action.help != argparse.SUPPRESS:
            assert action.help.startswith(fields[name].metadata["help"]), name
    assert actions["weights_roots"].option_strings == ["--weights-root"]
    assert parser.parse_args(["--weights-root", "a", "--weights-root", "b"]).weights_roots == ["a", "b"]


def test_a_trainer_config_gives_the_model_and_flags_win(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"model": {"path": "/m", "dtype": "bfloat16", "tokenizer_path": None},
                                "run": {"output_dir": "/runs/a"}, "serve": {"max_batch_size": 4}}))
    config = load_serve_config(str(path), {"max_batch_size": 8, "port": None, "weights_roots": []})
    assert (config.model, config.dtype, config.tokenizer, config.max_batch_size) == ("/m", "bfloat16", "", 8)
    assert config.weights_roots == ()  # loopback: any path
    beyond = load_serve_config(str(path), {"host": "0.0.0.0", "allow_unauthenticated": True})
    assert beyond.weights_roots == ("/runs/a/weights",)  # beyond loopback: the run's weights folder only


@pytest.mark.parametrize("section, words", [
    ({"max_btch_size": 4}, "serve.max_btch_size: unknown key in"),
    ({"max_batch_size": "many"}, "serve.max_batch_size:"),
    ({"port": 70000}, "port: must be in [0, 65535]"),
])
def test_a_bad_serve_key_is_one_line_naming_it(tmp_path, section, words):
    path = tmp_path / "serve.yaml"
    path.write_text(json.dumps({"serve": {"model": "/m", **section}}))
    with pytest.raises(ValueError) as error:
        load_serve_config(str(path), {})
    assert words in str(error.value) and "\n" not in str(error.value)
    if words.startswith("serve."):
        assert isinstance(error.value, ConfigError)
