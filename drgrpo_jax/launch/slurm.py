"""SLURM: the trainer's and the generation services' sbatch scripts and the two-line submit script.

The services' job writes each service's URL under the launch folder; the trainer's job (started once the services'
job runs) waits for them, then runs one task per process with `mesh.coordinator_address=auto` (JAX reads SLURM's
variables). `--signal=B:TERM@S` warns the batch shell S seconds before the time limit; its trap hands SIGTERM to the
tasks (`scancel --signal=TERM`), every process saves the same step and exits 42, and the job requeues itself
(`--requeue`) to resume. srun gives the tasks STRAGGLER_WAIT_S to exit after the first one does: `--kill-on-bad-exit`
would kill the others at once on that first 42, and srun would then exit with their signal, not 42."""

from __future__ import annotations

import dataclasses
import shlex

from drgrpo_jax.config.schema import Config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.launch.cluster import RESTART_EXIT_CODE, run_shape, serve_command, service_devices, train_command

STRAGGLER_WAIT_S = 60  # after a task exits (42, or a crash), the others' time to exit before srun kills them


@dataclasses.dataclass(frozen=True)
class SlurmOptions:
    launch_dir: str  # absolute: the rendered files, the services' URL files and the job logs
    workdir: str  # the jobs' working directory (a checkout with drgrpo_jax installed, on every node)
    python: str = "python3"
    services: int = 0  # generation services to start (0: the config's rollout.urls)
    tasks_per_node: int = 1  # trainer processes per node (1: a process drives every GPU of its node)
    gpus_per_node: int | None = None  # None: the devices of a node's processes; 0: CPU nodes
    partition: str = ""
    time: str = ""  # --time, e.g. 24:00:00
    signal_seconds: int = 120
    port: int = 30000
    health_timeout_s: int = 900


def _header(name: str, lines: list[str], o: SlurmOptions) -> str:
    extra = ([f"--partition={o.partition}"] if o.partition else []) + ([f"--time={o.time}"] if o.time else [])
    directives = [f"--job-name={name}", *lines, *extra, f"--output={o.launch_dir}/logs/{name}_%j.log",
                  "--open-mode=append"]
    return "#!/bin/bash\n" + "".join(f"#SBATCH {d}\n" for d in directives)


def train_sbatch(config: Config, o: SlurmOptions) -> str:
    shape = run_shape(config)
    if shape.processes % o.tasks_per_node:
        raise ConfigError("--tasks-per-node", f"{o.tasks_per_node} does not divide mesh.num_processes = "
                                              f"{shape.processes}")
    gpus = shape.devices_per_process * o.tasks_per_node if o.gpus_per_node is None else o.gpus_per_node
    lines = [f"--nodes={shape.processes // o.tasks_per_node}", f"--ntasks-per-node={o.tasks_per_node}"]
    lines += [f"--gpus-per-node={gpus}"] if gpus else []
    lines += ["--requeue", f"--signal=B:TERM@{o.signal_seconds}"]
    body = [f"# trainer processes: {shape.processes}, devices each: {shape.devices_per_process} (mesh data x fsdp x "
            f"tensor = {shape.devices}); each process takes every device its task sees.", "set -uo pipefail",
            f"cd {shlex.quote(o.workdir)}"]
    if o.services:
        folder = f"{o.launch_dir}/services/${{DRGRPO_SERVE_JOB:?submit.sh sets it: the services job id}}"
        body += [f"urls=''; for t in $(seq {o.health_timeout_s // 2}); do",
                 f"  files=({folder}/*.url); [ -e \"${{files[0]}}\" ] && [ ${{#files[@]}} -ge {o.services} ] && "
                 "urls=$(cat \"${files[@]}\" | paste -sd,) && break; sleep 2",
                 f"done; [ -n \"$urls\" ] || {{ echo 'service URLs: fewer than {o.services} in "
                 f"{o.health_timeout_s} s' >&2; exit 1; }}"]
    else:
        body.append(f"urls={shlex.quote(','.join(config.rollout.urls))}")
    body += [f"for u in ${{urls//,/ }}; do for t in $(seq 0 {o.health_timeout_s // 2}); do",
             "  curl -sf \"$u/health\" > /dev/null && continue 2; sleep 2",
             f"done; echo \"$u/health: no answer in {o.health_timeout_s} s\" >&2; exit 1; done"]
    command = train_command(o.python, f"{o.launch_dir}/run.yaml", '"[$urls]"')
    key = f" rollout.api_key_env={config.rollout.api_key_env}" if config.rollout.api_key_env else ""
    body += [f"# every task exits 42 on a preemption; a task that crashed has the others killed {STRAGGLER_WAIT_S} s "
             "later",
             f"srun --kill-on-bad-exit=0 --wait={STRAGGLER_WAIT_S} {command}{key} \"$@\" &",
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
    """`o.services` services, rollout.service_mesh's devices each, every one on port + its rank on the node."""
    devices = service_devices(config)
    gpus = devices if o.gpus_per_node is None or o.gpus_per_node else 0
    lines = [f"--ntasks={o.services}"] + ([f"--gpus-per-task={gpus}"] if gpus else []) + ["--requeue"]
    folder = f"{o.launch_dir}/services/$SLURM_JOB_ID"
    serve = serve_command(o.python, config, f"{o.launch_dir}/run.yaml", "$port", bool(config.rollout.api_key_env))
    task = (f"port=$(({o.port} + SLURM_LOCALID)); echo http://$(hostname):$port > {folder}/$SLURM_PROCID.url; "
            f"exec {serve}")
    body = [f"# generation services: {o.services}, devices each: {devices} (rollout.service_mesh).",
            "set -euo pipefail",
            f"cd {shlex.quote(o.workdir)}", f"rm -rf {folder} && mkdir -p {folder}",
            f"srun bash -c {shlex.quote(task)}"]
    return _header("drgrpo-serve", lines, o) + "\n".join(body) + "\n"


def submit_script(o: SlurmOptions) -> str:
    here = shlex.quote(o.launch_dir)
    start = f"#!/bin/bash\nset -euo pipefail\nmkdir -p {here}/logs  # SLURM opens the logs, it makes no folder\n"
    if not o.services:
        return f"{start}sbatch --parsable {here}/train.sbatch \"$@\"\n"
    return (f"{start}# The services, then the trainer once they run (it waits for their URLs). Arguments: "
            "overrides for the trainer.\n"
            f"serve=$(sbatch --parsable {here}/serve.sbatch)\n"
            f"sbatch --parsable --dependency=after:$serve --export=ALL,DRGRPO_SERVE_JOB=$serve {here}/train.sbatch "
            "\"$@\"\n")


def render(config: Config, o: SlurmOptions) -> dict[str, str]:
    files = {"train.sbatch": train_sbatch(config, o), "submit.sh": submit_script(o)}
    if o.services:
        files["serve.sbatch"] = serve_sbatch(config, o)
    return files
