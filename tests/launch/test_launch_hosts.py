"""The hosts render, run: launch.sh under a stub `ssh` that runs the remote command here (recording its argv) and a stub
`python3` that records each process's argv, key and GPUs; then a real 2-process local run through it (slow)."""

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
from support.tiny_models import write_tiny_llama
from support.trainer_runs import trainer_overrides, write_prompts

pytestmark = pytest.mark.subprocess  # the rendered script, run under stubs, starts processes

H100 = os.path.join(REPO, "configs", "recipes", "qwen2.5_math_7b_dr_grpo_8xh100.yaml")
QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")
PAYLOADS = ["a b", '$(touch "$PWNED")', '`touch "$PWNED"`', 'x;touch "$PWNED";y', "x';touch \"$PWNED\";'y", "*"]
# ssh: records its argv (%q, one shell word each), then runs the remote command here, as the remote shell would
SSH = """#!/bin/bash
printf -v line '%q ' "$0" "$@"; echo "$line" >> "$STUB_DIR/ssh.log"  # one write: calls may run at once
[ "$1" = -- ] && shift
shift; exec bash -c "$1"
"""
# curl URL/health: answers once a service on that port has recorded itself (so none is stopped before it has)
CURL = r"""#!/bin/bash
port=${@: -1}; port=${port##*:}; port=${port%%/*}
for i in $(seq 200); do
  grep -qF "\"--port\", \"$port\"" "$STUB_DIR/python.jsonl" 2> /dev/null && exit 0; sleep 0.05
done
"""
PYTHON = """#!{python}
import json, os, sys, time
with open(os.path.join(os.environ["STUB_DIR"], "python.jsonl"), "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "key": os.environ.get("DRGRPO_API_KEY"),
                        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "venv": os.environ.get("STUB_VENV")}}) + "\\n")
if "mesh.process_id=1" in sys.argv and os.environ.get("FAIL_PROCESS_1"):
    sys.exit(3)
if sys.argv[2] == "drgrpo_jax.train" and os.environ.get("FAIL_PROCESS_1"):
    time.sleep(60)
"""


class Stubs:
    def __init__(self, root):
        self.root, self.bin, self.pwned = root, root / "stub-bin", root / "pwned"
        self.bin.mkdir()
        for name, text in {"ssh": SSH, "python3": PYTHON.format(python=sys.executable), "curl": CURL}.items():
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)

    def run(self, folder, **env: str) -> subprocess.CompletedProcess:
        path = f"{self.bin}:/usr/bin:/bin"
        return subprocess.run(["bash", os.path.join(folder, "launch.sh")], capture_output=True, text=True, timeout=60,
                              env={"PATH": path, "STUB_DIR": str(self.root), "PWNED": str(self.pwned),
                                   "HOME": str(self.root), **env})

    def processes(self) -> list[dict]:
        return [json.loads(line) for line in (self.root / "python.jsonl").read_text().splitlines()]

    def ssh(self) -> list[list[str]]:
        return [shlex.split(line) for line in (self.root / "ssh.log").read_text().splitlines()]


def test_services_on_the_first_host_then_one_trainer_per_host_with_the_key_on_stdin(tmp_path):
    stubs = Stubs(tmp_path)
    out = tmp_path / "work" / "launch"
    main(["hosts", "--config", H100, "--out", str(out), "--workdir", str(tmp_path / "work"), "--hosts", "n1,me@n2",
          "--serve-gpus", "2", "--python", "python3", "model.path=/m", "data.path=/d", "mesh.fsdp=8"])
    result = stubs.run(out)
    assert result.returncode == 0, result.stderr
    _wait_for_rows(stubs, 4)
    key = (out / "api_key.env").read_text().strip().partition("=")[2]
    services = sorted((p for p in stubs.processes() if p["argv"][1] == "drgrpo_jax.serve"), key=lambda p: p["gpus"])
    trainers = sorted((p for p in stubs.processes() if p["argv"][1] == "drgrpo_jax.train"), key=lambda p: p["argv"][6])
    assert [s["gpus"] for s in services] == ["6", "7"] and all(s["key"] == key for s in services)
    for k, service in enumerate(services):
        argv = service["argv"]
        assert argv[argv.index("--host") + 1] == "0.0.0.0" and argv[argv.index("--port") + 1] == str(30000 + k)
        assert argv[argv.index("--config") + 1] == "launch/run.yaml" and service["cwd"] == str(tmp_path / "work")
    assert [t["gpus"] for t in trainers] == ["0,1,2,3,4,5", None] and all(t["key"] == key for t in trainers)
    for i, trainer in enumerate(trainers):
        assert trainer["argv"][2:] == ["--config", "launch/run.yaml", "mesh.coordinator_address=n1:8476",
                                       "mesh.num_processes=2", f"mesh.process_id={i}",
                                       "rollout.urls=[http://n1:30000,http://n1:30001]",
                                       "rollout.api_key_env=DRGRPO_API_KEY"]
    calls = stubs.ssh()
    assert [call[2] for call in calls[:3]] == ["n1", "n1", "n1"] and calls[-1][2] == "n1"  # services, wait; stop
    assert sorted(call[2] for call in calls[3:5]) == ["me@n2", "n1"]  # the trainers
    assert not any(key in arg for call in calls for arg in call)  # the key went on stdin


def test_the_first_failure_stops_the_other_processes(tmp_path):
    stubs = Stubs(tmp_path)
    main(["hosts", "--config", QUICKSTART, "--out", str(tmp_path / "o"), "--local", "2", "mesh.data=2",
          "rollout.urls=[http://127.0.0.1:30000]"])
    start = time.monotonic()
    result = stubs.run(tmp_path / "o", FAIL_PROCESS_1="1")
    assert result.returncode == 3 and time.monotonic() - start < 30
    assert "launch.sh: a trainer process exited 3; stopping the others" in result.stderr


def test_a_venv_is_activated_wherever_a_process_starts(tmp_path):
    stubs = Stubs(tmp_path)
    venv = tmp_path / "work" / "my venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("export STUB_VENV=on\n")
    main(["hosts", "--config", H100, "--out", str(tmp_path / "o"), "--workdir", str(tmp_path / "work"), "--venv",
          "my venv", "--hosts", "localhost,n2", "--serve-gpus", "1", "model.path=/m", "data.path=/d", "mesh.fsdp=8"])
    result = stubs.run(tmp_path / "o")
    assert result.returncode == 0, result.stderr
    _wait_for_rows(stubs, 3)
    assert [p["venv"] for p in stubs.processes()] == ["on", "on", "on"]  # the local service and trainer, n2's


def _wait_for_rows(stubs: Stubs, count: int) -> None:
    """A process started in the background over ssh may record itself after launch.sh is done."""
    deadline = time.monotonic() + 20
    while len(stubs.processes()) < count and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.mark.parametrize("payload", PAYLOADS)
def test_hostile_paths_and_values_run_as_data(tmp_path, payload):
    """--out, --workdir, --venv, --python and run.output_dir hold the payload, on a remote and a local host."""
    stubs = Stubs(tmp_path)
    work, out = tmp_path / f"work {payload}", tmp_path / "t" / f"victim {payload}"
    (work / payload / "bin").mkdir(parents=True)
    (work / payload / "bin" / "activate").write_text("")
    canary = tmp_path / "t" / "victim" / "canary"
    canary.parent.mkdir(parents=True)
    canary.write_text("alive")
    python = tmp_path / "interp" / payload / "python"
    python.parent.mkdir(parents=True)
    python.write_text(PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    main(["hosts", "--config", H100, "--out", str(out), "--workdir", str(work), "--venv", payload, "--python",
          str(python), "--hosts", "n1,localhost", "--serve-gpus", "1", "model.path=/m", "data.path=/d",
          "mesh.fsdp=8", f"run.output_dir=/shared/{payload}"])
    assert subprocess.run(["bash", "-n", str(out / "launch.sh")]).returncode == 0
    result = stubs.run(out)
    assert not stubs.pwned.exists() and canary.exists(), "a payload ran"
    assert result.returncode == 0, result.stderr
    _wait_for_rows(stubs, 3)
    (service,) = [p for p in stubs.processes() if p["argv"][1] == "drgrpo_jax.serve"]
    trainers = [p for p in stubs.processes() if p["argv"][1] == "drgrpo_jax.train"]
    assert service["argv"][service["argv"].index("--weights-root") + 1] == f"/shared/{payload}/weights"
    assert len(trainers) == 2 and all(t["cwd"] == str(work) for t in [service, *trainers])


@pytest.mark.parametrize("args, key, message", [
    (["--hosts", "-oProxyCommand=touch pwned"], "--hosts", "is not an ssh destination"),
    (["--hosts", "a;b"], "--hosts", "is not an ssh destination"),
    (["--hosts", "n1", "--serve-gpus", "8"], "--serve-gpus", "leave no GPU for the trainer"),
    (["--hosts", "n1,n2", "--serve-gpus", "2", "mesh.num_processes=4"], "--hosts", "2 processes, but "),
    (["--hosts", "n1,n2", "--serve-gpus", "3", "rollout.service_mesh=tensor=2"], "--serve-gpus", "3 GPUs do not split"),
    (["--hosts", "n1", "rollout.urls=[http://127.0.0.1:30000]"], "rollout.urls", "is on the trainer's own node"),
])
def test_layouts_that_cannot_run_are_refused_in_one_line(tmp_path, args, key, message):
    with pytest.raises(SystemExit) as refused:
        main(["hosts", "--config", QUICKSTART, "--out", str(tmp_path / "o"), *args])
    text = str(refused.value)
    assert text.startswith(f"python -m drgrpo_jax.launch: config error: {key}: ") and message in text, text
    assert "\n" not in text and not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------
# Local mode for real: 2 processes on loopback through one generation service
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _overrides_2p(inputs_dir, out, reward: str = "support.reward_functions:recorded_letter_a") -> list[str]:
    """The tiny 2-step trainer run (4 prompts x 4), without eval, on 2 data-parallel devices."""
    overrides = [o for o in trainer_overrides(str(inputs_dir / "model"), str(inputs_dir / "prompts.jsonl"), out, 2)
                 if not o.startswith(("train.eval_every", "mesh.data", "reward.functions"))]
    return overrides + ["train.eval_every=0", "mesh.data=2", f"reward.functions=[{reward},format]"]


def _env_2p(**extra) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, TESTS]), "HF_HUB_OFFLINE": "1", **extra}
    env.pop("XLA_FLAGS", None)
    return env


def _local_run(tmp_path, processes: int, devices: int) -> list[dict]:
    """2 steps of the tiny model through the rendered launch.sh's local mode; the metrics rows."""
    out = tmp_path / f"run_{processes}"
    record = tmp_path / f"scored_{processes}"
    record.mkdir()
    folder = tmp_path / f"launch_{processes}"
    main(["hosts", "--config", str(tmp_path / "base.yaml"), "--out", str(folder), "--workdir", REPO, "--local",
          str(processes), "--local-devices", str(devices), "--serve-gpus", "1", "--port", str(_free_port()),
          "--coordinator-port", str(_free_port()), "--python", sys.executable, *_overrides_2p(tmp_path, out)])
    result = subprocess.run(["bash", str(folder / "launch.sh")], capture_output=True, text=True, timeout=600,
                            env=_env_2p(REWARD_RECORD_DIR=str(record)))
    logs = "".join(p.read_text()[-3000:] for p in sorted((folder / "logs").glob("*.log")))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:] + logs
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _scored(tmp_path, processes: int) -> list[list[str]]:
    """Prompt ids each trainer process scored (one list per process; order of the files is not the process order)."""
    return [p.read_text().split() for p in sorted((tmp_path / f"scored_{processes}").glob("*.txt"))]


def _inputs(tmp_path):
    write_tiny_llama(str(tmp_path / "model"))
    write_prompts(str(tmp_path / "prompts.jsonl"), 40)
    (tmp_path / "base.yaml").write_text("model: {dtype: float32}\n")


@pytest.mark.slow  # two trainer runs, each starting a service and compiling the step: ~3 minutes on 2 cores
def test_local_mode_two_processes_match_one(tmp_path):
    _inputs(tmp_path)
    one = _local_run(tmp_path, processes=1, devices=2)
    two = _local_run(tmp_path, processes=2, devices=1)
    assert [row["step"] for row in one] == [row["step"] for row in two] == [1, 2]
    # Each process scored its own half: 2 steps x 2 of the 4 prompts x 4 samples, the same prompts in all.
    (alone,), shares = _scored(tmp_path, 1), _scored(tmp_path, 2)
    assert len(alone) == 2 * 4 * 4 and [len(share) for share in shares] == [2 * 2 * 4, 2 * 2 * 4]
    assert sorted(shares[0] + shares[1]) == sorted(alone) and not set(shares[0]) & set(shares[1])
    logs = {i: (tmp_path / "launch_2" / "logs" / f"train_{i}.log").read_text() for i in range(2)}
    for step in (1, 2):
        assert f"[process 0/2] step {step}: sampled and scored prompts 0-1 (8 responses)" in logs[0]
        assert f"[process 1/2] step {step}: sampled and scored prompts 2-3 (8 responses)" in logs[1]
    measured = ("seconds", "per_second", "rss")  # wall-clock and memory: facts of the process, not of the math
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        for key in a:
            if any(word in key for word in measured) or a[key] is None:
                assert (a[key] is None) == (b[key] is None), key
                continue
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow  # one service and two trainer processes up to their first rollout: ~1.5 minutes on 2 cores
def test_a_reward_failure_on_process_1_stops_both(tmp_path):
    """A NaN reward on process 1 only: both processes exit 1 naming RewardError, neither hangs."""
    from drgrpo_jax.rollout.local_service import LocalServer

    _inputs(tmp_path)
    coordinator = f"127.0.0.1:{_free_port()}"
    with LocalServer(str(tmp_path / "model"), log_path=str(tmp_path / "serve.log"),
                     env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}) as server:
        overrides = _overrides_2p(tmp_path, tmp_path / "run", reward="support.reward_functions:nan_on_flagged_host")
        processes = []
        for i in range(2):
            env = _env_2p(JAX_PLATFORMS="cpu", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                          XLA_FLAGS="--xla_force_host_platform_device_count=1", **({"FAIL_REWARD": "1"} if i else {}))
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "drgrpo_jax.train", *overrides, f"rollout.urls=[{server.url}]",
                 f"mesh.coordinator_address={coordinator}", "mesh.num_processes=2", f"mesh.process_id={i}"],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        errors = []
        for process in processes:
            try:
                errors.append(process.communicate(timeout=400)[1])
            except subprocess.TimeoutExpired:
                for p in processes:
                    p.kill()
                pytest.fail("a process hung after the other's reward failure")
    for i, (process, stderr) in enumerate(zip(processes, errors)):
        last = [line for line in stderr.splitlines() if line.strip()][-1]
        assert process.returncode == 1, (i, stderr[-2000:])
        assert last.startswith("python -m drgrpo_jax.train: RewardError: "), (i, stderr[-2000:])
    assert "sampling or scoring step 1 failed on process 1" in errors[0]
    assert "nan" in errors[1].lower()
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


def test_each_service_spans_rollout_service_meshs_gpus(tmp_path):
    main(["hosts", "--config", H100, "--out", str(tmp_path), "--hosts", "localhost", "--serve-gpus", "4",
          "rollout.service_mesh=tensor=2", "model.path=/m", "data.path=/d"])
    text = (tmp_path / "launch.sh").read_text()
    assert "env CUDA_VISIBLE_DEVICES=4,5 python3 -m drgrpo_jax.serve" in text and "--mesh tensor=2" in text
    assert "env CUDA_VISIBLE_DEVICES=6,7 python3 -m drgrpo_jax.serve" in text
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3 python3 -m drgrpo_jax.train" in text
    assert "'rollout.urls=[http://127.0.0.1:30000,http://127.0.0.1:30001]'" in text
