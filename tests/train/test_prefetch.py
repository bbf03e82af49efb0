"""One-step-off rollouts (rollout.async): the config key, the staleness rule, and end to end the versions each
step trains on and an exact resume after SIGKILL (the pending rollout regenerated, not saved)."""

from __future__ import annotations

import concurrent.futures
import json
import os

import numpy as np
import pytest

from drgrpo_jax.config.load import dump_config, load_config
from drgrpo_jax.errors import ConfigError, StaleWeightsError
from drgrpo_jax.train.prefetch import Prefetcher, check_fresh

from support.trainer_runs import kill_and_resume, start_trainer, trainer_overrides

BASE = ["model.path=m", "data.source=jsonl", "data.path=p.jsonl"]
ASYNC = ["rollout.async=true", "rollout.max_staleness=1", "algorithm.tis_cap=2.0"]

# ---------------------------------------------------------------------------------------------
# The config key (a Python keyword) and its rules
# ---------------------------------------------------------------------------------------------


def test_rollout_async_is_read_and_written_under_its_own_key(tmp_path):
    config = load_config(None, BASE + ASYNC)
    assert config.rollout.async_ is True and load_config(None, BASE).rollout.async_ is False
    text = dump_config(config)
    assert "  async: true" in text and "async_" not in text
    path = tmp_path / "run.yaml"
    path.write_text(text)
    assert load_config(path) == config
    path.write_text("rollout:\n  async: true\n  max_staleness: 1\nalgorithm:\n  tis_cap: 2.0\n")
    assert load_config(path, BASE).rollout.async_ is True


@pytest.mark.parametrize("overrides, key, reason", [
    (["rollout.async=true", "algorithm.tis_cap=2.0"], "rollout.max_staleness", ">= 1"),
    (["rollout.async=true", "rollout.max_staleness=1"], "algorithm.tis_cap", "must be set"),
    (["rollout.asyn=true"], "rollout.asyn", "did you mean rollout.async"),
])
def test_async_config_errors_name_the_key(overrides, key, reason):
    with pytest.raises(ConfigError) as error:
        load_config(None, BASE + overrides)
    assert error.value.key == key and reason in error.value.reason


def test_mis_high_also_corrects_the_lag():
    config = load_config(None, BASE + ["rollout.async=true", "rollout.max_staleness=1", "algorithm.mis_high=2.0"])
    assert config.rollout.async_


# ---------------------------------------------------------------------------------------------
# Staleness: a rollout more than max_staleness versions old is never trained on
# ---------------------------------------------------------------------------------------------


def test_check_fresh_reports_the_staleness_and_refuses_older_or_future_versions():
    assert check_fresh(np.array([3, 3]), 3, 0) == 0
    assert check_fresh(np.array([2, 3]), 3, 1) == 1
    with pytest.raises(StaleWeightsError, match="allows 3..3"):
        check_fresh(np.array([2, 3]), 3, 0)
    with pytest.raises(StaleWeightsError, match="versions 1..3"):
        check_fresh(np.array([1, 3]), 3, 1)
    with pytest.raises(StaleWeightsError):
        check_fresh(np.array([4]), 3, 1)  # a version the trainer has not pushed


def test_a_pending_rounds_error_waits_for_its_step():
    def fails():
        raise RuntimeError("service gone")

    with Prefetcher() as prefetcher:
        pending = prefetcher.launch(1, (), [], 0, fails)
        prefetcher.wait(pending)  # returns: the error belongs to the step that takes the round
        with pytest.raises(RuntimeError, match="service gone"):
            pending.future.result()
        done = prefetcher.launch(2, (), [[1]], 5, lambda x: x + 1, 41)
        prefetcher.wait(done)
        assert done.future.result() == 42 and done.data_position == 5 and done.step == 2
    assert isinstance(done.future, concurrent.futures.Future)


# ---------------------------------------------------------------------------------------------
# End to end: versions per step, and an exact resume
# ---------------------------------------------------------------------------------------------


def _rows(output_dir) -> tuple[list[dict], list[dict]]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "loss" in r], [r for r in rows if "loss" not in r]


def _reproducible(row: dict) -> dict:
    return {k: v for k, v in row.items() if "seconds" not in k and "per_second" not in k}


def _segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"drgrpo_weights_{pid}_")]


def _final_weights(folder) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, tiny_model, prompts_file):
    root = tmp_path_factory.mktemp("async")
    overrides = trainer_overrides(tiny_model, prompts_file, root / "uninterrupted", steps=4) + ASYNC
    process = start_trainer(overrides)
    _, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-3000:]
    return {"root": root, "dir": root / "uninterrupted", "pid": process.pid, "model": tiny_model,
            "prompts": prompts_file}


@pytest.mark.subprocess  # the trainer CLI and its generation service
@pytest.mark.slow  # one trainer run (~1-2 minutes on 2 busy cores)
def test_each_step_trains_on_the_previous_version_and_the_child_takes_pushes_from_memory(async_run):
    rows, eval_rows = _rows(async_run["dir"])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # Step k (1-based) trains version k-1's policy on a rollout of version k-2 (the first on version 0).
    assert [r["weight_version"] for r in rows] == [0, 0, 1, 2]
    assert [r["staleness"] for r in rows] == [0, 1, 1, 1]
    assert all(np.isfinite(r["tis_weight"]) and r["rollout_wait_seconds"] >= 0 for r in rows)
    assert [r["step"] for r in eval_rows] == [0, 2, 4]
    assert sorted(os.listdir(async_run["dir"] / "weights")) == ["v0"]  # versions 1.. went through shared memory
    if os.path.isdir("/dev/shm"):
        assert _segments_of(async_run["pid"]) == []


@pytest.mark.subprocess
@pytest.mark.slow  # a trainer run killed after its first checkpoint, then resumed (~2-3 minutes)
def test_a_killed_async_run_resumes_exactly(async_run):
    output_dir = async_run["root"] / "killed"
    overrides = trainer_overrides(async_run["model"], async_run["prompts"], output_dir, steps=4) + ASYNC
    killed, resumed = kill_and_resume(overrides, output_dir, checkpoint=2, timeout=900)
    for got, want in zip(_rows(output_dir), _rows(async_run["dir"])):
        assert [_reproducible(r) for r in got] == [_reproducible(r) for r in want]
    got, want = _final_weights(output_dir / "final"), _final_weights(async_run["dir"] / "final")
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    if os.path.isdir("/dev/shm"):  # the killed run's last segment was removed by the resumed one
        assert _segments_of(killed) == [] and _segments_of(resumed) == []
