"""The launchers: exact dry-run commands (TPU pod, GPU hosts, SLURM) and a real 2-process local run."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from importlib.metadata import version

import pytest

from support.paths import REPO, TESTS
from support.tiny_models import write_tiny_llama
from support.trainer_runs import trainer_overrides, write_prompts

pytestmark = pytest.mark.subprocess  # every test runs a launcher script

TPU = os.path.join(REPO, "scripts", "launch_tpu_pod.sh")
GPU = os.path.join(REPO, "scripts", "launch_gpu.sh")
STAGE = "/tmp/drgrpo_launch.XXXXXX"  # the TPU launcher's staging folder, as dry runs show it
WAIT = ("bash -c 'for u in \"$@\"; do for t in $(seq 450); do curl -sf \"$u/health\" > /dev/null && continue 2; "
        "sleep 2; done; echo \"$u/health: no answer in 900 s\" >&2; exit 1; done' wait")


def launch(script: str, *args: str, env=None, timeout=30) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", script, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=env)


def commands(output: str) -> list[str]:
    """The printed commands, one per line."""
    return output.splitlines()


# ---------------------------------------------------------------------------------------------
# TPU pod launcher
# ---------------------------------------------------------------------------------------------


# What every launch runs first in each worker's run folder, and all that --stop runs: SIGTERM to the process groups
# in the pid files and to what was started from the folder, SIGKILL after the grace, the libtpu lockfile removed.
TPU_STOP = ('mkdir -p ~/drgrpo_run && cd ~/drgrpo_run && { s="drgrpo_jax[.](train|serve) --config $PWD/run[.]yaml"; '
            'g=$(cat trainer.pid serve.pids 2> /dev/null); sig() { for p in $g; do kill -$1 -- -$p; done 2> /dev/null; '
            'pkill -$1 -f "$s"; }; up() { for p in $g; do kill -0 -- -$p 2> /dev/null && return; done; '
            'pgrep -f "$s" > /dev/null; }; sig TERM; for t in $(seq 120); do up || break; sleep 1; done; sig KILL; '
            'rm -f trainer.pid serve.pids /tmp/libtpu_lockfile; }')
TPU_RESTARTS = ('n=0; while :; do "$@"; c=$?; [ $c -eq 42 ] && [ $n -lt 3 ] || exit $c; n=$((n + 1)); '
                'echo "launch_tpu_pod.sh: the trainer saved and exited 42 (preempted): restart $n of 3" >&2; done')


def test_tpu_dry_run_prints_the_exact_gcloud_commands_one_for_all_workers(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: {dtype: bfloat16}\n")
    result = launch(TPU, "--tpu", "pod", "--zone", "us-east5-a", "--project", "proj", "--config", str(config),
                    "--serve-url", "http://10.0.1.5:30000", "--jax-version", "0.10.2", "--dry-run", "--",
                    "model.path=/mnt/m", "train.steps=3")
    assert result.returncode == 0, result.stderr
    stage, ssh = "/tmp/drgrpo_launch.XXXXXX", ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "pod", "--worker=all",
                                              "--zone=us-east5-a", "--project=proj"]
    pack, copy, *lines = result.stdout.splitlines()
    assert pack == (f"git -C {REPO} ls-files -z -co --exclude-standard | grep -zvxFf <(git -C {REPO} ls-files -d) | "
                    f"tar -C {REPO} --null -T - -czf {stage}/drgrpo_src.tar.gz")  # the working tree as it is
    assert copy == f"cp {config} {stage}/drgrpo_run.yaml"
    assert [shlex.split(line) for line in lines] == [
        ["gcloud", "compute", "tpus", "tpu-vm", "scp", f"{stage}/drgrpo_src.tar.gz", f"{stage}/drgrpo_run.yaml", "pod:",
         "--worker=all", "--zone=us-east5-a", "--project=proj"],
        [*ssh, f"--command={TPU_STOP} && rm -rf src && mkdir src && tar -xzf ~/drgrpo_src.tar.gz -C src && "
               "rm ~/drgrpo_src.tar.gz && mv ~/drgrpo_run.yaml run.yaml && { python3 -c \"import jax, libtpu; assert "
               "jax.__version__ == '0.10.2'\" 2> /dev/null || python3 -m pip install -q 'jax[tpu]==0.10.2'; } && "
               "python3 -m pip install -q -e 'src[train]'"],
        [*ssh, "--command=end=$(($(date +%s) + 900)); for u in http://10.0.1.5:30000; do until curl -sf --max-time 10 "
               "$u/health > /dev/null; do [ $(date +%s) -ge $end ] && exit 3; sleep 2; done; done"],
        [*ssh, "--command=cd ~/drgrpo_run && if [ -f trainer.pid ] && kill -0 -- -$(cat trainer.pid) 2> /dev/null; "
               "then echo \"trainer already running: $(cat trainer.pid)\"; else setsid nohup bash -c "
               f"'{TPU_RESTARTS}' trainer python3 -m drgrpo_jax.train --config $PWD/run.yaml "
               "mesh.coordinator_address=auto 'rollout.urls=[http://10.0.1.5:30000]' model.path=/mnt/m train.steps=3 "
               "> trainer.log 2>&1 < /dev/null & echo $! > trainer.pid; fi"],
    ]
    stop = launch(TPU, "--tpu", "pod", "--zone", "us-east5-a", "--project", "proj", "--serve-tpu", "gen", "--dry-run",
                  "--stop")
    assert [shlex.split(line) for line in stop.stdout.splitlines()] == [
        [*ssh, f"--command={TPU_STOP}"], [*ssh[:5], "gen", *ssh[6:], f"--command={TPU_STOP}"]]


def test_tpu_services_on_a_separate_slice_and_on_spare_chips():
    config = os.path.join(REPO, "configs", "recipes", "qwen2.5_math_7b_dr_grpo_v5p64.yaml")
    result = launch(TPU, "--tpu", "pod", "--zone", "z", "--config", config, "--serve-tpu", "gen", "--serve-ips",
                    "10.0.1.5,10.0.1.6", "--serve-chips", "2", "--serve-batch-size", "32", "--api-key-env", "GEN_KEY",
                    "--install", "true", "--dry-run", env={**os.environ, "GEN_KEY": "s3cret-value"})
    assert result.returncode == 0, result.stderr
    assert "s3cret" not in result.stdout + result.stderr  # the variable's name is shown, never its value
    lines = [shlex.split(line) for line in result.stdout.splitlines()[2:]]
    assert [line[4:6] for line in lines] == [["scp", f"{STAGE}/drgrpo_src.tar.gz"], ["ssh", "gen"],
                                             ["scp", f"{STAGE}/drgrpo_src.tar.gz"], ["ssh", "pod"], ["ssh", "pod"],
                                             ["ssh", "pod"]]
    assert all(line[-4] == f"{STAGE}/drgrpo_api_key.env" for line in lines if line[4] == "scp")
    services = lines[1][-1]  # every worker of the service slice starts the same two, one chip each
    assert services.endswith(
        "&& true && set -a && . ./api_key.env && set +a && { TPU_VISIBLE_CHIPS=0 TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1 "
        "TPU_PROCESS_BOUNDS=1,1,1 TPU_PROCESS_PORT=8477 setsid nohup python3 -m drgrpo_jax.serve --config "
        "$PWD/run.yaml --host 0.0.0.0 --port 30000 --max-batch-size 32 --api-key-env GEN_KEY > serve_0.log 2>&1 "
        "< /dev/null & echo $! >> serve.pids; TPU_VISIBLE_CHIPS=1 TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1 "
        "TPU_PROCESS_BOUNDS=1,1,1 TPU_PROCESS_PORT=8478 setsid nohup python3 -m drgrpo_jax.serve --config "
        "$PWD/run.yaml --host 0.0.0.0 --port 30001 --max-batch-size 32 --api-key-env GEN_KEY > serve_1.log 2>&1 "
        "< /dev/null & echo $! >> serve.pids; }")
    assert "mv ~/drgrpo_api_key.env api_key.env && chmod 600 api_key.env" in services
    urls = "http://10.0.1.5:30000 http://10.0.1.5:30001 http://10.0.1.6:30000 http://10.0.1.6:30001"
    assert f"for u in {urls}; do" in lines[4][-1]
    assert ("setsid nohup bash -c 'set -a; . ./api_key.env; set +a; n=0; while" in lines[5][-1] and
            f"mesh.coordinator_address=auto 'rollout.urls=[{urls.replace(' ', ',')}]' rollout.api_key_env=GEN_KEY > "
            "trainer.log" in lines[5][-1])
    unkeyed = launch(TPU, "--tpu", "pod", "--zone", "z", "--config", config, "--serve-tpu", "gen", "--serve-ips",
                     "10.0.1.5", "--serve-chips", "1", "--dry-run")
    assert unkeyed.returncode == 2 and "--api-key-env: required for services on --serve-tpu" in unkeyed.stderr

    v5e = launch(TPU, "--tpu", "v5e", "--zone", "z", "--config", config, "--num-workers", "1",
                 "--chips-per-worker", "8", "--serve-chips", "4", "--install", "true", "--dry-run")
    assert v5e.returncode == 0, v5e.stderr
    prepare, wait, start = (shlex.split(line)[-1] for line in v5e.stdout.splitlines()[-3:])
    assert "--host 127.0.0.1 --port 30000 > serve_0.log" in prepare  # services beside the trainer stay on loopback
    assert "for u in http://127.0.0.1:30000 http://127.0.0.1:30001 http://127.0.0.1:30002" in wait
    assert ("else TPU_VISIBLE_CHIPS=0,1,2,3 TPU_CHIPS_PER_PROCESS_BOUNDS=2,2,1 TPU_PROCESS_BOUNDS=1,1,1 setsid" in start
            and "mesh.coordinator_address" not in start)  # one process on one host
    pod = launch(TPU, "--tpu", "pod", "--zone", "z", "--config", config, "--num-workers", "4", "--serve-chips", "2",
                 "--install", "true", "--dry-run")
    assert pod.returncode == 2 and "--serve-chips: without --serve-tpu only on a one-worker slice" in pod.stderr
    missing = launch(TPU, "--tpu", "pod", "--zone", "z", "--config", config, "--serve-chips", "2", "--install", "true",
                     "--dry-run")
    assert missing.returncode == 2 and "--num-workers: required with --serve-chips and --dry-run" in missing.stderr


def test_the_documented_tpu_commands_run_as_written():
    """docs/scaling_out.md's launch_tpu_pod.sh rows, placeholders filled in, under --dry-run."""
    with open(os.path.join(REPO, "docs", "scaling_out.md")) as f:
        rows = re.findall(r"\| `((?:DRGRPO_API_KEY=\.\.\. )?scripts/launch_tpu_pod\.sh [^`]*)` \|", f.read())
    assert len(rows) == 3
    for row in rows:
        argv = shlex.split(row.replace("...", "x"))
        env = {**os.environ, "DRGRPO_API_KEY": "x"} if argv[0].startswith("DRGRPO_API_KEY=") else None
        argv = argv[1:] if env else argv
        cut = argv.index("--")
        ips = ["--serve-ips", "10.0.1.5"] if "--serve-tpu" in argv else []  # what describe gives without --dry-run
        result = launch(os.path.join(REPO, argv[0]), *argv[1:cut], *ips, "--jax-version", "0.10.2", "--dry-run",
                        *argv[cut:], env=env)
        assert result.returncode == 0 and "python3 -m drgrpo_jax.train" in result.stdout, (row, result.stderr)


def test_tpu_install_pins_the_jax_installed_here(tmp_path):
    config = os.path.join(REPO, "configs", "recipes", "qwen2.5_math_7b_dr_grpo_v5p64.yaml")
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    result = launch(TPU, "--tpu", "pod", "--zone", "z", "--config", config, "--dry-run", env=env)
    assert result.returncode == 0, result.stderr
    assert f"python3 -m pip install -q 'jax[tpu]=={version('jax')}'" in shlex.split(result.stdout.splitlines()[3])[-1]
    (tmp_path / "python3").write_text("#!/bin/sh\nexit 1\n")  # a python without jax
    (tmp_path / "python3").chmod(0o755)
    no_jax = launch(TPU, "--tpu", "pod", "--zone", "z", "--config", config, "--dry-run",
                    env={**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"})
    assert no_jax.returncode == 2 and no_jax.stderr == (
        "launch_tpu_pod.sh: --jax-version: required (no jax installed here to pin the workers' jax[tpu] to)\n")


# ---------------------------------------------------------------------------------------------
# GPU launcher
# ---------------------------------------------------------------------------------------------


def test_gpu_hosts_dry_run_sets_coordinator_process_count_and_ids():
    result = launch(GPU, "--config", "c.yaml", "--hosts", "node1,node2", "--serve-url", "http://gen:30000",
                    "--dry-run", "--", "model.path=/m", "train.steps=3")
    assert result.returncode == 0, result.stderr
    lines = commands(result.stdout)
    assert shlex.split(lines[0]) == ["ssh", "node1", WAIT + " http://gen:30000"]
    urls = shlex.quote("rollout.urls=[http://gen:30000]")
    for i, host in enumerate(["node1", "node2"]):
        remote = (f"cd . && env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 python3 -m drgrpo_jax.train --config c.yaml "
                  f"mesh.coordinator_address=node1:8476 mesh.num_processes=2 mesh.process_id={i} {urls} "
                  "model.path=/m train.steps=3")
        assert shlex.split(lines[1 + i]) == ["ssh", host, remote, ">", f"launch_logs/train_{i}.log", "2>&1", "&"]
    assert len(lines) == 3
    assert not os.path.exists(os.path.join(REPO, "launch_logs"))  # a dry run writes nothing


def test_gpu_key_goes_on_stdin_and_services_beyond_loopback_need_one():
    env = {**os.environ, "GEN_KEY": "s3cret-value"}
    result = launch(GPU, "--config", "c.yaml", "--hosts", "node1,node2", "--serve-gpus", "1", "--api-key-env",
                    "GEN_KEY", "--dry-run", "--", "model.path=/m", "run.output_dir=/nfs/run", env=env)
    assert result.returncode == 0, result.stderr
    assert "s3cret" not in result.stdout + result.stderr
    lines = commands(result.stdout)
    serve = shlex.split(lines[0])
    assert serve[:2] == ["ssh", "node1"] and serve[3:] == ["<<<", "$GEN_KEY"]
    assert serve[2].startswith("cd . && IFS= read -r GEN_KEY && export GEN_KEY && nohup env CUDA_VISIBLE_DEVICES=7")
    assert "--host 0.0.0.0 --port 30000 --weights-root /nfs/run/weights --api-key-env GEN_KEY" in serve[2]
    trainers = [shlex.split(line) for line in lines if "drgrpo_jax.train" in line]
    assert len(trainers) == 2
    for argv in trainers:
        assert argv[3:5] == ["<<<", "$GEN_KEY"] and "IFS= read -r GEN_KEY && export GEN_KEY && " in argv[2]
        assert argv[2].endswith("rollout.api_key_env=GEN_KEY")
    refused = launch(GPU, "--config", "c.yaml", "--hosts", "node1,node2", "--serve-gpus", "1", "--dry-run")
    assert refused.returncode == 2 and "--api-key-env: required when the services listen beyond loopback" in \
        refused.stderr
    unset = launch(GPU, "--config", "c.yaml", "--hosts", "n1", "--api-key-env", "NO_SUCH_VAR_X", "--dry-run")
    assert unset.returncode == 2 and "NO_SUCH_VAR_X is not set" in unset.stderr


def test_gpu_single_host_services_take_the_last_gpus():
    result = launch(GPU, "--config", "c.yaml", "--hosts", "localhost", "--gpus-per-host", "8", "--serve-gpus", "2",
                    "--serve-batch-size", "32", "--log-dir", "/tmp/l", "--dry-run", "--", "model.path=/m")
    assert result.returncode == 0, result.stderr
    lines = commands(result.stdout)
    for k in range(2):
        assert shlex.split(lines[k]) == shlex.split(
            f"env CUDA_VISIBLE_DEVICES={6 + k} python3 -m drgrpo_jax.serve --config c.yaml --model /m "
            f"--host 127.0.0.1 --port {30000 + k} --max-batch-size 32 > /tmp/l/serve_{k}.log 2>&1 &")
    assert shlex.split(lines[-1]) == shlex.split(
        "env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 CUDA_VISIBLE_DEVICES=0,1,2,3,4,5 python3 -m "
        "drgrpo_jax.train --config c.yaml 'rollout.urls=[http://127.0.0.1:30000,http://127.0.0.1:30001]' "
        "model.path=/m > /tmp/l/train_0.log 2>&1 &")


def test_gpu_slurm_dry_run_derives_ids_from_srun():
    result = launch(GPU, "--config", "c.yaml", "--slurm", "--coordinator-port", "9999", "--dry-run")
    assert result.returncode == 0, result.stderr
    (line,) = commands(result.stdout)
    argv = shlex.split(line)
    assert argv[:4] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--output=launch_logs/train_%t.log"]
    assert "mesh.coordinator_address=$head:9999 mesh.num_processes=$SLURM_NTASKS mesh.process_id=$SLURM_PROCID" in \
        argv[8]
    assert argv[9:] == ["drgrpo", "python3", "-m", "drgrpo_jax.train", "--config", "c.yaml"]


@pytest.mark.parametrize("args, message", [
    (["--hosts", "a"], "--config: required"),
    (["--config", "c.yaml"], "one of --hosts, --slurm or --local"),
    (["--config", "c.yaml", "--local", "x"], "--local-procs: must be a non-negative integer, got"),
    (["--config", "c.yaml", "--hosts", "a", "--serve-gpus", "8"], "--serve-gpus: 8 leaves no GPU"),
    (["--config", "c.yaml", "--hosts", "a", "--bogus"], "unknown option --bogus"),
])
def test_gpu_bad_arguments_fail_in_one_line(args, message):
    result = launch(GPU, *args, "--dry-run")
    assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr


# ---------------------------------------------------------------------------------------------
# GPU launcher, local mode: 2 processes on loopback through one generation service
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


def _local_run(tmp_path, inputs_dir, processes: int, devices: int) -> list[dict]:
    """2 steps of the tiny model through the launcher's local mode; the metrics rows."""
    out = tmp_path / f"run_{processes}"
    overrides = _overrides_2p(inputs_dir, out)
    record = tmp_path / f"scored_{processes}"
    record.mkdir()
    env = _env_2p(REWARD_RECORD_DIR=str(record))
    result = launch(GPU, "--config", str(inputs_dir / "base.yaml"), "--local", str(processes), "--local-devices",
                    str(devices), "--serve-gpus", "1", "--serve-port", str(_free_port()), "--coordinator-port",
                    str(_free_port()), "--log-dir", str(tmp_path / f"logs_{processes}"), "--python", sys.executable,
                    "--", *overrides, env=env, timeout=600)
    logs = "".join(p.read_text()[-3000:] for p in sorted((tmp_path / f"logs_{processes}").glob("*.log")))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:] + logs
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _scored(tmp_path, processes: int) -> list[list[str]]:
    """Prompt ids each trainer process scored (one list per process; order of the files is not the process order)."""
    return [p.read_text().split() for p in sorted((tmp_path / f"scored_{processes}").glob("*.txt"))]


def _inputs(tmp_path):
    write_tiny_llama(str(tmp_path / "model"))
    write_prompts(str(tmp_path / "prompts.jsonl"), 40)
    (tmp_path / "base.yaml").write_text("model: {dtype: float32}\n")  # drgrpo_jax.serve reads model.* from it


@pytest.mark.slow  # two trainer runs, each starting a service and compiling the step: ~3 minutes on 2 cores
def test_local_mode_two_processes_match_one(tmp_path):
    _inputs(tmp_path)
    one = _local_run(tmp_path, tmp_path, processes=1, devices=2)
    two = _local_run(tmp_path, tmp_path, processes=2, devices=1)
    assert [row["step"] for row in one] == [row["step"] for row in two] == [1, 2]
    # Each process scored its own half: 2 steps x 2 of the 4 prompts x 4 samples, the same prompts in all.
    (alone,), shares = _scored(tmp_path, 1), _scored(tmp_path, 2)
    assert len(alone) == 2 * 4 * 4 and [len(share) for share in shares] == [2 * 2 * 4, 2 * 2 * 4]
    assert sorted(shares[0] + shares[1]) == sorted(alone) and not set(shares[0]) & set(shares[1])
    logs = {i: (tmp_path / "logs_2" / f"train_{i}.log").read_text() for i in range(2)}
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
