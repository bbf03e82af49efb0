"""`python -m drgrpo_jax.evaluate --engine`: the API of the service URLs reaches the rollout client."""

import json

import pytest

from drgrpo_jax.evaluate import cli


class _Built(Exception):
    """Stops the evaluation once its client is built."""


@pytest.fixture
def suite(tmp_path):
    path = tmp_path / "sums.jsonl"
    path.write_text(json.dumps({"problem": "1+1=", "answer": "2"}) + "\n")
    return str(path)


@pytest.mark.parametrize("flags, engine", [([], "ours"), (["--engine", "sglang"], "sglang"),
                                           (["--engine", "vllm"], "vllm")])
def test_the_engine_flag_reaches_the_client(flags, engine, suite, tmp_path, monkeypatch, capsys):
    built = []

    def client(urls, **kwargs):
        built.append((urls, kwargs["engine"]))
        raise _Built

    monkeypatch.setattr(cli, "RolloutClient", client)
    argv = ["--model", "http://a:1", "--suite", suite, "-o", str(tmp_path / "out"), *flags]
    assert cli.main(argv) == 1 and "_Built" in capsys.readouterr().err
    assert built == [(["http://a:1"], engine)]


def test_an_engine_other_than_ours_needs_service_urls(suite, tiny_model, capsys):
    assert cli.main(["--model", tiny_model, "--suite", suite, "--engine", "sglang"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--engine" in err and "service URLs" in err
