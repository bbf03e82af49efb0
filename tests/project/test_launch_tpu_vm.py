"""scripts/launch_tpu_pod.sh against a stand-in `gcloud` that runs each worker's part here (support/stand_in_gcloud.py).

The workers' `python3` is a stand-in too: `-m drgrpo_jax.train` records its arguments and sleeps, `-m
drgrpo_jax.serve` answers /health on its --port. What a real TPU VM does (ssh, libtpu, JAX's pod detection) is not
tested here.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from support.paths import REPO, TESTS

pytestmark = pytest.mark.subprocess  # every test runs the launcher, whose workers start processes

FAKE_PYTHON = """#!{python}
import http.server, json, os, sys, time
with open(os.path.join(os.environ["HOME"], "argv.jsonl"), "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd()}}) + "\\n")
print("stand-in", sys.argv[2], "on worker", os.environ["TPU_WORKER_ID"], flush=True)
if sys.argv[2] == "drgrpo_jax.serve":
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
time.sleep(300)
"""


@pytest.fixture
def cluster(tmp_path):
    """A checkout with uncommitted edits (the launcher copied in), the stand-in gcloud first on PATH."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "scripts", "launch_tpu_pod.sh"), repo / "scripts")
    for name, text in {"edited.txt": "committed\n", "deleted.txt": "gone\n", ".gitignore": "ignored.txt\n"}.items():
        (repo / name).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    (repo / "edited.txt").write_text("edited, not committed\n")
    (repo / "untracked.txt").write_text("new\n")
    (repo / "ignored.txt").write_text("ignored\n")
    (repo / "deleted.txt").unlink()
    bin_dir, worker_bin, root = tmp_path / "bin", tmp_path / "worker_bin", tmp_path / "tpus"
    for folder in (bin_dir, worker_bin, root):
        folder.mkdir()
    (bin_dir / "gcloud").write_text(f"#!/bin/sh\nexec {sys.executable} {TESTS}/support/stand_in_gcloud.py \"$@\"\n")
    (worker_bin / "python3").write_text(FAKE_PYTHON.format(python=sys.executable))
    for script in (bin_dir / "gcloud", worker_bin / "python3"):
        script.chmod(0o755)
    (tmp_path / "run.yaml").write_text("model: {dtype: bfloat16}\n")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_TPU_ROOT": str(root),
           "FAKE_WORKER_BIN": str(worker_bin)}
    return tmp_path, env


def launch(cluster, *args: str, **env: str) -> subprocess.CompletedProcess:
    tmp_path, base = cluster
    return subprocess.run(["bash", str(tmp_path / "repo" / "scripts" / "launch_tpu_pod.sh"), "--tpu", "pod", "--zone",
                           "z", "--install", "true", "--retry-delay", "0", "--stop-grace", "5", *args],
                          capture_output=True, text=True, timeout=120, env={**base, **env})


def workers(cluster, name: str = "pod") -> list:
    return sorted((cluster[0] / "tpus" / name).glob("worker*"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _wait_for(predicate, what: str, seconds: float = 20):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _started(worker, program: str = "drgrpo_jax.train") -> list[dict]:
    path = worker / "argv.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [row for row in rows if row["argv"][1] == program]


def test_launch_ships_the_working_tree_and_runs_one_command_detached_on_every_worker(cluster):
    tmp_path, _ = cluster
    first = launch(cluster, "--config", str(tmp_path / "run.yaml"), "--", "train.steps=3")
    assert first.returncode == 0, first.stderr
    homes = workers(cluster)
    assert len(homes) == 2
    pids = []
    for i, home in enumerate(homes):
        run = home / "drgrpo_run"
        assert (run / "src" / "edited.txt").read_text() == "edited, not committed\n"  # uncommitted edits travel
        assert (run / "src" / "untracked.txt").exists() and (run / "src" / "scripts" / "launch_tpu_pod.sh").exists()
        assert not (run / "src" / "ignored.txt").exists() and not (run / "src" / "deleted.txt").exists()
        assert (run / "run.yaml").read_text() == "model: {dtype: bfloat16}\n"
        _wait_for(lambda home=home: _started(home), f"no trainer started on {home.name}")
        (started,) = _started(home)
        assert started == {"argv": ["-m", "drgrpo_jax.train", "--config", f"{run}/run.yaml",
                                    "mesh.coordinator_address=auto", "train.steps=3"], "cwd": str(run)}
        pid = int((run / "trainer.pid").read_text())
        assert _alive(pid) and os.getpgid(pid) == pid  # detached in a process group of its own
        log = run / "trainer.log"
        _wait_for(lambda log=log, i=i: f"stand-in drgrpo_jax.train on worker {i}" in log.read_text(), "no log")
        pids.append(pid)

    # A relaunch first stops what the last one left: the old trainers are gone, new ones run.
    second = launch(cluster, "--config", str(tmp_path / "run.yaml"))
    assert second.returncode == 0, second.stderr
    _wait_for(lambda: not any(_alive(pid) for pid in pids), "a relaunch left the old trainers running")
    pids = [int((home / "drgrpo_run" / "trainer.pid").read_text()) for home in homes]
    assert all(_alive(pid) for pid in pids)

    # --stop: by pid file, or (a lost pid file on worker 1) by the trainer's command line; the lockfile goes too.
    (homes[1] / "drgrpo_run" / "trainer.pid").unlink()
    for home in homes:
        (home / "tmp" / "libtpu_lockfile").write_text("")
    stop = launch(cluster, "--stop")
    assert stop.returncode == 0, stop.stderr
    assert not any(_alive(pid) for pid in pids)
    for home in homes:
        assert not (home / "tmp" / "libtpu_lockfile").exists() and not (home / "drgrpo_run" / "trainer.pid").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_services_on_spare_chips_start_before_the_trainer_and_stop_with_it(cluster):
    tmp_path, _ = cluster
    port = _free_port()
    result = launch(cluster, "--config", str(tmp_path / "run.yaml"), "--chips-per-worker", "8", "--serve-chips", "4",
                    "--serve-mesh", "tensor=4", "--serve-port", str(port), "--health-timeout", "60",
                    FAKE_TPU_WORKERS="1")
    assert result.returncode == 0, result.stderr
    (home,) = workers(cluster)
    (service,) = _started(home, "drgrpo_jax.serve")
    assert service["argv"][-4:] == ["--port", str(port), "--mesh", "tensor=4"]
    _wait_for(lambda: _started(home), "no trainer started")
    (trainer,) = _started(home)
    assert trainer["argv"][4:] == [f"rollout.urls=[http://127.0.0.1:{port}]"]  # one process: no auto start-up
    pids = [int(p) for p in (home / "drgrpo_run" / "serve.pids").read_text().split()]
    pids += [int((home / "drgrpo_run" / "trainer.pid").read_text())]
    stop = launch(cluster, "--stop", FAKE_TPU_WORKERS="1")
    assert stop.returncode == 0, stop.stderr
    assert not any(_alive(pid) for pid in pids)


def test_a_service_that_never_answers_fails_in_one_line_after_the_health_timeout(cluster):
    tmp_path, _ = cluster
    url = f"http://127.0.0.1:{_free_port()}"
    result = launch(cluster, "--config", str(tmp_path / "run.yaml"), "--serve-url", url, "--health-timeout", "2")
    assert result.returncode == 1
    assert result.stderr == (f"launch_tpu_pod.sh: no answer from {url} /health on a worker of pod within 2 s "
                             "(--health-timeout)\n")
    assert not any((home / "drgrpo_run" / "trainer.pid").exists() for home in workers(cluster))


def test_gcloud_steps_are_retried_then_fail_in_one_line(cluster):
    tmp_path, _ = cluster
    result = launch(cluster, "--config", str(tmp_path / "run.yaml"), "--retries", "2", FAKE_GCLOUD_FAIL="scp-once")
    assert result.returncode == 0, result.stderr  # a flaky scp is tried again
    calls = (tmp_path / "tpus" / "calls").read_text().split()
    assert calls == ["scp", "scp", "ssh", "ssh"]
    launch(cluster, "--stop")

    (tmp_path / "tpus" / "calls").unlink()
    result = launch(cluster, "--config", str(tmp_path / "run.yaml"), "--retries", "2", FAKE_GCLOUD_FAIL="ssh")
    assert result.returncode == 1
    assert (tmp_path / "tpus" / "calls").read_text().split() == ["scp", "ssh", "ssh", "ssh"]
    ours = [line for line in result.stderr.splitlines() if line.startswith("launch_tpu_pod.sh: ")]
    assert ours == ["launch_tpu_pod.sh: gcloud compute tpus tpu-vm ssh pod failed (try 1 of 3); again in 0 s",
                    "launch_tpu_pod.sh: gcloud compute tpus tpu-vm ssh pod failed (try 2 of 3); again in 0 s",
                    "launch_tpu_pod.sh: gcloud compute tpus tpu-vm ssh pod failed 3 times (--retries 2): gcloud's "
                    "message is above"]
    assert result.stderr.splitlines()[-1] == ours[-1]
