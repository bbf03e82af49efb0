"""Launch files that cannot run what their inputs say: hostile values in every flag and config key that reaches a
rendered file are either refused in one line naming the flag or key, or rendered as data. Each render is parsed
(`bash -n`) and executed under stub commands (srun, sbatch, python3, xpk, ssh, ... on PATH, recording their argv;
tpu-vm's under the stand-in gcloud, every worker a folder), with a canary folder beside the launch folder that must
survive and a `pwned` marker that no payload may create."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import time

import pytest
import yaml

from drgrpo_jax.launch.cli import main

from support.paths import REPO, TESTS

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
LEADING_DASH = "-rf"  # a path or word that starts with it reads as options to the command it is handed to
STUBBED = ["srun", "sbatch", "scontrol", "scancel", "curl", "python3", "gcloud", "kubectl", "xpk", "sky", "sleep"]
# Records its name and argv on one line (%q: one shell word each); srun then runs its command, as srun would.
STUB = """#!/bin/bash
printf -v line '%q ' "$0" "$@"; echo "$line" >> "$STUB_LOG"  # one write: calls may run at once
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
@pytest.mark.parametrize("engine", ["slurm", "skypilot", "tpu-vm", "hosts"])
def test_config_keys_that_reach_a_shell_are_refused_by_the_config(sandbox, engine, override, key):
    extra = {"skypilot": ["--gpus", "H100:1"], "tpu-vm": TPU, "hosts": ["--hosts", "n1"]}.get(engine, [])
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


# ---------------------------------------------------------------------------------------------
# tpu-vm and hosts: the scripts run for real under the stand-in gcloud (every worker a folder) or a stub ssh
# ---------------------------------------------------------------------------------------------

V5E8_LORA = os.path.join(REPO, "configs", "recipes", "qwen2.5_math_7b_dr_grpo_lora_v5e8.yaml")
H100 = os.path.join(REPO, "configs", "recipes", "qwen2.5_math_7b_dr_grpo_8xh100.yaml")
TPU = ["--tpu", "pod", "--zone", "us-east5-a"]
URLS = "[http://gen:30000,https://gen2:443/v1]"
# python3 on a worker or host: a JSON line of its argv, folder, keys and activated venv into $HOME/python.jsonl;
# `-m venv DIR` makes DIR/bin/activate, which marks the environment with DIR.
RECORDER = """#!{python}
import json, os, shlex, sys
if sys.argv[1:3] == ["-m", "venv"]:
    os.makedirs(os.path.join(sys.argv[3], "bin"))
    with open(os.path.join(sys.argv[3], "bin", "activate"), "w") as f:
        f.write("export STUB_VENV=" + shlex.quote(sys.argv[3]) + "\\n")
    sys.exit(0)
with open(os.path.join(os.environ["HOME"], "python.jsonl"), "a") as f:
    keys = {{k: os.environ[k] for k in ("DRGRPO_API_KEY", "GEN_KEY") if k in os.environ}}
    f.write(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "venv": os.environ.get("STUB_VENV"),
                        "keys": keys}}) + "\\n")
"""
# ssh -- HOST COMMAND: recorded (the stub's line), then COMMAND run here, as the remote shell would
SSH = """#!/bin/bash
printf -v line '%q ' "$0" "$@"; echo "$line" >> "$STUB_LOG"  # one write: calls may run at once
[ "$1" = -- ] && shift
shift; exec bash -c "$1"
"""


def _executable(path: pathlib.Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


def _records(home: pathlib.Path, count: int) -> list[dict]:
    """The recorder's rows in `home`, once there are `count` (the trainer starts detached: it may come late)."""
    path, deadline = home / "python.jsonl", time.monotonic() + 30
    while (len(path.read_text().splitlines()) if path.exists() else 0) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    assert len(rows) == count, rows
    return rows


def _tpu_workers(sandbox: Sandbox, workers: int) -> dict[str, str]:
    """The stand-in gcloud in place of the stub one, the workers' recorder python3 and a `-install` command (it
    marks the run folder); the environment that makes each of `workers` workers a folder under tpus/."""
    _executable(sandbox.bin / "gcloud", f"#!/bin/sh\nexec {sys.executable} {TESTS}/support/stand_in_gcloud.py \"$@\"\n")
    worker_bin = sandbox.root / "worker-bin"
    _executable(worker_bin / "python3", RECORDER.format(python=sys.executable))
    _executable(worker_bin / "-install", "#!/bin/sh\ntouch installed-by-dash\n")
    (sandbox.root / "tpus").mkdir()
    return {"FAKE_TPU_ROOT": str(sandbox.root / "tpus"), "FAKE_WORKER_BIN": str(worker_bin),
            "FAKE_TPU_WORKERS": str(workers)}


def _checkout(folder: pathlib.Path) -> pathlib.Path:
    folder.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(folder)], check=True)
    (folder / "tracked.txt").write_text("shipped\n")
    return folder


def _option(argv: list[str], flag: str) -> str:
    """`flag`'s value as the program's argparse reads it (a value that starts with '-' reads as another option)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument(flag)
    return getattr(parser.parse_known_args(argv)[0], flag.lstrip("-").replace("-", "_"))


def _gcloud_calls(sandbox: Sandbox) -> list[list[str]]:
    return [json.loads(line) for line in (sandbox.root / "tpus" / "argv.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("payload", [*PAYLOADS.values(), LEADING_DASH], ids=[*PAYLOADS.keys(), "leading_dash"])
def test_tpu_vm_scripts_run_hostile_paths_as_data(sandbox, payload):
    """--out, --workdir, --venv (made on the worker) and run.output_dir (the services' --weights-root, relative)
    hold the payload and --install writes it: launch.sh, the worker's worker.sh and stop.sh, run under the
    stand-in gcloud with the services on the worker's spare chips, hand each through whole."""
    env = _tpu_workers(sandbox, workers=1)
    work = _checkout(sandbox.root / f"work {payload}")
    out = sandbox.root / "t" / f"victim {payload}"
    main(["tpu-vm", "--config", V5E8_LORA, "--out", str(out), "--workdir", str(work), *TPU, "--serve-chips", "4",
          "--stop-grace", "1", f"--venv={payload}", f"--install=printf %s {shlex.quote(payload)} > installed",
          "model.path=/m", "data.path=/d", f"run.output_dir={json.dumps(payload)}"])  # a YAML string
    _bash_n(out)
    sandbox.run(["bash", str(out / "launch.sh")], sandbox.root, **env)
    (home,) = (sandbox.root / "tpus" / "pod").iterdir()
    rows = _records(home, 2)  # the service, then the trainer
    sandbox.run(["bash", str(out / "stop.sh")], sandbox.root, **env)
    sandbox.assert_unharmed()
    run = home / "drgrpo_run"
    assert (run / "installed").read_text() == payload and (run / "src" / "tracked.txt").exists()
    assert yaml.safe_load((run / "run.yaml").read_text())["run"]["output_dir"] == payload
    key = (out / "api_key.env").read_text().strip().partition("=")[2]
    service, trainer = rows
    assert all(row["venv"] == f"{home}/{payload}" and row["keys"] == {"DRGRPO_API_KEY": key} for row in rows)
    assert os.path.normpath(_option(service["argv"], "--weights-root")) == os.path.normpath(f"{payload}/weights")
    assert trainer["argv"] == ["-m", "drgrpo_jax.train", "--config", f"{run}/run.yaml",
                               "rollout.api_key_env=DRGRPO_API_KEY", "rollout.urls=[http://127.0.0.1:30000]"]
    assert [call[-1] for call in sandbox.calls("curl")] == ["http://127.0.0.1:30000/health"]
    assert not (run / "trainer.pid").exists() and not (run / "serve.pids").exists()  # stop.sh ran there


def test_tpu_vm_install_with_a_leading_dash_runs_as_a_command(sandbox):
    """`bash -c -rf...` would read the install command as bash's own options."""
    env = _tpu_workers(sandbox, workers=1)
    out = sandbox.root / "o"
    main(["tpu-vm", "--config", QUICKSTART, "--out", str(out), "--workdir", str(_checkout(sandbox.root / "w")), *TPU,
          "--install=-install"])
    sandbox.run(["bash", str(out / "launch.sh")], sandbox.root, **env)
    _records(sandbox.root / "tpus" / "pod" / "worker0", 1)
    sandbox.assert_unharmed()
    assert (sandbox.root / "tpus" / "pod" / "worker0" / "drgrpo_run" / "installed-by-dash").exists()


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_tpu_vm_carries_the_key_and_urls_of_the_config_as_data(sandbox, payload):
    """rollout.api_key_env's variable holds the payload: it reaches each worker's trainer whole, in its
    environment; the URLs reach the trainer and each worker's /health wait; every gcloud call has the scope."""
    env = _tpu_workers(sandbox, workers=2)
    out = sandbox.root / "o"
    main(["tpu-vm", "--config", QUICKSTART, "--out", str(out), "--workdir", str(_checkout(sandbox.root / "w")), *TPU,
          "--project", "my-project-1", "--install=true", f"rollout.urls={URLS}", "rollout.api_key_env=GEN_KEY"])
    sandbox.run(["bash", str(out / "launch.sh")], sandbox.root, GEN_KEY=f"k{payload}", **env)
    homes = sorted((sandbox.root / "tpus" / "pod").iterdir())
    trainers = [row for home in homes for row in _records(home, 1)]
    sandbox.assert_unharmed()
    for home, trainer in zip(homes, trainers):
        assert trainer["keys"] == {"GEN_KEY": f"k{payload}"}
        assert trainer["argv"][4:] == ["mesh.coordinator_address=auto", "rollout.api_key_env=GEN_KEY",
                                       f"rollout.urls={URLS}"]
        assert oct((home / "drgrpo_run" / "api_key.env").stat().st_mode & 0o777) == "0o600"
    curled = sorted(call[-1] for call in sandbox.calls("curl"))
    assert curled == sorted(2 * ["http://gen:30000/health", "https://gen2:443/v1/health"])
    calls = _gcloud_calls(sandbox)
    assert all("--zone=us-east5-a" in call and "--project=my-project-1" in call for call in calls), calls
    assert not any(payload in arg for call in calls for arg in call)  # the key travelled in a file, not a command


TPU_VM_REFUSED = [(flag, payload) for flag in ("--tpu", "--serve-tpu", "--zone", "--project", "--serve-ips",
                                               "--jax-version")
                  for payload in [*PAYLOADS.values(), NEWLINE, LEADING_DASH, "-oProxyCommand=touch pwned"]]


@pytest.mark.parametrize("flag, payload", TPU_VM_REFUSED)
def test_tpu_vm_names_are_refused_unless_gcloud_allows_them(sandbox, flag, payload):
    scope = {"--tpu": "pod", "--zone": "us-east5-a", flag: payload}
    extra = ["--serve-chips", "1", "run.output_dir=/shared"] if flag in ("--serve-tpu", "--serve-ips") else []
    extra += ["--serve-tpu", "gen"] if flag == "--serve-ips" else []
    message = _refusal(["tpu-vm", "--config", QUICKSTART, "--out", str(sandbox.root / "o"),
                        *[f"{name}={value}" for name, value in scope.items()], *extra])
    assert message.startswith(f"python -m drgrpo_jax.launch: config error: {flag}: {payload!r} is not ")
    assert not (sandbox.root / "o").exists()


@pytest.mark.parametrize("flag", ["--out", "--workdir", "--venv", "--install"])
def test_tpu_vm_paths_and_commands_with_a_newline_are_refused(sandbox, flag):
    values = {"--out": str(sandbox.root / "o"), "--workdir": str(sandbox.root), "--venv": "v", "--install": "true"}
    values[flag] += NEWLINE
    message = _refusal(["tpu-vm", "--config", QUICKSTART, *TPU, *[f"{k}={v}" for k, v in values.items()]])
    assert message.startswith(f"python -m drgrpo_jax.launch: config error: {flag}: ")
    assert "has a newline or control character" in message


# curl URL/health, as a service started by launch.sh answers it: once that service runs (it has written its row),
# so that launch.sh cannot stop it before it starts
HEALTH_ONCE_SERVING = """#!/bin/bash
printf -v line '%q ' "$0" "$@"; echo "$line" >> "$STUB_LOG"
for _ in $(seq 300); do grep -qs drgrpo_jax.serve "$HOME/python.jsonl" && exit 0; /bin/sleep 0.1; done
exit 7
"""


def _hosts_sandbox(sandbox: Sandbox, *, services: bool = False) -> None:
    _executable(sandbox.bin / "ssh", SSH)
    if services:
        _executable(sandbox.bin / "curl", HEALTH_ONCE_SERVING)


@pytest.mark.parametrize("payload", [*PAYLOADS.values(), LEADING_DASH], ids=[*PAYLOADS.keys(), "leading_dash"])
def test_hosts_script_runs_hostile_paths_as_data(sandbox, payload):
    """The launch folder inside the checkout (so launch.sh names it relative to it: the payload leads), --venv,
    --python (both relative to the checkout) and run.output_dir hold the payload; the services over ssh on the
    first host, a trainer there and one here. Each arrives whole, as the programs' argparse reads it."""
    _hosts_sandbox(sandbox, services=True)
    work = sandbox.root / f"work {payload}"
    out = work / payload / "launch"
    python = _executable(work / payload / "python", RECORDER.format(python=sys.executable))
    activate = work / payload / "venv" / "bin" / "activate"
    activate.parent.mkdir(parents=True)
    activate.write_text("export STUB_VENV=on\n")
    main(["hosts", "--config", H100, "--out", str(out), "--workdir", str(work), f"--venv={payload}/venv",
          f"--python={os.path.relpath(python, work)}", "--hosts", "n1,localhost", "--serve-gpus", "1",
          "model.path=/m", "data.path=/d", "mesh.fsdp=8", f"run.output_dir={json.dumps(payload)}"])
    _bash_n(out)
    sandbox.run(["bash", str(out / "launch.sh")], sandbox.root)
    rows = _records(sandbox.root, 3)
    sandbox.assert_unharmed()
    key = (out / "api_key.env").read_text().strip().partition("=")[2]
    assert all(row["cwd"] == str(work) and row["venv"] == "on" and row["keys"] == {"DRGRPO_API_KEY": key}
               for row in rows)
    (service,) = [row for row in rows if row["argv"][1] == "drgrpo_jax.serve"]
    assert os.path.normpath(_option(service["argv"], "--weights-root")) == os.path.normpath(f"{payload}/weights")
    for row in rows:
        assert (work / _option(row["argv"], "--config")).resolve() == (out / "run.yaml").resolve()
    assert all((out / "logs" / name).exists() for name in ("serve_0.log", "train_0.log", "train_1.log"))
    assert all(call[1:3] == ["--", "n1"] for call in sandbox.calls("ssh"))
    assert not (out / "logs" / "serve.pids").exists()  # the services were stopped on n1 at the end


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_hosts_carry_the_key_and_urls_of_the_config_as_data(sandbox, payload):
    """rollout.api_key_env's variable holds the payload: each host's trainer gets it whole, over ssh's standard
    input (no command line holds it); the URLs reach the trainers and the first host's /health wait."""
    _hosts_sandbox(sandbox)
    out = sandbox.root / "o"
    main(["hosts", "--config", QUICKSTART, "--out", str(out), "--workdir", str(sandbox.root), "--hosts", "n1,me@n2",
          f"--python={_executable(sandbox.root / 'py' / 'python', RECORDER.format(python=sys.executable))}",
          "mesh.data=2", f"rollout.urls={URLS}", "rollout.api_key_env=GEN_KEY"])
    sandbox.run(["bash", str(out / "launch.sh")], sandbox.root, GEN_KEY=f"k{payload}")
    trainers = sorted(_records(sandbox.root, 2), key=lambda row: row["argv"][-3])
    sandbox.assert_unharmed()
    for i, trainer in enumerate(trainers):
        assert trainer["keys"] == {"GEN_KEY": f"k{payload}"}
        assert trainer["argv"][4:] == ["mesh.coordinator_address=n1:8476", "mesh.num_processes=2",
                                       f"mesh.process_id={i}", f"rollout.urls={URLS}", "rollout.api_key_env=GEN_KEY"]
    assert [call[-1] for call in sandbox.calls("curl")] == ["http://gen:30000/health", "https://gen2:443/v1/health"]
    ssh = sandbox.calls("ssh")
    assert sorted(call[2] for call in ssh) == ["me@n2", "n1", "n1"]  # the wait, the trainers
    assert not any(f"k{payload}" in arg for call in ssh for arg in call)


HOSTS_REFUSED = [*PAYLOADS.values(), NEWLINE, LEADING_DASH, "-oProxyCommand=touch pwned", "me@-oProxyCommand",
                 "me@", "@n1", ""]


@pytest.mark.parametrize("host", HOSTS_REFUSED)
def test_hosts_names_are_refused_unless_ssh_destinations(sandbox, host):
    message = _refusal(["hosts", "--config", QUICKSTART, "--out", str(sandbox.root / "o"), f"--hosts=n0,{host}",
                        "mesh.data=2", "rollout.urls=[http://gen:30000]"])
    assert message.startswith("python -m drgrpo_jax.launch: config error: --hosts: ")
    assert "is not an ssh destination" in message and not (sandbox.root / "o").exists()


@pytest.mark.parametrize("flag", ["--out", "--workdir", "--python", "--venv"])
def test_hosts_paths_with_a_newline_are_refused(sandbox, flag):
    values = {"--out": str(sandbox.root / "o"), "--workdir": str(sandbox.root), "--python": "python3", "--venv": "v"}
    values[flag] += NEWLINE
    message = _refusal(["hosts", "--config", QUICKSTART, "--hosts", "n1", *[f"{k}={v}" for k, v in values.items()]])
    assert message.startswith(f"python -m drgrpo_jax.launch: config error: {flag}: ")
    assert "has a newline or control character" in message
