"""The rendered sbatch scripts on a real SLURM cluster: Debian's slurm-wlm as one node on localhost
(scripts/slurm/local_cluster.sh, as root). A services job and a two-task trainer job (`srun -n2`, start-up by JAX's
SLURM detection, gloo collectives on CPU) train the tiny model and match a one-task run's metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from support.paths import REPO, TESTS
from support.trainer_runs import trainer_overrides

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]  # a SLURM cluster and two trainer runs: ~4 minutes

MEASURED = ("seconds", "per_second", "rss")  # wall-clock and memory: facts of the process, not of the math


@pytest.fixture(scope="module")
def cluster():
    result = subprocess.run(["bash", os.path.join(REPO, "scripts", "slurm", "local_cluster.sh")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr  # e.g. no slurmctld: apt-get install -y slurm-wlm munge


def _job_env(devices: int) -> dict[str, str]:
    """What the jobs inherit (sbatch exports the submitting environment): CPU devices, gloo, tests/ importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, TESTS]), "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu",
           "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return env


def _wait(job: str, timeout: float) -> str:
    """The job's final state (sacct is not configured: scontrol while it is known, then squeue's absence)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
        state = next((w.split("=", 1)[1] for w in shown.split() if w.startswith("JobState=")), "GONE")
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"):
            return state
        time.sleep(2)
    subprocess.run(["scancel", job])
    pytest.fail(f"job {job} still running after {timeout} s")


def _slurm_run(tmp_path, inputs, processes: int) -> list[dict]:
    """Renders the sbatch scripts for `processes` tasks on one node, submits them, returns the metrics rows."""
    out, launch = tmp_path / f"run_{processes}", tmp_path / f"launch_{processes}"
    overrides = [o for o in trainer_overrides(str(inputs / "model"), str(inputs / "prompts.jsonl"), out, 2)
                 if not o.startswith("train.eval_every")] + ["train.eval_every=0", f"mesh.num_processes={processes}"]
    render = subprocess.run(
        [sys.executable, "-m", "drgrpo_jax.launch", "slurm", "--config", str(inputs / "base.yaml"), "--out",
         str(launch), "--services", "1", "--tasks-per-node", str(processes), "--gpus-per-node", "0", "--python",
         sys.executable, "--workdir", REPO, "--port", str(31000 + processes), *overrides],
        capture_output=True, text=True, cwd=REPO, env=_job_env(1), timeout=120)
    assert render.returncode == 0, render.stderr
    submit = subprocess.run(["bash", str(launch / "submit.sh")], capture_output=True, text=True,
                            env=_job_env(2 // processes), timeout=60)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.split()[-1]
    state = _wait(job, 900)
    logs = "".join(p.read_text()[-3000:] for p in sorted((launch / "logs").glob("*.log")))
    assert state == "COMPLETED", f"{state}\n{logs}"
    assert f"[process 1/{processes}]" in logs or processes == 1, logs  # two processes joined through JAX's detection
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_two_srun_tasks_match_one(cluster, tmp_path, tiny_model, prompts_file):
    (tmp_path / "base.yaml").write_text("model: {dtype: float32}\n")
    os.symlink(tiny_model, tmp_path / "model")
    os.symlink(prompts_file, tmp_path / "prompts.jsonl")
    one = _slurm_run(tmp_path, tmp_path, processes=1)
    two = _slurm_run(tmp_path, tmp_path, processes=2)
    assert [row["step"] for row in one] == [row["step"] for row in two] == [1, 2]
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        for key in a:
            if any(word in key for word in MEASURED) or a[key] is None:
                continue
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
