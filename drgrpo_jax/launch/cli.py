"""python -m drgrpo_jax.launch {slurm,gke,skypilot,tpu-vm,hosts} --config PATH --out DIR [options]
[section.key=value ...]: writes the resolved config (run.yaml) and the engine's files into DIR and prints how to start
them."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shlex
import sys

from drgrpo_jax.config.load import load_config
from drgrpo_jax.config.schema import Config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.launch import gke, hosts, skypilot, slurm, tpu_vm
from drgrpo_jax.launch.cluster import CONFIG_NAME, KEY_FILE, launch_config, new_key_file

PROG = "python -m drgrpo_jax.launch"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    engines = parser.add_subparsers(dest="engine", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", required=True, help="the run's YAML")
    common.add_argument("--out", required=True, help="folder for run.yaml and the engine's files")
    common.add_argument("overrides", nargs="*", help="dotted overrides of the config, e.g. train.steps=100")
    s = engines.add_parser("slurm", parents=[common], help="sbatch scripts for the trainer and its services")
    s.add_argument("--services", type=int, default=0, help="generation services to start (0: rollout.urls)")
    s.add_argument("--tasks-per-node", type=int, default=1, help="trainer processes per node (default 1)")
    s.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per trainer node (default: the mesh's devices per node; 0: CPU nodes)")
    s.add_argument("--partition", default="", help="--partition of the jobs (default: the cluster's)")
    s.add_argument("--time", default="", help="--time of the jobs, e.g. 24:00:00")
    s.add_argument("--account", default="", help="--account of the jobs")
    s.add_argument("--cpus-per-task", type=int, default=None,
                   help="CPUs of each trainer task (default: reward.num_workers + 4)")
    s.add_argument("--mem", default="0", help="--mem of each trainer node (default 0: all of its memory)")
    s.add_argument("--exclusive", action=argparse.BooleanOptionalAction, default=True,
                   help="the trainer's nodes to itself (default: yes)")
    s.add_argument("--workdir", default=os.getcwd(),
                   help="the jobs' working directory, a checkout on every node (default: here); the scripts name "
                        "the launch folder relative to it")
    s.add_argument("--python", default="python3",
                   help="the interpreter on the nodes, e.g. a virtual environment's bin/python (default python3)")
    s.add_argument("--port", type=int, default=30000, help="first service port on a node")
    s.add_argument("--venv", default="", help="a virtual environment the jobs activate (relative: to --workdir)")
    g = engines.add_parser("gke", parents=[common], help="a JobSet, the services and the xpk command")
    g.add_argument("--tpu", required=True, help="the trainer's TPU slice type, e.g. v5p-64")
    g.add_argument("--serve-tpu", default="v5litepod-4", help="each service's TPU slice type (default v5litepod-4)")
    g.add_argument("--services", type=int, default=1, help="generation services (StatefulSet replicas)")
    g.add_argument("--image", required=True, help="container image with drgrpo_jax[train] and jax[tpu] installed")
    g.add_argument("--name", default="drgrpo", help="name prefix of the Kubernetes objects")
    g.add_argument("--max-restarts", type=int, default=10, help="restarts after preemption (exit 42) at most")
    g.add_argument("--cluster", default="CLUSTER", help="the GKE cluster (for the xpk command)")
    k = engines.add_parser("skypilot", parents=[common], help="task YAMLs for a TPU pod or a GPU cluster")
    k.add_argument("--tpu", default="", help="a TPU slice type, e.g. v5p-64 (or --gpus)")
    k.add_argument("--gpus", default="", help="GPUs per node, e.g. H100:8 (or --tpu)")
    k.add_argument("--max-restarts", type=int, default=10, help="managed-job restarts on failure (exit 42) at most")
    k.add_argument("--workdir", default=os.getcwd(),
                   help="the checkout SkyPilot copies to the nodes and installs there (default: here)")
    _tpu_vm_parser(engines.add_parser("tpu-vm", parents=[common], help="Cloud TPU VM slices over gcloud ssh: "
                                      "launch.sh, stop.sh and each worker's worker.sh"))
    _hosts_parser(engines.add_parser("hosts", parents=[common], help="GPU hosts over ssh, or N CPU processes here: "
                                     "launch.sh"))
    return parser


def _tpu_vm_parser(t: argparse.ArgumentParser) -> None:
    t.add_argument("--tpu", required=True, help="the trainer's TPU VM, by its name")
    t.add_argument("--zone", required=True, help="its zone, e.g. us-east5-a")
    t.add_argument("--project", default="", help="the gcloud project (default: gcloud's)")
    t.add_argument("--serve-tpu", default="", help="a TPU VM of its own for the generation services")
    t.add_argument("--serve-ips", default="",
                   help="its workers' IPs, ip,ip,... (default: gcloud describe at launch)")
    t.add_argument("--serve-chips", type=int, default=0,
                   help="chips for services on each --serve-tpu worker or, without it, on the trainer's one worker "
                        "beyond the mesh's (rollout.service_mesh's chips each; default 0: rollout.urls)")
    t.add_argument("--port", type=int, default=30000, help="first service port on a worker")
    t.add_argument("--workdir", default=os.getcwd(), help="the checkout whose working tree the launch ships "
                                                         "(default: here)")
    t.add_argument("--venv", default="",
                   help="a virtual environment on the workers (relative: under the home folder), made if missing")
    t.add_argument("--jax-version", default=_local_jax(),
                   help="jax[tpu]==V where a worker lacks it (default: the jax installed here)")
    t.add_argument("--install", default="",
                   help="a shell command run in each worker's run folder instead of the default install")
    t.add_argument("--max-restarts", type=int, default=3, help="restarts after exit 42 (preempted, saved)")
    t.add_argument("--stop-grace", type=int, default=120, help="seconds from SIGTERM to SIGKILL in stop.sh")
    t.add_argument("--retries", type=int, default=3, help="tries again of a failed gcloud scp or ssh")
    t.add_argument("--retry-delay", type=int, default=10, help="seconds before the first try again, then doubled")
    t.add_argument("--health-timeout", type=int, default=900, help="seconds to wait for the services' /health")


def _hosts_parser(h: argparse.ArgumentParser) -> None:
    where = h.add_mutually_exclusive_group(required=True)
    where.add_argument("--hosts", default="", help="h1,h2,...: one process per host over ssh (localhost: here); "
                                                  "h1 is the coordinator")
    where.add_argument("--local", type=int, default=0, help="N CPU processes here (gloo collectives)")
    h.add_argument("--gpus-per-host", type=int, default=8, help="GPUs on each host (default 8)")
    h.add_argument("--serve-gpus", type=int, default=0,
                   help="GPUs of the first host for generation services, its last ones (CPU devices with --local); "
                        "default 0: rollout.urls")
    h.add_argument("--local-devices", type=int, default=1, help="CPU devices of each --local process")
    h.add_argument("--port", type=int, default=30000, help="first service port")
    h.add_argument("--coordinator-port", type=int, default=8476, help="jax.distributed's port on the first host")
    h.add_argument("--workdir", default=os.getcwd(),
                   help="the checkout the processes run in, the same path on every host (default: here)")
    h.add_argument("--python", default="python3", help="the interpreter on the hosts (default python3)")
    h.add_argument("--venv", default="", help="a virtual environment the processes activate (relative: to --workdir)")
    h.add_argument("--health-timeout", type=int, default=900, help="seconds to wait for the services' /health")


def _local_jax() -> str:
    try:
        return importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _render(args: argparse.Namespace, config: Config) -> tuple[dict[str, str], str, bool]:
    """The engine's files, the line that starts them, and whether they read the launch folder's KEY_FILE."""
    out = os.path.abspath(args.out)
    if args.engine == "slurm":
        batch = slurm.SlurmOptions(out, os.path.abspath(args.workdir), args.python, args.services,
                                   args.tasks_per_node, args.gpus_per_node, args.partition, args.time, port=args.port,
                                   account=args.account, cpus_per_task=args.cpus_per_task, mem=args.mem,
                                   exclusive=args.exclusive, venv=args.venv)
        return slurm.render(config, batch), f"bash {shlex.quote(out + '/submit.sh')}", slurm.own_key(config, batch)
    if args.engine == "gke":
        k8s = gke.GkeOptions(args.tpu, args.serve_tpu, args.services, args.image, args.name, args.max_restarts,
                             args.cluster)
        secret = shlex.join(["kubectl", "create", "secret", "generic", f"{args.name}-api-key",
                             f"--from-env-file={out}/{KEY_FILE}"])
        start = f"{secret} && kubectl apply -f {shlex.quote(out)}  (or: bash {shlex.quote(out + '/xpk.sh')})"
        return gke.render(config, k8s), start, True
    if args.engine == "tpu-vm":
        tpu = tpu_vm.TpuVmOptions(out, os.path.abspath(args.workdir), args.tpu, args.zone, args.project, args.serve_tpu,
                                  args.serve_ips, args.serve_chips, args.port, args.venv, args.jax_version,
                                  args.install, args.max_restarts, args.stop_grace, args.retries, args.retry_delay,
                                  args.health_timeout)
        return tpu_vm.render(config, tpu), f"bash {shlex.quote(out + '/launch.sh')}", tpu_vm.own_key(config, tpu)
    if args.engine == "hosts":
        ssh = _hosts_options(args, out)
        return hosts.render(config, ssh), f"bash {shlex.quote(out + '/launch.sh')}", hosts.own_key(config, ssh)
    sky = skypilot.SkyOptions(out, os.path.abspath(args.workdir), args.tpu, args.gpus, args.max_restarts)
    return skypilot.render(config, sky), f"sky jobs launch {shlex.quote(out + '/task.yaml')}", False


def _hosts_options(args: argparse.Namespace, out: str) -> hosts.HostsOptions:
    names = tuple(args.hosts.split(",")) if args.hosts else ()
    return hosts.HostsOptions(out, os.path.abspath(args.workdir), names, args.local, args.gpus_per_host,
                              args.serve_gpus, args.local_devices, args.port, args.coordinator_port, args.python,
                              args.venv, args.health_timeout)


def _stand_ins(args: argparse.Namespace) -> list[str]:
    """What is known only at launch, so that the config's rules pass: the coordinator, the URLs of the services the
    render starts, and (hosts) the process count the host list gives."""
    words = ["mesh.coordinator_address=detected-at-launch:8476"]
    if getattr(args, "services", 0) or getattr(args, "serve_chips", 0) or getattr(args, "serve_gpus", 0):
        words.append("rollout.urls=[http://started-services:30000]")
    if args.engine == "hosts":
        words.append(f"mesh.num_processes={args.local or len(args.hosts.split(','))}")
    return words


def _write_key_file(folder: str) -> None:
    """KEY_FILE, readable by its owner only; one already there is kept (running services hold that key)."""
    try:
        fd = os.open(os.path.join(folder, KEY_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(new_key_file())


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config, [*_stand_ins(args), *args.overrides])
        files, start, key = _render(args, config)
    except ConfigError as error:
        sys.exit(f"{PROG}: config error: {error}")
    os.makedirs(args.out, exist_ok=True)
    for name, text in {CONFIG_NAME: launch_config(config), **files}.items():
        with open(os.path.join(args.out, name), "w") as f:
            f.write(text)
    if key:
        _write_key_file(args.out)
    written = [CONFIG_NAME, *files, *([KEY_FILE] if key else [])]
    print(f"wrote {', '.join(written)} to {args.out}; start: {start}")
