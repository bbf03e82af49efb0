"""The tpu-vm render, run: launch.sh and stop.sh against a stand-in `gcloud` that runs each worker's part here
(support/stand_in_gcloud.py: every worker a folder of its own, `--command` run once per worker).

The workers' `python3` is a stand-in too: `-m drgrpo_jax.train` records its arguments and sleeps (or exits
$FAKE_TRAIN_EXIT), `-m drgrpo_jax.serve` answers /health on its --port. What a real TPU VM does (ssh, libtpu, JAX's pod
detection) is not tested here."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time

import pytest

from drgrpo_jax.launch.cli import main

from support.paths import REPO, TESTS

pytestmark = pytest.mark.subprocess  # every test runs the rendered scripts, whose workers start processes

V5E8_1_5B = os.path.join(REPO, "configs", "recipes", "qwen2.5_math_1.5b_dr_grpo_v5e8.yaml")
V5E8_LORA = os.path.join(REPO, "configs", "recipes", "qwen2.5_math_7b_dr_grpo_lora_v5e8.yaml")
QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")
FAKE_PYTHON = """#!{python}
import http.server, json, os, sys, time
with open(os.path.join(os.environ["HOME"], "argv.jsonl"), "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "key": os.environ.get("DRGRPO_API_KEY"),
                        "chips": os.environ.get("TPU_VISIBLE_CHIPS")}}) + "\\n")
print("stand-in", sys.argv[2], "on worker", os.environ["TPU_WORKER_ID"], flush=True)
if sys.argv[2] == "drgrpo_jax.serve":
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
if os.environ.get("FAKE_TRAIN_EXIT"):
    sys.exit(int(os.environ["FAKE_TRAIN_EXIT"]))
time.sleep(300)
"""


class Cluster:
    """A checkout with uncommitted edits, the stand-in gcloud first on PATH, and every worker a folder."""

    def __init__(self, tmp_path):
        self.root, self.repo = tmp_path, tmp_path / "repo"
        self.repo.mkdir()
        for name, text in {"edited.txt": "committed\n", "deleted.txt": "gone\n", ".gitignore": "ignored.txt\n"}.items():
            (self.repo / name).write_text(text)
        git = ["git", "-C", str(self.repo), "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run([*git, "init", "-q"], check=True)
        subprocess.run([*git, "add", "."], check=True)
        subprocess.run([*git, "commit", "-qm", "base"], check=True)
        (self.repo / "edited.txt").write_text("edited, not committed\n")
        (self.repo / "untracked.txt").write_text("new\n")
        (self.repo / "ignored.txt").write_text("ignored\n")
        (self.repo / "deleted.txt").unlink()
        bin_dir, worker_bin, self.tpus = tmp_path / "bin", tmp_path / "worker_bin", tmp_path / "tpus"
        for folder in (bin_dir, worker_bin, self.tpus):
            folder.mkdir()
        (bin_dir / "gcloud").write_text(f"#!/bin/sh\nexec {sys.executable} {TESTS}/support/stand_in_gcloud.py \"$@\"\n")
        (worker_bin / "python3").write_text(FAKE_PYTHON.format(python=sys.executable))
        for script in (bin_dir / "gcloud", worker_bin / "python3"):
            script.chmod(0o755)
        self.env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_TPU_ROOT": str(self.tpus),
                    "FAKE_WORKER_BIN": str(worker_bin)}

    def render(self, *args: str, config: str = QUICKSTART, out: str = "launch") -> str:
        folder = str(self.root / out)
        main(["tpu-vm", "--config", config, "--out", folder, "--tpu", "pod", "--zone", "us-east5-a", "--workdir",
              str(self.repo), "--install", "true", "--retry-delay", "0", "--stop-grace", "5", *args])
        return folder

    def run(self, folder: str, script: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", os.path.join(folder, script)], capture_output=True, text=True, timeout=120,
                              env={**self.env, **env})

    def workers(self, name: str = "pod") -> list:
        return sorted((self.tpus / name).glob("worker*"))


@pytest.fixture
def cluster(tmp_path) -> Cluster:
    return Cluster(tmp_path)


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launch_ships_the_working_tree_and_runs_one_command_detached_on_every_worker(cluster):
    folder = cluster.render("train.steps=3")
    first = cluster.run(folder, "launch.sh")
    assert first.returncode == 0, first.stderr
    homes = cluster.workers()
    assert len(homes) == 2
    pids = []
    for i, home in enumerate(homes):
        run = home / "drgrpo_run"
        assert (run / "src" / "edited.txt").read_text() == "edited, not committed\n"  # uncommitted edits travel
        assert (run / "src" / "untracked.txt").exists()
        assert not (run / "src" / "ignored.txt").exists() and not (run / "src" / "deleted.txt").exists()
        assert "steps: 3" in (run / "run.yaml").read_text()
        _wait_for(lambda home=home: _started(home), f"no trainer started on {home.name}")
        (started,) = _started(home)
        assert started["argv"] == ["-m", "drgrpo_jax.train", "--config", f"{run}/run.yaml",
                                   "mesh.coordinator_address=auto"]
        assert started["cwd"] == str(run) and started["key"] is None
        pid = int((run / "trainer.pid").read_text())
        assert _alive(pid) and os.getpgid(pid) == pid  # detached in a process group of its own
        log = run / "trainer.log"
        _wait_for(lambda log=log, i=i: f"stand-in drgrpo_jax.train on worker {i}" in log.read_text(), "no log")
        pids.append(pid)

    # A relaunch first stops what the last one left: the old trainers are gone, new ones run.
    second = cluster.run(folder, "launch.sh")
    assert second.returncode == 0, second.stderr
    _wait_for(lambda: not any(_alive(pid) for pid in pids), "a relaunch left the old trainers running")
    pids = [int((home / "drgrpo_run" / "trainer.pid").read_text()) for home in homes]
    assert all(_alive(pid) for pid in pids)

    # stop.sh: by pid file, or (a lost pid file on worker 1) by the trainer's command line; the lockfile goes too.
    (homes[1] / "drgrpo_run" / "trainer.pid").unlink()
    for home in homes:
        (home / "tmp" / "libtpu_lockfile").write_text("")
    stop = cluster.run(folder, "stop.sh")
    assert stop.returncode == 0, stop.stderr
    _wait_for(lambda: not any(_alive(pid) for pid in pids), "stop.sh left a trainer running")
    for home in homes:
        assert not (home / "tmp" / "libtpu_lockfile").exists() and not (home / "drgrpo_run" / "trainer.pid").exists()


def test_services_on_spare_chips_start_before_the_trainer_with_the_key_and_stop_with_it(cluster):
    port = _free_port()
    folder = cluster.render("--serve-chips", "4", "--port", str(port), "--health-timeout", "60", "model.path=/m",
                            "data.path=/d", config=V5E8_LORA)
    result = cluster.run(folder, "launch.sh", FAKE_TPU_WORKERS="1")
    assert result.returncode == 0, result.stderr
    (home,) = cluster.workers()
    (service,) = _started(home, "drgrpo_jax.serve")  # one service over 4 chips (rollout.service_mesh: tensor=4)
    key = (cluster.root / "launch" / "api_key.env").read_text().strip().partition("=")[2]
    assert service["chips"] == "4,5,6,7" and service["key"] == key
    argv = service["argv"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == str(port)
    assert argv[argv.index("--mesh") + 1] == "tensor=4" and argv[argv.index("--api-key-env") + 1] == "DRGRPO_API_KEY"
    _wait_for(lambda: _started(home), "no trainer started")
    (trainer,) = _started(home)
    assert trainer["chips"] == "0,1,2,3" and trainer["key"] == key
    assert trainer["argv"][4:] == ["rollout.api_key_env=DRGRPO_API_KEY", f"rollout.urls=[http://127.0.0.1:{port}]"]
    pids = [int(p) for p in (home / "drgrpo_run" / "serve.pids").read_text().split()]
    pids += [int((home / "drgrpo_run" / "trainer.pid").read_text())]
    stop = cluster.run(folder, "stop.sh", FAKE_TPU_WORKERS="1")
    assert stop.returncode == 0, stop.stderr
    _wait_for(lambda: not any(_alive(pid) for pid in pids), "stop.sh left a process running")


def test_services_on_a_slice_of_their_own_get_their_urls_from_describe(cluster):
    port = _free_port()
    folder = cluster.render("--serve-tpu", "gen", "--serve-chips", "1", "--port", str(port), "--health-timeout", "2",
                            "run.output_dir=/shared/run")
    text = (cluster.root / "launch" / "launch.sh").read_text()
    assert "gcloud compute tpus tpu-vm describe gen" in text
    result = cluster.run(folder, "launch.sh")
    # The stand-in's workers are 10.0.0.2-3, which do not answer here: the wait fails and the services are stopped.
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        f"launch.sh: no answer from http://10.0.0.2:{port} http://10.0.0.3:{port} /health on a worker of pod within "
        "2 s (--health-timeout); stopped the services, their logs: ~/drgrpo_run/serve_*.log on gen")
    services = [row for home in cluster.workers("gen") for row in _started(home, "drgrpo_jax.serve")]
    assert len(services) == 2 and all(row["argv"][row["argv"].index("--host") + 1] == "0.0.0.0" for row in services)
    assert all(row["argv"][row["argv"].index("--weights-root") + 1] == "/shared/run/weights" for row in services)
    assert not any((home / "drgrpo_run" / "trainer.pid").exists() for home in cluster.workers())
    assert not any((home / "drgrpo_run" / "serve.pids").exists() for home in cluster.workers("gen"))


def test_a_trainer_that_exits_42_is_started_again_up_to_max_restarts(cluster):
    folder = cluster.render("--max-restarts", "2")
    result = cluster.run(folder, "launch.sh", FAKE_TPU_WORKERS="1", FAKE_TRAIN_EXIT="42")
    assert result.returncode == 0, result.stderr
    (home,) = cluster.workers()
    log = home / "drgrpo_run" / "trainer.log"
    _wait_for(lambda: "restart 2 of 2" in log.read_text(), "no second restart")
    _wait_for(lambda: len(_started(home)) == 3, "not three starts")
    time.sleep(0.5)
    assert len(_started(home)) == 3  # no fourth


def test_gcloud_steps_are_retried_then_fail_in_one_line(cluster):
    folder = cluster.render("--retries", "2")
    result = cluster.run(folder, "launch.sh", FAKE_GCLOUD_FAIL="scp-once")
    assert result.returncode == 0, result.stderr  # a flaky scp is tried again
    assert (cluster.tpus / "calls").read_text().split() == ["scp", "scp", "ssh", "ssh"]
    cluster.run(folder, "stop.sh")

    (cluster.tpus / "calls").unlink()
    result = cluster.run(folder, "launch.sh", FAKE_GCLOUD_FAIL="ssh")
    assert result.returncode == 1
    assert (cluster.tpus / "calls").read_text().split() == ["scp", "ssh", "ssh", "ssh"]
    ours = [line for line in result.stderr.splitlines() if line.startswith("launch.sh: ")]
    assert ours == ["launch.sh: gcloud compute tpus tpu-vm ssh pod failed (try 1 of 3); again in 0 s",
                    "launch.sh: gcloud compute tpus tpu-vm ssh pod failed (try 2 of 3); again in 0 s",
                    "launch.sh: gcloud compute tpus tpu-vm ssh pod failed 3 times (--retries 2): gcloud's message is "
                    "above"]


def test_the_default_install_pins_the_jax_installed_here_and_a_venv_is_made_and_used(tmp_path):
    from importlib.metadata import version

    main(["tpu-vm", "--config", QUICKSTART, "--out", str(tmp_path), "--tpu", "pod", "--zone", "us-east5-a",
          "--venv", "my venv"])
    worker = (tmp_path / "worker.sh").read_text()
    pin = shlex.quote(f"jax[tpu]=={version('jax')}")
    assert f"python3 -m pip install -q {pin}; }} && python3 -m pip install -q -e 'src[train]'" in worker
    assert "[ -f \"$HOME\"/'my venv'/bin/activate ] || python3 -m venv \"$HOME\"/'my venv'" in worker
    assert worker.count(". \"$HOME\"/'my venv/bin/activate'") == 3  # prepare, serve, the trainer's loop


@pytest.mark.parametrize("args, key, message", [
    (["--serve-chips", "4"], "--serve-chips", "without --serve-tpu only on a one-worker slice"),
    (["--serve-tpu", "gen", "rollout.urls=[http://gen:1]"], "--serve-chips", "needs at least 1 with --serve-tpu"),
    (["--serve-tpu", "gen", "--serve-chips", "4"], "run.output_dir", "is relative"),
    (["--serve-ips", "10.0.0.1", "rollout.urls=[http://gen:1]"], "--serve-ips", "give --serve-tpu too"),
    (["rollout.urls=[http://127.0.0.1:30000]"], "rollout.urls", "is on the trainer's own node"),
    (["--serve-chips", "3", "rollout.service_mesh=tensor=2"], "--serve-chips", "3 chips do not split"),
])
def test_layouts_that_cannot_run_are_refused_in_one_line(tmp_path, args, key, message):
    with pytest.raises(SystemExit) as refused:
        main(["tpu-vm", "--config", QUICKSTART, "--out", str(tmp_path / "o"), "--tpu", "pod", "--zone", "us-east5-a",
              *args, "mesh.num_processes=2", "mesh.data=2"])
    text = str(refused.value)
    assert text.startswith(f"python -m drgrpo_jax.launch: config error: {key}: ") and message in text, text
    assert "\n" not in text and not (tmp_path / "o").exists()
