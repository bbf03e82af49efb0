"""Launch files that run as rendered: the API key on by default (one private file in the launch folder, read by the
services and the trainer), SLURM's resources and paths relative to the working folder, refusals for services that
nothing would start, run.yaml saying how many processes the launch starts, GKE without services, SkyPilot tasks
whose code and config do not depend on where `sky` runs."""

from __future__ import annotations

import glob
import os
import re
import shlex
import stat
import subprocess

import pytest
import yaml

from drgrpo_jax.launch.cli import main

from support.paths import REPO

pytestmark = pytest.mark.subprocess  # the rendered scripts, run under stub commands

QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")
V5P64 = os.path.join(REPO, "configs", "recipes", "qwen2.5_math_7b_dr_grpo_v5p64.yaml")
GKE = ["--tpu", "v5p-64", "--image", "img:1", "mesh.num_processes=8", "model.path=/m", "data.path=/d",
       "run.output_dir=gs://b/run"]
# Writes its argv, one per line, then the key it was given, into $STUB_OUT/<its name>; srun runs its command.
STUB = """#!/bin/bash
out="$STUB_OUT/$(basename "$0")"; printf '%s\\n' "$@" > "$out"; echo "key=${DRGRPO_API_KEY:-}" >> "$out"
[ "$(basename "$0")" = srun ] || exit 0
while [[ "$1" == -* ]]; do shift; done
exec "$@"
"""


def _stubs(folder, *names: str) -> dict[str, str]:
    """An environment whose PATH starts with stubs of `names` writing into folder/calls."""
    (folder / "bin").mkdir()
    (folder / "calls").mkdir()
    for name in names:
        (folder / "bin" / name).write_text(STUB)
        (folder / "bin" / name).chmod(0o755)
    return {"PATH": f"{folder / 'bin'}:/usr/bin:/bin", "STUB_OUT": str(folder / "calls"), "HOME": str(folder),
            "SLURM_JOB_ID": "7", "SLURM_LOCALID": "0", "SLURM_PROCID": "0", "DRGRPO_SERVE_JOB": "7"}


def _run(argv: list[str], env: dict[str, str], cwd) -> None:
    result = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def _refusal(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as refused:
        main(argv)
    return str(refused.value)


def test_slurm_services_get_a_private_key_that_the_trainer_sends(tmp_path):
    out = tmp_path / "work" / "launch"
    argv = ["slurm", "--config", QUICKSTART, "--out", str(out), "--workdir", str(tmp_path / "work"), "--services",
            "1"]
    main(argv)
    key_file = out / "api_key.env"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    name, _, key = key_file.read_text().strip().partition("=")
    assert name == "DRGRPO_API_KEY" and len(key) >= 32
    main(argv)  # a second render keeps the key the running services hold
    assert key_file.read_text() == f"DRGRPO_API_KEY={key}\n"
    env = _stubs(tmp_path, "srun", "python3", "curl", "scontrol", "scancel", "sleep")
    _run(["bash", str(out / "serve.sbatch")], env, tmp_path)
    serve = (tmp_path / "calls" / "python3").read_text().splitlines()
    _run(["bash", str(out / "train.sbatch")], env, tmp_path)
    train = (tmp_path / "calls" / "python3").read_text().splitlines()
    assert serve[serve.index("--api-key-env") + 1] == "DRGRPO_API_KEY" and "--allow-unauthenticated" not in serve
    assert "rollout.api_key_env=DRGRPO_API_KEY" in train
    assert serve[-1] == train[-1] == f"key={key}"


def test_slurm_keeps_the_configs_own_key_variable(tmp_path):
    main(["slurm", "--config", QUICKSTART, "--out", str(tmp_path), "--services", "1", "rollout.api_key_env=MY_KEY"])
    assert not (tmp_path / "api_key.env").exists()
    assert "--api-key-env MY_KEY" in (tmp_path / "serve.sbatch").read_text()


def test_slurm_resources_and_paths_relative_to_the_working_folder(tmp_path):
    work = tmp_path / "checkout"
    main(["slurm", "--config", QUICKSTART, "--out", str(work / "runs" / "launch"), "--workdir", str(work),
          "--services", "1", "--cpus-per-task", "3", "--mem", "64G", "--no-exclusive", "--account", "rl-team",
          "--python", ".venv/bin/python"])
    train = (work / "runs" / "launch" / "train.sbatch").read_text()
    assert "#SBATCH --cpus-per-task=3\n" in train and "#SBATCH --mem=64G\n" in train
    assert "--exclusive" not in train and "#SBATCH --account=rl-team\n" in train
    for name in ("train.sbatch", "serve.sbatch", "submit.sh"):
        text = (work / "runs" / "launch" / name).read_text()
        assert f"cd {work}\n" in text and text.count(str(work)) == 1, name  # the rest relative to it
    assert ".venv/bin/python -m drgrpo_jax.train --config runs/launch/run.yaml " in train
    main(["slurm", "--config", QUICKSTART, "--out", str(tmp_path / "l")])  # the defaults: 2 reward workers + 4
    train = (tmp_path / "l" / "train.sbatch").read_text()
    assert all(f"#SBATCH {line}\n" in train for line in ("--cpus-per-task=6", "--mem=0", "--exclusive"))


@pytest.mark.parametrize("url", ["http://127.0.0.1:30000", "http://localhost:30000", "http://[::1]:30000"])
def test_slurm_refuses_loopback_services_that_nothing_starts(tmp_path, url):
    message = _refusal(["slurm", "--config", QUICKSTART, "--out", str(tmp_path), f"rollout.urls=['{url}']"])
    assert message == (f"python -m drgrpo_jax.launch: config error: rollout.urls: {url} is on the trainer's own "
                       "node, where nothing starts a service: give --services N, or the services' host names")


def test_run_yaml_says_how_many_processes_the_launch_starts(tmp_path):
    main(["gke", "--config", V5P64, "--out", str(tmp_path), "--serve-tpu", "v5p-8", *GKE,
          "rollout.service_mesh=tensor=4"])
    text = (tmp_path / "run.yaml").read_text()
    assert text.startswith("# 8 trainer processes of 4 devices each, detected at launch")
    assert yaml.safe_load(text)["mesh"]["num_processes"] == 1  # what mesh.coordinator_address=auto asks


def test_gke_key_file_and_xpk_read_the_same_key(tmp_path, capsys):
    main(["gke", "--config", V5P64, "--out", str(tmp_path / "o"), "--serve-tpu", "v5p-8", *GKE,
          "rollout.service_mesh=tensor=4"])
    assert stat.S_IMODE((tmp_path / "o" / "api_key.env").stat().st_mode) == 0o600
    assert (f"kubectl create secret generic drgrpo-api-key --from-env-file={tmp_path}/o/api_key.env && kubectl "
            f"apply -f {tmp_path}/o") in capsys.readouterr().out
    env = _stubs(tmp_path, "xpk")
    _run(["bash", str(tmp_path / "o" / "xpk.sh")], env, "/")
    assert f"--env-file={tmp_path}/o/api_key.env" in (tmp_path / "calls" / "xpk").read_text().splitlines()


def test_gke_without_services_renders_none_and_uses_the_configs_urls(tmp_path):
    """--services 0: no StatefulSet, so --serve-tpu (here the default, v5litepod-4) is not held against a
    rollout.service_mesh of 1 device."""
    main(["gke", "--config", V5P64, "--out", str(tmp_path), "--services", "0", *GKE,
          "rollout.urls=[http://gen-a:30000,http://gen-b:30000]"])
    assert not (tmp_path / "services.yaml").exists()
    assert "'rollout.urls=[http://gen-a:30000,http://gen-b:30000]'" in (tmp_path / "jobset.yaml").read_text()


def test_gke_refuses_a_relative_output_dir(tmp_path):
    message = _refusal(["gke", "--config", V5P64, "--out", str(tmp_path), "--serve-tpu", "v5p-8", *GKE,
                        "rollout.service_mesh=tensor=4", "run.output_dir=runs/x"])
    assert message.startswith("python -m drgrpo_jax.launch: config error: run.output_dir: 'runs/x' is relative")


def test_skypilot_task_carries_its_code_and_config_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    main(["skypilot", "--config", QUICKSTART, "--out", "sky", "--gpus", "H100:1", "--workdir", REPO])
    task = yaml.safe_load((tmp_path / "sky" / "task.yaml").read_text())
    assert task["workdir"] == REPO and os.path.isfile(os.path.join(task["workdir"], "pyproject.toml"))
    (source,) = task["file_mounts"].values()
    assert source == str(tmp_path / "sky" / "run.yaml") and os.path.isfile(source)


def _documented_commands() -> list[str]:
    """The `python -m drgrpo_jax.launch ENGINE --config ...` commands of docs/scaling_out.md and the recipes'
    headers, each on one line."""
    with open(os.path.join(REPO, "docs", "scaling_out.md")) as f:
        commands = [" ".join(c.split()) for c in re.findall(r"`(python -m drgrpo_jax\.launch [^`]*)`", f.read())]
    for recipe in sorted(glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True)):
        with open(recipe) as f:
            header = "".join(line.lstrip("# ") for line in f if line.startswith("#"))
        commands += [" ".join(c.split()) for c in re.findall(r"python -m drgrpo_jax\.launch (?:[^\n]*\\\n)*[^\n]*",
                                                             header.replace("(then:", "\n"))]
    return [c.replace("\\", "") for c in commands if "--config" in c and "ENGINE" not in c]


def test_the_documented_commands_render(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the commands name the recipes from the repository's root
    commands = _documented_commands()
    assert len(commands) >= 4, commands  # the docs' SLURM and GKE rows and two recipes'
    for i, command in enumerate(commands):
        argv = shlex.split(re.sub(r"=\.\.\.", "=/x", command).replace("IMAGE", "img:1"))[3:]
        argv = [arg for arg in argv if arg != "..."]  # what "..." stands for, where it is not given:
        argv += [f"{key}=/x" for key in ("model.path", "data.path") if f"{key}=" not in command]
        argv[argv.index("--out") + 1] = str(tmp_path / str(i))
        main(argv)
        assert (tmp_path / str(i) / "run.yaml").exists(), command


def test_slurm_jobs_activate_the_venv_after_cd(tmp_path):
    """--venv: both jobs source its activate script, quoted, relative to --workdir where they cd."""
    venv = tmp_path / "my venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("export DRGRPO_API_KEY=from-venv\n")
    main(["slurm", "--config", QUICKSTART, "--out", str(tmp_path / "o"), "--workdir", str(tmp_path), "--venv",
          "my venv", "--services", "1", "rollout.api_key_env=K"])
    env = _stubs(tmp_path, "srun", "python3", "curl", "scontrol", "scancel", "sleep")
    for job in ("serve.sbatch", "train.sbatch"):
        assert f"cd {tmp_path}\n. 'my venv/bin/activate'\n" in (tmp_path / "o" / job).read_text()
        _run(["bash", str(tmp_path / "o" / job)], {**env, "K": "k"}, "/")
        assert (tmp_path / "calls" / "python3").read_text().splitlines()[-1] == "key=from-venv"
