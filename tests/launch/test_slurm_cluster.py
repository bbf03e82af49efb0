"""The rendered sbatch scripts on a real SLURM cluster: Debian's slurm-wlm as one node on localhost
(scripts/slurm/local_cluster.sh, as root). A services job and a two-task trainer job (`srun -n2`, start-up by JAX's
SLURM detection, gloo collectives on CPU) train the tiny model and match a one-task run's metrics; the same job,
sent the time limit's warning mid-run, saves on both tasks, exits 42, requeues itself and resumes exactly; and a
stand-in trainer whose tasks exit 42 seconds apart still requeues."""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from drgrpo_jax.config.load import load_config
from drgrpo_jax.launch import slurm

from support.paths import REPO, TESTS
from support.trainer_runs import trainer_overrides

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]  # a SLURM cluster and five trainer starts: ~4 minutes

MEASURED = ("seconds", "per_second", "rss")  # wall-clock and memory: facts of the process, not of the math
STEPS = 2  # the preempted run saves step 1 and its requeued run does step 2
IN_PROGRESS = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED")


@pytest.fixture(scope="module")
def cluster():
    result = subprocess.run(["bash", os.path.join(REPO, "scripts", "slurm", "local_cluster.sh")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr  # e.g. no slurmctld: apt-get install -y slurm-wlm munge


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_model, prompts_file):
    """A folder with base.yaml, the tiny model and the prompts, shared by every job of the module."""
    folder = tmp_path_factory.mktemp("slurm_inputs")
    (folder / "base.yaml").write_text("model: {dtype: float32}\n")
    os.symlink(tiny_model, folder / "model")
    os.symlink(prompts_file, folder / "prompts.jsonl")
    return folder


@pytest.fixture(scope="module")
def two_tasks(cluster, inputs, tmp_path_factory) -> list[dict]:
    """The uninterrupted two-task run's metrics: what the one-task run and the preempted run must equal."""
    folder = tmp_path_factory.mktemp("two_tasks")
    job = _submit(folder, inputs, processes=2)
    _finish(folder, job)
    return _metrics(folder)


def _job_env(devices: int) -> dict[str, str]:
    """What the jobs inherit (sbatch exports the submitting environment): CPU devices, gloo, tests/ importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, TESTS]), "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu",
           "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return env


def _show(job: str) -> dict[str, str]:
    """`scontrol show job`'s fields (sacct is not configured); {} once SLURM forgot the job."""
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    return dict(word.split("=", 1) for word in shown.split() if "=" in word)


def _submit(folder, inputs, processes: int) -> str:
    """Renders the sbatch scripts for `processes` tasks on one node into folder/launch, submits them (the run
    writes folder/run), returns the trainer's job id."""
    overrides = [o for o in trainer_overrides(str(inputs / "model"), str(inputs / "prompts.jsonl"), folder / "run",
                                              STEPS)
                 if not o.startswith("train.eval_every")] + ["train.eval_every=0", f"mesh.num_processes={processes}"]
    render = subprocess.run(
        [sys.executable, "-m", "drgrpo_jax.launch", "slurm", "--config", str(inputs / "base.yaml"), "--out",
         str(folder / "launch"), "--services", "1", "--tasks-per-node", str(processes), "--gpus-per-node", "0",
         "--python", sys.executable, "--workdir", REPO, "--port", str(31000 + processes),
         "--cpus-per-task", "1", "--no-exclusive", *overrides],  # the one node's 8 CPUs hold both jobs
        capture_output=True, text=True, cwd=REPO, env=_job_env(1), timeout=120)
    assert render.returncode == 0, render.stderr
    submit = subprocess.run(["bash", str(folder / "launch" / "submit.sh")], capture_output=True, text=True,
                            env=_job_env(2 // processes), timeout=60)
    assert submit.returncode == 0, submit.stderr
    return submit.stdout.split()[-1]


def _logs(folder) -> str:
    return "".join(p.read_text() for p in sorted((folder / "launch" / "logs").glob("*.log")))


def _finish(folder, job: str, timeout: float = 600) -> dict[str, str]:
    """Waits for the job to end, asserts it completed, returns its last `scontrol show job` fields."""
    deadline = time.monotonic() + timeout
    while (fields := _show(job)).get("JobState", "GONE") in IN_PROGRESS:
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job])
            pytest.fail(f"job {job} still running after {timeout} s\n{_logs(folder)[-3000:]}")
        time.sleep(2)
    assert fields.get("JobState") == "COMPLETED", f"{fields.get('JobState')}\n{_logs(folder)[-3000:]}"
    return fields


def _metrics(folder) -> list[dict]:
    with open(folder / "run" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _assert_same_metrics(rows: list[dict], reference: list[dict]) -> None:
    assert [row["step"] for row in rows] == [row["step"] for row in reference] == list(range(1, STEPS + 1))
    for a, b in zip(reference, rows):
        assert a.keys() == b.keys()
        for key in a:
            if any(word in key for word in MEASURED) or a[key] is None:
                continue
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (b["step"], key)


def test_two_srun_tasks_match_one(two_tasks, inputs, tmp_path):
    job = _submit(tmp_path, inputs, processes=1)
    _finish(tmp_path, job)
    _assert_same_metrics(_metrics(tmp_path), two_tasks)


def test_time_limit_signal_saves_requeues_and_resumes(two_tasks, inputs, tmp_path):
    """`scancel --batch --signal=TERM` is what `--signal=B:TERM@S` sends before the time limit: the batch shell's
    trap hands TERM to both tasks once the trainers run (their checkpoints folder exists), they save the same step
    and exit 42, the shell requeues the job, and the second run resumes from that step to the end."""
    job = _submit(tmp_path, inputs, processes=2)
    deadline = time.monotonic() + 300
    while not (tmp_path / "run" / "checkpoints").exists():  # made after jax.distributed is up: TERM is a notice
        assert _show(job).get("JobState") in IN_PROGRESS and time.monotonic() < deadline, _logs(tmp_path)[-3000:]
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=TERM", job], check=True, timeout=30)
    fields = _finish(tmp_path, job)
    logs = _logs(tmp_path)
    assert fields["Restarts"] == "1", logs[-3000:]
    saved = re.findall(r"preempted: saved step (\d+); relaunch", logs)  # one line from each task
    assert saved == ["1", "1"], logs[-3000:]
    exited = "tasks 0-1: Exited with exit code 42" in logs or all(  # srun's report: one line, or one a task
        f"task {task}: Exited with exit code 42" in logs for task in (0, 1))
    assert exited, logs[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "1").is_dir()  # off train.save_every's cadence: the preemption's
    for process in (0, 1):  # the first run did step 1 on both processes, the requeued run step 2 only (resumed)
        assert [logs.count(f"[process {process}/2] step {step}:") for step in (1, 2)] == [1, 1], logs[-3000:]
    _assert_same_metrics(_metrics(tmp_path), two_tasks)


STRAGGLER = """#!/bin/bash
# A stand-in trainer: both tasks exit 42, task 0 five seconds after task 1 (a slower teardown); the requeued run ends.
[ "${SLURM_RESTART_COUNT:-0}" = 0 ] || exit 0
[ "$SLURM_PROCID" = 1 ] || sleep 5
exit 42
"""


def test_a_task_that_exits_42_late_still_requeues(cluster, inputs, tmp_path):
    """srun waits for every task's 42 (with --kill-on-bad-exit it killed the later ones at the first, exited with
    their signal, and the preempted job failed instead of requeueing)."""
    python = tmp_path / "python"
    python.write_text(STRAGGLER)
    python.chmod(0o755)
    (tmp_path / "health").write_text("ok")  # a stand-in service: GET /health answers 200
    service = http.server.ThreadingHTTPServer(  # on the node's name: the launcher refuses loopback URLs
        ("", 0), functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=service.serve_forever, daemon=True).start()
    overrides = trainer_overrides(str(inputs / "model"), str(inputs / "prompts.jsonl"), tmp_path / "run", STEPS)
    config = load_config(str(inputs / "base.yaml"), [  # the coordinator: a stand-in, as the launch CLI passes
        *overrides, "mesh.num_processes=2", "mesh.coordinator_address=detected-at-launch:8476",
        f"rollout.urls=[http://{socket.gethostname()}:{service.server_port}]"])
    options = slurm.SlurmOptions(str(tmp_path / "launch"), REPO, python=str(python), tasks_per_node=2, gpus_per_node=0,
                                 cpus_per_task=1, exclusive=False)
    (tmp_path / "launch").mkdir()
    for name, text in slurm.render(config, options).items():
        (tmp_path / "launch" / name).write_text(text)
    submit = subprocess.run(["bash", str(tmp_path / "launch" / "submit.sh")], capture_output=True, text=True,
                            timeout=60)
    assert submit.returncode == 0, submit.stderr
    try:
        assert _finish(tmp_path, submit.stdout.split()[-1], timeout=120)["Restarts"] == "1", _logs(tmp_path)
    finally:
        service.shutdown()
