"""SLURM: the trainer's and the generation services' sbatch scripts and the submit script.

The services' job writes each service's URL under the launch folder; the trainer's job (started once the services'
job runs) waits for them, then runs one task per process with `mesh.coordinator_address=auto` (JAX reads SLURM's
variables). `--signal=B:TERM@S` warns the batch shell S seconds before the time limit; its trap hands SIGTERM to the
tasks (`scancel --signal=TERM`), every process saves the same step and exits 42, and the job requeues itself
(`--requeue`) to resume. srun gives the tasks STRAGGLER_WAIT_S to exit after the first one does: `--kill-on-bad-exit`
would kill the others at once on that first 42, and srun would then exit with their signal, not 42.

Every value reaches the scripts as one quoted shell word; the #SBATCH lines carry only values checked against what
sbatch allows (paths go on submit.sh's sbatch command line, where the shell quotes them). The scripts `cd` into the
working folder and name the launch folder relative to it when it lies inside."""

from __future__ import annotations

import dataclasses
import os
import shlex

from drgrpo_jax.checkpoint import RESTART_EXIT_CODE
from drgrpo_jax.config.schema import Config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.launch.cluster import (
    CONFIG_NAME,
    KEY_ENV,
    KEY_FILE,
    activate,
    assign,
    check_count,
    check_pattern,
    check_text,
    launch_path,
    refuse_loopback,
    run_shape,
    serve_command,
    service_devices,
    train_command,
)

STRAGGLER_WAIT_S = 60  # after a task exits (42, or a crash), the others' time to exit before srun kills them
TRAINER_SPARE_CPUS = 4  # a trainer task's CPUs beyond its reward workers: the host loop, the rollout and push threads
SERVICE_CPUS = 4  # a service's CPUs: its HTTP server, tokenizer and weight loads

# What sbatch accepts in each field (a newline would end the #SBATCH line and run the rest as a command)
PARTITION = (r"[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*", "a partition name (or a comma-separated list)")
TIME = (r"(\d+-)?\d+(:\d+){0,2}|UNLIMITED|infinite", "a SLURM time ([D-]HH:MM:SS, MM, or UNLIMITED)")
ACCOUNT = (r"[A-Za-z0-9_.-]+", "an account name")
MEMORY = (r"\d+[KMGT]?", "a SLURM memory size (e.g. 0, 200G)")


@dataclasses.dataclass(frozen=True)
class SlurmOptions:
    launch_dir: str  # absolute: the rendered files, the services' URL files and the job logs
    workdir: str  # absolute: the jobs' working directory (a checkout with drgrpo_jax installed, on every node)
    python: str = "python3"  # the interpreter on the nodes (a path, e.g. a virtual environment's bin/python)
    services: int = 0  # generation services to start (0: the config's rollout.urls)
    tasks_per_node: int = 1  # trainer processes per node (1: a process drives every GPU of its node)
    gpus_per_node: int | None = None  # None: the devices of a node's processes; 0: CPU nodes
    partition: str = ""
    time: str = ""  # --time, e.g. 24:00:00
    signal_seconds: int = 120
    port: int = 30000
    health_timeout_s: int = 900
    account: str = ""
    cpus_per_task: int | None = None  # None: reward.num_workers + TRAINER_SPARE_CPUS for each trainer task
    mem: str = "0"  # --mem of each trainer node; 0: all of the node's memory
    exclusive: bool = True  # the trainer's nodes to itself (it takes every device of each)
    venv: str = ""  # a virtual environment the jobs activate (absolute, or relative to workdir)


def _check(o: SlurmOptions) -> None:
    """Every field that reaches a #SBATCH line or a path; a ConfigError names the flag."""
    for flag, value, (pattern, what) in [("--partition", o.partition, PARTITION), ("--time", o.time, TIME),
                                         ("--account", o.account, ACCOUNT), ("--mem", o.mem, MEMORY)]:
        if value:
            check_pattern(flag, value, pattern, what)
    for flag, value in [("--out", o.launch_dir), ("--workdir", o.workdir), ("--python", o.python),
                        ("--venv", o.venv)]:
        check_text(flag, value)
    if not os.path.isabs(o.launch_dir) or not os.path.isabs(o.workdir):
        raise ConfigError("--out", f"the launch folder {o.launch_dir!r} and --workdir {o.workdir!r} must be absolute")
    for flag, count, low in [("--services", o.services, 0), ("--tasks-per-node", o.tasks_per_node, 1),
                             ("--port", o.port, 1), ("--cpus-per-task", o.cpus_per_task or 1, 1)]:
        check_count(flag, count, low)


def _launch_path(o: SlurmOptions, *parts: str) -> str:
    """A path in the launch folder as the jobs see it: relative to the working folder when it lies inside."""
    return launch_path(o.launch_dir, o.workdir, *parts)


def _header(name: str, lines: list[str], o: SlurmOptions) -> str:
    extra = [f"--{key}={value}" for key, value in (("partition", o.partition), ("time", o.time),
                                                   ("account", o.account)) if value]
    directives = [f"--job-name={name}", *lines, *extra, "--open-mode=append"]
    return "#!/bin/bash\n" + "".join(f"#SBATCH {d}\n" for d in directives)


def _urls_from_services(o: SlurmOptions) -> list[str]:
    """Waits for the services' URL files (their job writes one per service) and joins them into $urls."""
    folder = shlex.quote(_launch_path(o, "services")) + '/"${DRGRPO_SERVE_JOB:?submit.sh sets it: the services job}"'
    return [f"urls=''; for t in $(seq {o.health_timeout_s // 2}); do",
            f"  files=({folder}/*.url); [ -e \"${{files[0]}}\" ] && [ ${{#files[@]}} -ge {o.services} ] && "
            "urls=$(cat \"${files[@]}\" | paste -sd,) && break; sleep 2",
            f"done; [ -n \"$urls\" ] || {{ echo 'service URLs: fewer than {o.services} in {o.health_timeout_s} s' "
            ">&2; exit 1; }"]


def own_key(config: Config, o: SlurmOptions) -> bool:
    """The services this render starts use the launch folder's KEY_FILE, unless rollout.api_key_env names the
    variable the submitting shell holds the key in (sbatch and srun pass the environment on)."""
    return bool(o.services) and not config.rollout.api_key_env


def _key(config: Config, o: SlurmOptions) -> tuple[list[str], str]:
    """The lines that export the key, and the variable that holds it ('' : no key)."""
    if not own_key(config, o):
        return [], config.rollout.api_key_env
    path = shlex.quote(_launch_path(o, KEY_FILE))
    read = f"IFS== read -r _ {KEY_ENV} < {path} && export {KEY_ENV} || {{ echo {path}: no key >&2; exit 1; }}"
    return [read], KEY_ENV


def train_sbatch(config: Config, o: SlurmOptions) -> str:
    shape = run_shape(config)
    if shape.processes % o.tasks_per_node:
        raise ConfigError("--tasks-per-node", f"{o.tasks_per_node} does not divide mesh.num_processes = "
                                              f"{shape.processes}")
    gpus = shape.devices_per_process * o.tasks_per_node if o.gpus_per_node is None else o.gpus_per_node
    cpus = o.cpus_per_task or config.reward.num_workers + TRAINER_SPARE_CPUS
    lines = [f"--nodes={shape.processes // o.tasks_per_node}", f"--ntasks-per-node={o.tasks_per_node}",
             f"--cpus-per-task={cpus}"]
    lines += [f"--gpus-per-node={gpus}"] if gpus else []
    lines += [f"--mem={o.mem}"] if o.mem else []
    lines += ["--exclusive"] if o.exclusive else []
    lines += ["--requeue", f"--signal=B:TERM@{o.signal_seconds}"]
    body = [f"# trainer processes: {shape.processes}, devices each: {shape.devices_per_process} (mesh data x fsdp x "
            f"tensor = {shape.devices}); each process takes every device its task sees.", "set -uo pipefail",
            f"cd {shlex.quote(o.workdir)}", *activate(o.venv)]
    if o.services:
        body += _urls_from_services(o)
    else:
        refuse_loopback(config, "give --services N, or the services' host names")
        body.append(f"urls={shlex.quote(','.join(config.rollout.urls))}")
    body += ["IFS=, read -ra services <<< \"$urls\"",
             f"for u in \"${{services[@]}}\"; do for t in $(seq 0 {o.health_timeout_s // 2}); do",
             "  curl -sf \"$u/health\" > /dev/null && continue 2; sleep 2",
             f"done; echo \"$u/health: no answer in {o.health_timeout_s} s\" >&2; exit 1; done"]
    export, key_env = _key(config, o)
    key = [assign("rollout.api_key_env", key_env)] if key_env else []
    command = train_command(o.python, _launch_path(o, CONFIG_NAME), '"rollout.urls=[$urls]"', *key)
    body += [*export,
             f"# every task exits 42 on a preemption; a task that crashed has the others killed {STRAGGLER_WAIT_S} s "
             "later",
             f"srun --kill-on-bad-exit=0 --wait={STRAGGLER_WAIT_S} {command} \"$@\" &",
             "trainer=$!",
             "# the steps' tasks get it (a signal only, no kill after KillWait): they save and exit "
             f"{RESTART_EXIT_CODE}",
             "trap 'scancel --signal=TERM \"$SLURM_JOB_ID\"' TERM",
             "wait $trainer; rc=$?",
             "while kill -0 $trainer 2> /dev/null; do wait $trainer; rc=$?; done  # the trap ended the first wait",
             f"if [ $rc -eq {RESTART_EXIT_CODE} ]; then scontrol requeue \"$SLURM_JOB_ID\"; exit 0; fi"]
    if o.services:
        body.append("scancel \"$DRGRPO_SERVE_JOB\"  # done or failed: the services go too")
    body.append("exit $rc")
    return _header("drgrpo-train", lines, o) + "\n".join(body) + "\n"


def serve_sbatch(config: Config, o: SlurmOptions) -> str:
    """`o.services` services, rollout.service_mesh's devices each, every one on port + its rank on the node. Each
    task's script gets the URL folder as $1, so no path is pasted into it."""
    devices = service_devices(config)
    gpus = devices if o.gpus_per_node is None or o.gpus_per_node else 0
    lines = [f"--ntasks={o.services}", f"--cpus-per-task={SERVICE_CPUS}"]
    lines += ([f"--gpus-per-task={gpus}"] if gpus else []) + ["--requeue"]
    export, key_env = _key(config, o)
    serve = serve_command(o.python, config, _launch_path(o, CONFIG_NAME), "$port", key_env)
    task = f"port=$(({o.port} + SLURM_LOCALID)); echo \"http://$(hostname):$port\" > \"$1/$SLURM_PROCID.url\"; " \
           f"exec {serve}"
    body = [f"# generation services: {o.services}, devices each: {devices} (rollout.service_mesh).",
            "set -euo pipefail",
            f"cd {shlex.quote(o.workdir)}", *activate(o.venv), *export,
            f"folder={shlex.quote(_launch_path(o, 'services'))}/\"$SLURM_JOB_ID\"",
            "rm -rf \"$folder\" && mkdir -p \"$folder\"",
            f"srun bash -c {shlex.quote(task)} serve \"$folder\""]
    return _header("drgrpo-serve", lines, o) + "\n".join(body) + "\n"


def submit_script(o: SlurmOptions) -> str:
    """Submits from the working folder, each job's log under the launch folder (a path sbatch takes from the
    shell, quoted, never from a #SBATCH line). Arguments: overrides for the trainer."""
    def log(name: str) -> str:
        return shlex.quote(f"--output={_launch_path(o, 'logs', name)}_%j.log")

    start = ["#!/bin/bash", "set -euo pipefail", f"cd {shlex.quote(o.workdir)}",
             f"mkdir -p {shlex.quote(_launch_path(o, 'logs'))}  # SLURM opens the logs, it makes no folder"]
    train = shlex.quote(_launch_path(o, "train.sbatch"))
    if not o.services:
        return "\n".join([*start, f"sbatch --parsable {log('drgrpo-train')} {train} \"$@\""]) + "\n"
    serve = shlex.quote(_launch_path(o, "serve.sbatch"))
    return "\n".join([*start, "# The services, then the trainer once they run (it waits for their URLs).",
                      f"serve=$(sbatch --parsable {log('drgrpo-serve')} {serve}); serve=${{serve%%;*}}  # id[;cluster]",
                      f"sbatch --parsable --dependency=after:\"$serve\" --export=ALL,DRGRPO_SERVE_JOB=\"$serve\" "
                      f"{log('drgrpo-train')} {train} \"$@\""]) + "\n"


def render(config: Config, o: SlurmOptions) -> dict[str, str]:
    _check(o)
    files = {"train.sbatch": train_sbatch(config, o), "submit.sh": submit_script(o)}
    if o.services:
        files["serve.sbatch"] = serve_sbatch(config, o)
    return files
