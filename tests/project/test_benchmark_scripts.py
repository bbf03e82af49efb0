"""Every script in benchmarks/ runs at a toy size and prints its one JSON line (`-m slow`: minutes, real weights)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

# script -> arguments small enough for a smoke run; every script in benchmarks/ but the helpers is here.
SMOKE_ARGS = {
    "attention": ["--rows", "1", "--lengths", "64", "--heads", "2,1,16", "--repeats", "1"],
    "logprobs": ["--batch", "2", "--length", "32", "--dim", "64", "--vocab", "512"],
    "loss_fn": ["--rows", "8", "--tokens", "64", "--repeats", "2"],
    "model_step": ["--layers", "1", "--rows", "2", "--seq", "16", "--decode-batch", "2", "--cache", "16",
                   "--decode-filled", "8", "--repeats", "1", "--decode-repeats", "1", "--skip-torch"],
    "sampler": ["--batch", "2", "--new-tokens", "4", "--dtypes", "float32", "--repeats", "1"],
    "train_step": ["--rows", "2", "--prompt", "8", "--response", "8", "--repeats", "1"],
    "long_context": ["--lengths", "1x160", "--sampler-prompts", "2", "--sampler-new-tokens", "8", "--timeout", "600"],
    "rl_step": ["--steps", "2", "--prompts", "2", "--group", "2", "--budget", "4", "--micro-batches", "1",
                "--dtypes", "float32"],
    "prefill_memory": ["--lengths", "1100"],
    "quickstart": ["train.steps=1", "train.eval_every=0", "rollout.prompts_per_step=2", "rollout.max_new_tokens=8"],
    "serve_burst": ["--random-weights", "--burst", "2", "--client-timeout-s", "2", "--duration-s", "10",
                    "--request-timeout-s", "10", "--no-warmup"],
    # Both algorithms, one seed, one step; run (and rerun) by its own test below, in a temporary --out.
    "length_bias": ["--seeds", "0", "--steps", "1", "--prompts", "1", "--group", "2", "--budget", "16",
                    "--train-size", "4", "--eval-size", "2", "--eval-samples", "2", "--micro-batches", "1"],
}
OWN_TEST = {"length_bias"}  # scripts whose smoke run needs more than one plain call
HELPERS = {"_common", "record"}  # shared code and the recorder (tests/project/test_benchmark_records.py)


def test_every_benchmark_script_has_a_smoke_run():
    scripts = {path.stem for path in (ROOT / "benchmarks").glob("*.py")} - HELPERS
    assert scripts == set(SMOKE_ARGS)


def _run_benchmark(script: str, *args: str) -> tuple[dict, str]:
    """(the one JSON line the script printed, its stderr)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("XLA_FLAGS", None)  # the benchmarks run on the real CPU device, not the tests' 8 fake ones
    finished = subprocess.run([sys.executable, f"benchmarks/{script}.py", *SMOKE_ARGS[script], *args], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=1200)
    assert finished.returncode == 0, finished.stderr[-3000:]
    lines = [line for line in finished.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, finished.stdout[-2000:]
    record = json.loads(lines[0])
    assert script in record.get("benchmark", "")
    assert not _worker_errors(record), _worker_errors(record)  # a worker's failure is reported, not raised
    return record, finished.stderr


@pytest.mark.parametrize("script", sorted(set(SMOKE_ARGS) - OWN_TEST))
def test_benchmark_prints_one_json_line(script):
    _run_benchmark(script)


def test_length_bias_trains_both_algorithms_and_a_rerun_skips_finished_runs(tmp_path):
    record, stderr = _run_benchmark("length_bias", "--out", str(tmp_path))
    assert stderr.count("length_bias.py: training") == 2, stderr[-3000:]
    assert sorted(record["runs"]) == ["dr_grpo-seed0", "grpo-seed0"]
    for run in record["runs"].values():
        assert run["done"] and run["curves"]["step"] == [1]
        assert run["curves"]["response_length_incorrect"][0] is not None or run["curves"]["accuracy"] == [1.0]
        assert 0 <= run["curves"]["truncated_fraction"][0] <= 1
        assert {"accuracy", "avg@2", "pass@2"} <= set(run["eval"]["before"]) & set(run["eval"]["after"])
    assert set(record["summary"]) == {"grpo", "dr_grpo"}
    assert 0 < record["prompt_tokens"]["min"] <= record["prompt_tokens"]["max"] <= 256
    assert json.loads((tmp_path / "length_bias.json").read_text()) == record
    again, stderr = _run_benchmark("length_bias", "--out", str(tmp_path))
    assert "training" not in stderr and again["runs"] == record["runs"]


def _worker_errors(node) -> list[str]:
    """Every {"error": ...} a script reported for a side that failed, anywhere in its record."""
    if isinstance(node, dict):
        return ([node["error"]] if "error" in node else []) + [e for v in node.values() for e in _worker_errors(v)]
    if isinstance(node, list):
        return [e for v in node for e in _worker_errors(v)]
    return []
