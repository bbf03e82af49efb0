"""Launch files that cannot run what their inputs say: hostile values in every flag and config key that reaches a
rendered file are either refused in one line naming the flag or key, or rendered as data. Each render is parsed
(`bash -n`) and executed under stub commands (srun, sbatch, python3, xpk, ... on PATH, recording their argv), with a
canary folder beside the launch folder that must survive and a `pwned` marker that no payload may create."""

from __future__ import annotations

import os
import pathlib
import shlex
import subprocess

import pytest
import yaml

from drgrpo_jax.launch.cli import main

from support.paths import REPO

pytestmark = pytest.mark.subprocess  # bash -n and the rendered scripts under stubs (the refusals start none)

QUICKSTART = os.path.join(REPO, "configs", "quickstart.yaml")
V5P64 = os.path.join(REPO, "configs", "recipes", "qwen2.5_math_7b_dr_grpo_v5p64.yaml")
# Each tries another way out of a shell word; "$PWNED" is the marker's path, set only in the scripts' environment.
PAYLOADS = {
    "space": "a b",
    "dollar": '$(touch "$PWNED")',
    "backtick": '`touch "$PWNED"`',
    "semicolon": 'x;touch "$PWNED";y',
    "single_quote": "x';touch \"$PWNED\";'y",
    "double_quote": 'x";touch "$PWNED";"y',
    "glob": "*",
}
NEWLINE = 'x\ntouch "$PWNED"'
STUBBED = ["srun", "sbatch", "scontrol", "scancel", "curl", "python3", "gcloud", "kubectl", "xpk", "sky", "sleep"]
# Records its name and argv on one line (%q: one shell word each); srun then runs its command, as srun would.
STUB = """#!/bin/bash
printf '%q ' "$0" "$@" >> "$STUB_LOG"; echo >> "$STUB_LOG"
[ "$(basename "$0")" = srun ] || exit 0
while [[ "$1" == -* ]]; do shift; done
exec "$@"
"""


class Sandbox:
    """A folder with stub commands first on PATH, a canary and the marker's path."""

    def __init__(self, root: pathlib.Path):
        self.root, self.bin, self.log, self.pwned = root, root / "stub-bin", root / "stub.log", root / "pwned"
        self.bin.mkdir()
        self.results: list[tuple[list[str], subprocess.CompletedProcess]] = []
        for name in STUBBED:
            (self.bin / name).write_text(STUB)
            (self.bin / name).chmod(0o755)
        self.canary = root / "t" / "victim" / "canary"  # beside the launch folders, which start with "victim "
        self.canary.parent.mkdir(parents=True)
        self.canary.write_text("alive")

    def interpreter(self, name: str) -> str:
        """A stub interpreter at a hostile path (its folder is named `name`)."""
        folder = self.root / "interp" / name
        folder.mkdir(parents=True)
        (folder / "python").write_text(STUB)
        (folder / "python").chmod(0o755)
        return str(folder / "python")

    def env(self, **extra: str) -> dict[str, str]:
        return {"PATH": f"{self.bin}:/usr/bin:/bin", "PWNED": str(self.pwned), "STUB_LOG": str(self.log),
                "HOME": str(self.root), **extra}

    def run(self, argv: list[str], cwd: pathlib.Path | str, **extra: str) -> None:
        """Runs `argv`; its exit status is checked by `assert_unharmed`, after the harm (the clearer failure)."""
        result = subprocess.run(argv, cwd=cwd, env=self.env(**extra), capture_output=True, text=True, timeout=60)
        self.results.append((argv, result))

    def calls(self, name: str) -> list[list[str]]:
        """The argv of every recorded call of `name` (a stub's basename), $0 first."""
        if not self.log.exists():
            return []
        calls = [shlex.split(line) for line in self.log.read_text().splitlines()]
        return [argv for argv in calls if os.path.basename(argv[0]) == name]

    def assert_unharmed(self) -> None:
        assert not self.pwned.exists(), "a payload ran"
        assert self.canary.exists(), "the canary's folder was removed"
        for argv, result in self.results:
            assert result.returncode == 0, (argv, result.stderr)


@pytest.fixture
def sandbox(tmp_path) -> Sandbox:
    return Sandbox(tmp_path)


def _refusal(argv: list[str]) -> str:
    """The one-line error the launcher exits with."""
    with pytest.raises(SystemExit) as refused:
        main(argv)
    message = str(refused.value)
    assert "\n" not in message.replace("\\n", ""), message
    return message


def _bash_n(folder: pathlib.Path) -> None:
    for path in folder.iterdir():
        if path.suffix in (".sh", ".sbatch"):
            result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
            assert result.returncode == 0, (path.name, result.stderr)


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("inside", [True, False], ids=["out_in_workdir", "out_elsewhere"])
@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_slurm_scripts_run_hostile_paths_as_data(sandbox, payload, inside):
    """--out, --workdir, --python and run.output_dir (the services' --weights-root) hold the payload; the scripts,
    run under stubs, hand each one through as one argument and delete only their own folder. The launch folder is
    named relative to the working folder (inside it) or whole (elsewhere)."""
    workdir = sandbox.root / "t" if inside else sandbox.root / f"work {payload}"
    workdir.mkdir(exist_ok=True)
    out = sandbox.root / "t" / f"victim {payload}"
    run_dir = sandbox.root / f"run {payload}"
    python = sandbox.interpreter(payload)
    main(["slurm", "--config", QUICKSTART, "--out", str(out), "--workdir", str(workdir), "--python", python,
             "--services", "1", f"run.output_dir={run_dir}"])
    _bash_n(out)
    job = {"SLURM_JOB_ID": "7", "SLURM_LOCALID": "0", "SLURM_PROCID": "0", "DRGRPO_SERVE_JOB": "7"}
    sandbox.run(["bash", str(out / "serve.sbatch")], sandbox.root, **job)
    sandbox.run(["bash", str(out / "train.sbatch"), f"train.steps={payload}"], sandbox.root, **job)
    sandbox.run(["bash", str(out / "submit.sh")], sandbox.root)
    sandbox.assert_unharmed()
    serve, train = sandbox.calls("python")
    assert serve[0] == train[0] == python
    assert _value(serve, "--weights-root") == f"{run_dir}/weights"
    for argv in (serve, train):  # the config path, relative to the working folder the scripts cd into
        assert os.path.join(workdir, _value(argv, "--config")) == str(out / "run.yaml")
    assert train[-1] == f"train.steps={payload}"
    assert (out / "services" / "7" / "0.url").read_text().startswith("http://")
    outputs = [arg for argv in sandbox.calls("sbatch") for arg in argv if arg.startswith("--output=")]
    assert [os.path.join(workdir, o.removeprefix("--output=")) for o in outputs] == [
        f"{out}/logs/drgrpo-{job}_%j.log" for job in ("serve", "train")]


@pytest.mark.parametrize("flag", ["--partition", "--time", "--account", "--mem"])
@pytest.mark.parametrize("payload", [*PAYLOADS.values(), NEWLINE], ids=[*PAYLOADS.keys(), "newline"])
def test_slurm_fields_are_refused_unless_sbatch_allows_them(sandbox, flag, payload):
    """A newline in a #SBATCH value would end the directive and run the rest as a command."""
    message = _refusal(["slurm", "--config", QUICKSTART, "--out", str(sandbox.root / "o"), "--services", "1",
                        flag, payload])
    assert message.startswith(f"python -m drgrpo_jax.launch: config error: {flag}: {payload!r} is not ")
    assert not (sandbox.root / "o").exists()


@pytest.mark.parametrize("flag", ["--out", "--python", "--workdir"])
def test_slurm_paths_with_a_newline_are_refused(sandbox, flag):
    values = {"--out": str(sandbox.root / "o"), "--python": "python3", "--workdir": str(sandbox.root)}
    values[flag] = f"{values[flag]}{NEWLINE}"
    argv = [arg for pair in values.items() for arg in pair]
    message = _refusal(["slurm", "--config", QUICKSTART, "--services", "1", *argv])
    assert message.startswith(f"python -m drgrpo_jax.launch: config error: {flag}: ")
    assert "has a newline or control character" in message


@pytest.mark.parametrize("override, key", [
    ('rollout.api_key_env=K$(touch "$PWNED")', "rollout.api_key_env"),
    ("rollout.api_key_env=K;touch pwned", "rollout.api_key_env"),
    ("rollout.urls=[http://gen:1;touch pwned]", "rollout.urls[0]"),
    ("rollout.urls=[http://gen:1/$(touch pwned)]", "rollout.urls[0]"),
    ("rollout.urls=['http://gen:1 x']", "rollout.urls[0]"),
    ("rollout.urls=[file:///etc/passwd]", "rollout.urls[0]"),
], ids=["env_dollar", "env_semicolon", "url_semicolon", "url_dollar", "url_space", "url_scheme"])
@pytest.mark.parametrize("engine", ["slurm", "skypilot"])
def test_config_keys_that_reach_a_shell_are_refused_by_the_config(sandbox, engine, override, key):
    extra = ["--gpus", "H100:1"] if engine == "skypilot" else []
    message = _refusal([engine, "--config", QUICKSTART, "--out", str(sandbox.root / "o"), *extra, override])
    assert message.startswith(f"python -m drgrpo_jax.launch: config error: {key}: ")


GKE = ["--tpu", "v5p-64", "--serve-tpu", "v5p-8", "--image", "us-docker.pkg.dev/p/r/drgrpo:1",
       "mesh.num_processes=8", "rollout.service_mesh=tensor=4", "model.path=/m", "data.path=/d"]


GKE_REFUSED = [(flag, payload) for flag in ("--name", "--image", "--cluster")
               for payload in [*PAYLOADS.values(), NEWLINE]] + [("--name", "UPPER"), ("--name", "a" * 41)]


@pytest.mark.parametrize("flag, payload", GKE_REFUSED)
def test_gke_names_are_refused_unless_kubernetes_allows_them(sandbox, flag, payload):
    message = _refusal(["gke", "--config", V5P64, "--out", str(sandbox.root / "o"), *GKE, flag, payload])
    assert message.startswith(f"python -m drgrpo_jax.launch: config error: {flag}: {payload!r} is not ")


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_gke_commands_run_hostile_values_as_data(sandbox, payload):
    """The containers' `bash -c` commands and xpk.sh, run under stubs with the payload in the launch folder and
    run.output_dir: every value arrives whole."""
    out = sandbox.root / "t" / f"victim {payload}"
    run_dir = f"/shared/run {payload}"
    main(["gke", "--config", V5P64, "--out", str(out), *GKE, f"run.output_dir={run_dir}"])
    _bash_n(out)
    services = list(yaml.safe_load_all((out / "services.yaml").read_text()))
    (jobset,) = yaml.safe_load_all((out / "jobset.yaml").read_text())
    serve = services[1]["spec"]["template"]["spec"]["containers"][0]["command"]
    train = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["command"]
    for command in (serve, train):
        sandbox.run(command, sandbox.root)
    sandbox.run(["bash", str(out / "xpk.sh")], sandbox.root)
    sandbox.assert_unharmed()
    (served, trained) = sandbox.calls("python3")
    assert _value(served, "--weights-root") == f"{run_dir}/weights"
    assert trained[1:5] == ["-m", "drgrpo_jax.train", "--config", "/config/run.yaml"]
    (xpk,) = sandbox.calls("xpk")
    inner = _value(xpk, "--command")
    assert subprocess.run(["bash", "-n", "-c", inner]).returncode == 0
    assert inner.endswith(f" && {train[2]}")  # after unpacking the config: the JobSet's command


@pytest.mark.parametrize("payload", [*PAYLOADS.values(), NEWLINE], ids=[*PAYLOADS.keys(), "newline"])
def test_skypilot_gpu_names_are_refused(sandbox, payload):
    message = _refusal(["skypilot", "--config", QUICKSTART, "--out", str(sandbox.root / "o"), "--gpus",
                        f"{payload}:1"])
    assert message.startswith("python -m drgrpo_jax.launch: config error: --gpus: must be NAME:COUNT")


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_skypilot_run_runs_hostile_values_as_data(sandbox, payload):
    """The task's `run`, executed under stubs on a two-node cluster's variables, from a hostile launch folder."""
    out = sandbox.root / "t" / f"victim {payload}"
    main(["skypilot", "--config", QUICKSTART, "--out", str(out), "--gpus", "H100:1",
             "rollout.urls=[http://gen:30000,https://gen2:443/v1]", "rollout.api_key_env=GEN_KEY",
             "mesh.num_processes=2", "mesh.data=2"])
    task = yaml.safe_load((out / "task.yaml").read_text())
    assert task["secrets"] == {"GEN_KEY": None}  # sky jobs launch --secret GEN_KEY: the key from your environment
    for script in (task["setup"], task["run"]):
        assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    sandbox.run(["bash", "-c", task["run"]], sandbox.root, SKYPILOT_NODE_IPS="10.0.0.1\n10.0.0.2",
                SKYPILOT_NUM_NODES="2", SKYPILOT_NODE_RANK="1")
    sandbox.assert_unharmed()
    (train,) = sandbox.calls("python3")
    assert train[5:] == ["rollout.urls=[http://gen:30000,https://gen2:443/v1]", "rollout.api_key_env=GEN_KEY",
                         "mesh.coordinator_address=10.0.0.1:8476", "mesh.num_processes=2", "mesh.process_id=1"]
