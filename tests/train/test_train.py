"""The trainer end to end through the real generation service child process: metrics, resume, errors."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import numpy as np
import pytest

from drgrpo_jax.rollout.record import HostCounters, correct_mask, host_share, left_pad, merge_host_rows, response_stats
from drgrpo_jax.seeds import step_seed
from drgrpo_jax.train.progress import folder_bytes

from support.gcs_emulator import bucket_objects, gcs_emulator
from support.paths import REPO
from support.tiny_models import write_tiny_qwen3_moe
from support.trainer_runs import services_of, start_trainer, trainer_overrides
from support.wandb_offline import wandb_offline_run

# ---------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------


def test_step_seeds_depend_on_seed_step_and_purpose_only():
    assert step_seed(0, 3, 0) == step_seed(0, 3, 0)
    assert len({step_seed(0, 3, 0), step_seed(1, 3, 0), step_seed(0, 4, 0), step_seed(0, 3, 1)}) == 4


def test_compile_memory_goes_back_to_the_os_only_while_training(monkeypatch):
    import jax

    from drgrpo_jax import host_memory

    calls = []
    monkeypatch.setattr(host_memory, "return_freed_memory", lambda: calls.append(1))
    fresh = float(time.time_ns() % 999_983)  # a constant of its own: a program no compile cache holds

    def compile_one(offset):
        jax.jit(lambda x: x * fresh + offset).lower(np.float32(0)).compile()

    with host_memory.returning_compile_memory():
        compile_one(1.0)
    assert calls == [1]
    compile_one(2.0)
    assert calls == [1]


def test_correctness_uses_the_correctness_component_else_a_positive_reward():
    components = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 1.0]], np.float32)
    np.testing.assert_array_equal(correct_mask(("math_verify", "format"), components), [True, False, False])
    np.testing.assert_array_equal(correct_mask(("mine", "format"), components), [True, True, True])
    np.testing.assert_array_equal(correct_mask(("mine",), np.array([[0.0], [2.0]])), [False, True])


def test_left_pad_repeats_each_prompt_for_its_group():
    ids, mask = left_pad([[5, 6], [7]], 3, 2)
    np.testing.assert_array_equal(ids, [[0, 5, 6], [0, 5, 6], [0, 0, 7], [0, 0, 7]])
    np.testing.assert_array_equal(mask, ids > 0)


def test_response_stats_split_lengths_and_say_null_when_a_side_is_empty():
    stats = response_stats(np.array([4, 10, 6]), np.array([False, True, False]), np.array([True, False, True]))
    assert stats == {"accuracy": 2 / 3, "response_length_mean": 20 / 3, "response_length_correct": 5.0,
                     "response_length_incorrect": 10.0, "truncated_fraction": 1 / 3}
    assert response_stats(np.array([3]), np.array([False]), np.array([False]))["response_length_correct"] is None


def test_host_shares_merge_back_into_the_one_host_rollout():
    """Contiguous equal shares; stacking each host's rows and merging restores prompt order; counters add up."""
    prompts, group, hosts = 6, 2, 3
    assert [host_share(prompts, hosts, h) for h in range(hosts)] == [(0, 2), (2, 4), (4, 6)]
    assert host_share(prompts, 1, 0) == (0, 6)
    whole = {"ids": np.arange(prompts * group * 3).reshape(prompts * group, 3),
             "lengths": np.arange(prompts * group, dtype=np.int32)}
    local = [{k: v[a * group:b * group] for k, v in whole.items()}
             for a, b in (host_share(prompts, hosts, h) for h in range(hosts))]
    merged = merge_host_rows({k: np.stack([x[k] for x in local]) for k in whole})
    np.testing.assert_array_equal(merged["ids"], whole["ids"])
    np.testing.assert_array_equal(merged["lengths"], whole["lengths"])
    counters = [HostCounters(("f", "g"), h + 1.0, 0.5, np.array([h, 1]), np.array([0, h])) for h in range(hosts)]
    stacked = {k: np.stack([c.arrays()[k] for c in counters]) for k in counters[0].arrays()}
    across = counters[0].across_hosts(stacked)  # parallel hosts: the slowest one's time, summed counts
    assert (across.rollout_seconds, across.reward_seconds) == (3.0, 0.5)
    np.testing.assert_array_equal(across.reward_timeouts_F, [3, 3])
    assert across.metrics() == {"reward/f_timeouts": 3, "reward/f_errors": 0, "reward/g_timeouts": 3,
                                "reward/g_errors": 3, "reward_timeouts": 6, "reward_errors": 3}
    added = counters[0] + counters[1]  # sequential rounds: times add up
    assert added.rollout_seconds == 3.0 and added.reward_timeouts_F.tolist() == [1, 2]
    with pytest.raises(ValueError, match="^rollout.prompts_per_step: 6 prompts do not split evenly over 4 hosts"):
        host_share(6, 4, 0)


@pytest.mark.parametrize("overrides, key, reason", [
    (["mesh.num_processes=3", "mesh.coordinator_address=h:1", "rollout.urls=[http://g:1]"],
     "rollout.prompts_per_step", "8 prompts do not split evenly over mesh.num_processes = 3"),
    (["mesh.num_processes=2", "mesh.coordinator_address=h:1"], "rollout.urls", "must list the generation services"),
    (["rollout.service_batch_size=0"], "rollout.service_batch_size", "must be >= 1"),
    (["mesh.data=4", "mesh.dcn_data=3"], "mesh.dcn_data", "3 does not divide mesh.data = 4"),
    (["mesh.dcn_data=0"], "mesh.dcn_data", "must be >= 1"),
    (["mesh.coordinator_address=auto", "mesh.num_processes=2"], "mesh.num_processes",
     "is detected with mesh.coordinator_address=auto"),
    (["mesh.coordinator_address=10.0.0.2"], "mesh.coordinator_address", "'10.0.0.2' is not host:port or auto"),
    (["mesh.coordinator_port=8476"], "mesh.coordinator_port", "is for mesh.coordinator_address=auto"),
    (["mesh.coordinator_address=auto", "mesh.coordinator_port=70000"], "mesh.coordinator_port",
     "70000 is not a port"),
])
def test_multi_host_config_errors_name_the_key(overrides, key, reason):
    from drgrpo_jax.config.load import load_config
    from drgrpo_jax.errors import ConfigError

    with pytest.raises(ConfigError, match=f"^{key}: {reason}"):
        load_config(None, ["model.path=m", *overrides])
    assert load_config(None, ["model.path=m", "rollout.service_batch_size=16"]).rollout.service_batch_size == 16


@pytest.mark.parametrize("output_dir, reason", [
    ("gs://Upper/run", "'gs://Upper/run' is neither a local folder nor gs://BUCKET/PATH"),
    ("gs://b/run", "'gs://b/run' is neither a local folder nor gs://BUCKET/PATH"),
    ("s3://bucket/run", "'s3://bucket/run' is neither a local folder nor gs://BUCKET/PATH"),
])
def test_a_remote_output_dir_is_checked_for_its_form_in_one_line(output_dir, reason, tmp_path, monkeypatch):
    """run.output_dir on a bucket: the URI's form is checked (nothing local is created); gcsfs must be installed."""
    from drgrpo_jax.config.rules import check_output_dir
    from drgrpo_jax.config.schema import RunConfig
    from drgrpo_jax.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"^run.output_dir: {reason}"):
        check_output_dir(RunConfig(output_dir=output_dir))
    check_output_dir(RunConfig(output_dir="gs://my-bucket_1.x/runs/a"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None if name == "gcsfs" else object())
    with pytest.raises(ConfigError, match=r"^run.output_dir: gs:// needs gcsfs: pip install -e '.\[gcs\]'$"):
        check_output_dir(RunConfig(output_dir="gs://my-bucket/runs/a"))
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# End to end through the CLI and the real service child process
# ---------------------------------------------------------------------------------------------

REQUIRED = ["step", "loss", "grad_norm", "reward_mean", "accuracy", "response_length_mean", "response_length_correct",
            "response_length_incorrect", "truncated_fraction", "kl", "entropy", "clip_fraction", "tokens_per_second",
            "rollout_seconds", "train_seconds", "weight_version", "peak_rss_gb"]
PROG_ERROR = "python -m drgrpo_jax.train: config error: "


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model, prompts_file):
    return {"model": tiny_model, "prompts": prompts_file, "root": tmp_path_factory.mktemp("train")}


def _overrides(inputs, output_dir, steps: int) -> list[str]:
    return trainer_overrides(inputs["model"], inputs["prompts"], output_dir, steps)


def _wait_gone(pid: int, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := services_of(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _rows(output_dir) -> tuple[list[dict], list[dict]]:
    """(training rows, eval rows) of metrics.jsonl."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval/accuracy" in r]


# The uninterrupted run also reports to W&B (offline) and an MLflow file store: the same scalars reach both.
TRACKED = ["run.report_to=[tensorboard,wandb,mlflow]", "run.project=tests"]


@pytest.fixture(scope="module")
def uninterrupted(inputs):
    output_dir = inputs["root"] / "uninterrupted"
    overrides = [*_overrides(inputs, output_dir, steps=4), *TRACKED,
                 f"run.mlflow_tracking_uri=file:{output_dir}/mlruns"]
    process = start_trainer(overrides, WANDB_MODE="offline", WANDB_SILENT="true")
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    return output_dir, process.pid, stderr


@pytest.mark.subprocess  # the trainer CLI and its generation service
def test_end_to_end_metrics_outputs_and_service_shutdown(uninterrupted, monkeypatch):
    output_dir, pid, stderr = uninterrupted
    train_rows, eval_rows = _rows(output_dir)
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    for row in train_rows:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, missing
        bad = {k: row[k] for k in REQUIRED if not (isinstance(row[k], (int, float)) and np.isfinite(row[k]))}
        assert not bad, bad
        assert row["staleness"] == 0 and row["reward/has_letter_a"] == row["reward_mean"]
    assert [r["weight_version"] for r in train_rows] == [0, 1, 2, 3]
    peaks = [r["peak_rss_gb"] for r in train_rows]  # the trainer's own high-water mark: JAX and a model at least
    assert peaks == sorted(peaks) and 0.2 < peaks[0] < 64, peaks
    assert [r["step"] for r in eval_rows] == [0, 2, 4]
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in eval_rows)
    # Greedy and train.eval_samples (default 4) sampled completions per held-out prompt.
    for row in eval_rows:
        assert row["eval/pass@1"] == pytest.approx(row["eval/avg@4"]) and row["eval/pass@1"] <= row["eval/pass@4"]
        assert 0.0 <= row["eval/sampled/truncated_fraction"] <= 1.0
    # The same scalars in MLflow's file store and the offline W&B run.
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads file stores only when told to
    client = MlflowClient(tracking_uri=f"file:{output_dir}/mlruns")
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")) == \
        [(r["step"], pytest.approx(r["loss"])) for r in train_rows]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/pass_at_4")) == [0, 2, 4]
    assert run.data.params["train.steps"] == "4" and run.info.status == "FINISHED"
    _, history = wandb_offline_run(str(output_dir / "wandb"))
    assert [(row["_step"], row["loss"]) for row in history if "loss" in row] == \
        [(r["step"], pytest.approx(r["loss"])) for r in train_rows]
    assert _wait_gone(pid) == []
    # The rest of the run directory.
    files = set(os.listdir(output_dir))
    assert {"config.yaml", "metrics.jsonl", "samples.jsonl", "tensorboard", "checkpoints", "weights", "final"} <= files
    assert sorted(os.listdir(output_dir / "checkpoints")) == ["2", "4"]
    # The child service took versions 1.. from shared memory (rollout.weight_sync=auto): only its first is on disk.
    assert sorted(os.listdir(output_dir / "weights")) == ["v0"]
    if os.path.isdir("/dev/shm"):  # the last segment is deleted when the run ends
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"drgrpo_weights_{pid}_")]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(output_dir / "tensorboard"))
    with open(output_dir / "samples.jsonl") as f:
        samples = [json.loads(line) for line in f]
    assert {s["step"] for s in samples} == {2, 4} and len(samples) == 2 * 2 * 4
    from drgrpo_jax.config.load import load_config

    assert load_config(output_dir / "config.yaml").train.steps == 4
    import transformers

    transformers.AutoTokenizer.from_pretrained(output_dir / "final")
    transformers.AutoModelForCausalLM.from_pretrained(output_dir / "final")
    assert "Traceback" not in stderr
    assert all(r["old_logprob_seconds"] > 0 for r in train_rows)  # two minibatches per rollout: the pass runs
    import jax

    from drgrpo_jax.models.precision import resolve_compute_dtype

    # model.compute_dtype=auto, resolved on this machine; the line is the trainer's own report of it.
    assert f"model.compute_dtype: {resolve_compute_dtype('auto', 'float32', jax.devices()[0])}" in stderr
    # The run talks: each start-up phase with its time, the evaluations with what their figures mean, an ETA from
    # steady-state steps, and a closing summary that names every output with its size.
    for phase in ("loading the data", "loading the model", "starting the generation service"):
        assert re.search(rf"\[drgrpo\] {phase}[^\n]*: \d+\.\d s", stderr), phase
    assert "evaluation after step 0 on" in stderr and "pass@k: share of problems" in stderr
    assert "evaluation after step 4 on" in stderr and "step 1 compiles the training step" in stderr
    assert re.search(r"eta \d+(\.\d)? (s|min)", stderr)
    summary = stderr[stderr.index("[drgrpo] done: 4 steps"):]
    for output in ("metrics.jsonl", "tensorboard --logdir", "plot_run.py", "final model:", "checkpoints:"):
        assert output in summary, output
    assert re.search(r"checkpoints: \S+ \(\d+\.\d+ (MB|GB); steps 2, 4;", summary), summary


@pytest.mark.subprocess
@pytest.mark.slow  # one more trainer run with its service (~1 minute)
def test_ignore_eos_runs_every_training_completion_to_the_budget(inputs):
    output_dir = inputs["root"] / "ignore_eos"
    process = start_trainer(_overrides(inputs, output_dir, steps=1) + ["rollout.ignore_eos=true",
                                                                       "train.eval_every=0"])
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    (row,), _ = _rows(output_dir)
    assert row["response_length_mean"] == 12 and row["truncated_fraction"] == 1.0, row


def _weights(folder) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def _reproducible(row: dict) -> dict:
    """A metrics row without what the machine measures: timings and the process's memory high-water mark."""
    return {k: v for k, v in row.items() if "seconds" not in k and "per_second" not in k and k != "peak_rss_gb"}


@pytest.mark.subprocess
@pytest.mark.slow  # two more trainer runs, each with its service child process (146 s measured on 2 busy cores)
def test_resume_after_sigkill_reproduces_the_uninterrupted_run(inputs, uninterrupted):
    reference_dir = uninterrupted[0]
    output_dir = inputs["root"] / "killed"
    process = start_trainer(_overrides(inputs, output_dir, steps=4))
    checkpoint = output_dir / "checkpoints" / "2"
    while not checkpoint.exists() and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (output_dir / "final").exists()
    assert _wait_gone(process.pid) == []  # the service noticed its parent died

    resumed = start_trainer(_overrides(inputs, output_dir, steps=4))
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-3000:]
    for (got, want) in zip(_rows(output_dir), _rows(reference_dir)):
        assert [_reproducible(r) for r in got] == [_reproducible(r) for r in want]
    got, want = _weights(output_dir / "final"), _weights(reference_dir / "final")
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.subprocess  # two short trainer runs, each with its service
def test_weights_only_checkpoints_are_a_third_of_the_disk_and_resume_with_fresh_moments(inputs, uninterrupted):
    output_dir, slim = inputs["root"] / "weights_only", ["train.checkpoint_optimizer=false", "train.eval_every=0"]
    first = start_trainer(_overrides(inputs, output_dir, steps=2) + slim)
    _, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr[-3000:]
    full = folder_bytes(str(uninterrupted[0] / "checkpoints" / "2"))
    assert folder_bytes(str(output_dir / "checkpoints" / "2")) < 0.45 * full  # AdamW's two moments are gone
    resumed = start_trainer(_overrides(inputs, output_dir, steps=3) + slim)
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-3000:]
    assert "resuming from the checkpoint of step 2" in stderr and "optimizer's moments start afresh" in stderr
    assert [r["step"] for r in _rows(output_dir)[0]] == [1, 2, 3]


@pytest.mark.subprocess
@pytest.mark.slow  # two more trainer runs, each with its service child process
def test_sigterm_saves_exits_with_the_restart_code_and_the_relaunch_reproduces_the_run(inputs, uninterrupted):
    """A preempted one-process run (SIGTERM after step 1) saves the step it reached, exits 42 with one line, and the
    same command resumes it to the uninterrupted run's metrics and weights."""
    from drgrpo_jax.checkpoint import RESTART_EXIT_CODE

    reference_dir, output_dir = uninterrupted[0], inputs["root"] / "preempted"
    overrides = [*_overrides(inputs, output_dir, steps=4), "train.save_every=4"]  # only preemption saves mid-run
    process = start_trainer(overrides)
    while '"loss"' not in ((output_dir / "metrics.jsonl").read_text() if (output_dir / "metrics.jsonl").exists()
                           else ""):  # step 1's row
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == RESTART_EXIT_CODE == 42, stderr[-3000:]
    saved = int(stderr.strip().splitlines()[-1].split("saved step ")[1].split(";")[0])
    assert 1 < saved < 4 and sorted(os.listdir(output_dir / "checkpoints")) == [str(saved)], stderr[-3000:]
    assert [r["step"] for r in _rows(output_dir)[0]] == list(range(1, saved + 1))  # flushed up to the saved step
    assert not (output_dir / "final").exists() and _wait_gone(process.pid) == []

    resumed = start_trainer(overrides)
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-3000:]
    for (got, want) in zip(_rows(output_dir), _rows(reference_dir)):
        assert [_reproducible(r) for r in got] == [_reproducible(r) for r in want]
    got, want = _weights(output_dir / "final"), _weights(reference_dir / "final")
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.fixture
def bucket(monkeypatch):
    with gcs_emulator() as (url, env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        yield url, env


def _jsonl(content: bytes) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in content.decode().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval/accuracy" in r]


@pytest.mark.subprocess
@pytest.mark.slow  # two more trainer runs, each with its service child process
def test_a_run_on_a_bucket_is_preempted_resumes_from_it_and_matches_the_local_run(inputs, uninterrupted, bucket):
    """run.output_dir=gs://...: checkpoints (orbax through tensorstore), metrics.jsonl, samples.jsonl, TensorBoard,
    config.yaml and the final export all land in the bucket; a SIGTERM'd run resumes from the bucket's checkpoint
    to the local uninterrupted run's metrics and weights."""
    from safetensors.numpy import load

    from drgrpo_jax.checkpoint import RESTART_EXIT_CODE

    url, env = bucket
    reference_dir, run = uninterrupted[0], "gs://drgrpo-test/runs/a"
    overrides = [*_overrides(inputs, run, steps=4), "train.save_every=4"]  # only preemption saves mid-run
    process = start_trainer(overrides, **env)
    while b'"loss"' not in bucket_objects(url, "runs/a/").get("metrics.jsonl", b""):  # step 1's row, in the bucket
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == RESTART_EXIT_CODE, stderr[-3000:]
    saved = int(stderr.strip().splitlines()[-1].split("saved step ")[1].split(";")[0])
    objects = bucket_objects(url, "runs/a/")
    assert {name.split("/")[1] for name in objects if name.startswith("checkpoints/")} == {str(saved)}
    assert [r["step"] for r in _jsonl(objects["metrics.jsonl"])[0]] == list(range(1, saved + 1))
    assert not any(name.startswith("final/") for name in objects)

    resumed = start_trainer(overrides, **env)
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-3000:]
    objects = bucket_objects(url, "runs/a/")
    for got, want in zip(_jsonl(objects["metrics.jsonl"]), _rows(reference_dir)):
        assert [_reproducible(r) for r in got] == [_reproducible(r) for r in want]
    assert {json.loads(line)["step"] for line in objects["samples.jsonl"].decode().splitlines()} == {2, 4}
    assert {name.split("/")[1] for name in objects if name.startswith("checkpoints/")} == {str(saved), "4"}
    assert any(name.startswith("tensorboard/events.out.tfevents") for name in objects)
    assert b"train:\n" in objects["config.yaml"] and "final/config.json" in objects
    got, want = load(objects["final/model.safetensors"]), _weights(reference_dir / "final")
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert not os.path.exists(os.path.join(REPO, "gs:"))  # nothing went to a local folder named like the URI


@pytest.mark.slow
@pytest.mark.subprocess  # one more trainer run, its service killed mid-rollout (~2 minutes on 2 busy cores)
def test_the_run_survives_its_keyed_service_being_killed_mid_rollout(inputs, uninterrupted):
    """SIGKILL the child service once step 1 is logged (step 2's rollout): the run restarts it and finishes."""
    output_dir = inputs["root"] / "service_killed"
    process = start_trainer(_overrides(inputs, output_dir, steps=4) + ["rollout.api_key_env=DRGRPO_TEST_KEY"],
                            DRGRPO_TEST_KEY="train-key-1")
    metrics = output_dir / "metrics.jsonl"
    while process.poll() is None and not (metrics.exists() and metrics.read_text().count('"loss"') >= 1):
        time.sleep(0.05)
    services = services_of(process.pid)
    assert len(services) == 1, "the run ended before its service could be killed"
    with open(f"/proc/{services[0]}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    assert b"--api-key-env" in argv and b"DRGRPO_TEST_KEY" in argv and b"train-key-1" not in b" ".join(argv)
    os.kill(services[0], signal.SIGKILL)
    _, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-3000:]
    train_rows, _ = _rows(output_dir)
    reference_rows, _ = _rows(uninterrupted[0])
    assert [r["step"] for r in train_rows] == [r["step"] for r in reference_rows] == [1, 2, 3, 4]
    for row in train_rows:
        bad = {k: row[k] for k in REQUIRED if not (isinstance(row[k], (int, float)) and np.isfinite(row[k]))}
        assert not bad, bad
    assert train_rows[0]["service_restarts"] == 0 and train_rows[-1]["service_restarts"] == 1
    assert "restarting it on weight version" in stderr
    assert _wait_gone(process.pid) == []


@pytest.mark.subprocess  # the trainer CLI and its generation service
def test_bad_model_path_task_and_url_fail_in_one_line(inputs, tmp_path):
    base = _overrides(inputs, tmp_path / "run", steps=1)
    moe = write_tiny_qwen3_moe(str(tmp_path / "moe"))
    cases = {
        "model.path": [f"model.path={tmp_path / 'missing'}"],
        # A mixture's MLP is its experts: refused before the model loads (its config.json read, not its weights)
        "model.lora.targets": [f"model.path={moe}", "model.lora.rank=4", "model.lora.targets=[q_proj,up_proj]"],
        "data.task": ["data.source=reasoning_gym", "data.task=no_such_task", "data.size=10",
                      "reward.functions=[format]"],
        "rollout.urls": ["rollout.urls=[http://127.0.0.1:9]"],
    }
    processes = {key: start_trainer(base + extra) for key, extra in cases.items()}
    for key, process in processes.items():
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 2, (key, stderr[-2000:])
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert lines[-1].startswith(PROG_ERROR + key + ":"), (key, lines[-1])
        assert "Traceback" not in stderr, key
    assert not (tmp_path / "run" / "checkpoints").exists() or not os.listdir(tmp_path / "run" / "checkpoints")


# ---------------------------------------------------------------------------------------------
# scripts/plot_run.py on synthetic runs
# ---------------------------------------------------------------------------------------------


def _synthetic_run(path, slope: float) -> str:
    os.makedirs(path)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "eval/accuracy": 0.1, "eval/avg@4": 0.2, "eval/pass@1": 0.2, "eval/pass@2": 0.3,
                            "eval/pass@4": 0.4}) + "\n")
        for step in range(1, 6):
            f.write(json.dumps({"step": step, "loss": 0.1, "reward_mean": slope * step, "accuracy": slope * step,
                                "response_length_correct": None if step == 1 else 20 + step,
                                "response_length_incorrect": 40 - step, "kl": 0.0, "approx_kl": 0.01 * step,
                                "grad_norm": 1.0 / step}) + "\n")
    return str(path)


def test_plot_run_overlays_runs_into_a_png(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_run", os.path.join(REPO, "scripts", "plot_run.py"))
    plot_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_run)
    runs = [_synthetic_run(tmp_path / "dr_grpo", 0.1), _synthetic_run(tmp_path / "grpo", 0.05)]
    train, evals = plot_run.read_metrics(runs[0])
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5] and [r["step"] for r in evals] == [0]
    assert plot_run._kl_key(train) == "approx_kl"
    assert plot_run.sampled_eval_keys(evals) == ["eval/avg@4", "eval/pass@4"]  # avg@k and the largest pass@k
    assert plot_run.sampled_eval_keys([{"step": 0, "eval/accuracy": 0.5}]) == []  # greedy-only evaluations
    output = tmp_path / "out" / "curves.png"
    assert plot_run.main([*runs, "-o", str(output)]) == 0
    with open(output, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(output).shape
    assert (height, width) == (880, 1320)
    assert plot_run.main([str(tmp_path / "nope"), "-o", str(output)]) == 2


def test_plot_run_draws_the_tool_calls_of_a_run_with_tools(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_run", os.path.join(REPO, "scripts", "plot_run.py"))
    plot_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_run)
    plain = _synthetic_run(tmp_path / "plain", 0.1)
    tools = _synthetic_run(tmp_path / "tools", 0.1)
    rows = [json.loads(line) for line in open(os.path.join(tools, "metrics.jsonl"))]
    with open(os.path.join(tools, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(dict(row, **({"episode/tool_calls": 0.2 * row["step"]} if "loss" in row else {})))
                     + "\n" for row in rows)
    figures = []
    monkeypatch.setattr(plot_run.plt, "close", figures.append)
    plot_run.plot_runs([plain, tools], str(tmp_path / "curves.png"))
    _, labels = figures[0].axes[0].get_legend_handles_labels()
    assert [label for label in labels if "tool calls" in label] == ["tools tool calls per episode"]


def test_weight_publisher_keeps_the_newest_versions_and_drops_stale_ones(tmp_path):
    from flax import nnx

    from drgrpo_jax.models.config import DecoderConfig
    from drgrpo_jax.models.transformer import Transformer
    from drgrpo_jax.rollout.weight_push import WeightPublisher

    config = DecoderConfig(family="llama", vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=16)
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
    publisher = WeightPublisher(str(tmp_path), graphdef, keep=2)
    for version in range(4):
        publisher.publish(params, version)
    assert sorted(os.listdir(tmp_path)) == ["v2", "v3"]
    publisher.publish(params, 1)  # a resume from step 1 after a run that got to v3: v2 and v3 are stale
    assert sorted(os.listdir(tmp_path)) == ["v1"]
    assert os.path.isfile(tmp_path / "v1" / "config.json")


def test_weight_publisher_mirrors_each_version_to_run_weights_dir(tmp_path):
    """run.weights_dir: each version is copied there (through etils.epath, as gs:// would be); that path is pushed."""
    from flax import nnx

    from drgrpo_jax.models.config import DecoderConfig
    from drgrpo_jax.models.transformer import Transformer
    from drgrpo_jax.rollout.weight_push import WeightPublisher

    config = DecoderConfig(family="llama", vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=16)
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
    for mirror, shared in [(str(tmp_path / "shared"), tmp_path / "shared"),
                           ("file://" + str(tmp_path / "bucket"), tmp_path / "bucket")]:
        publisher = WeightPublisher(str(tmp_path / "local"), graphdef, keep=2, mirror=mirror)
        paths = [publisher.publish(params, version) for version in range(3)]
        assert paths == [f"{mirror}/v{v}" for v in range(3)]
        assert sorted(os.listdir(shared)) == ["v1", "v2"] and sorted(os.listdir(tmp_path / "local")) == ["v1", "v2"]
        assert sorted(os.listdir(shared / "v2")) == sorted(os.listdir(tmp_path / "local" / "v2"))
        assert (shared / "v2" / "model.safetensors").read_bytes() == \
            (tmp_path / "local" / "v2" / "model.safetensors").read_bytes()
