"""Hosts over ssh (multi-node GPU), or N CPU processes here: `launch.sh` starts the generation services on the first
host (each on the last GPUs of it, rollout.service_mesh's devices each), waits for their /health, then one trainer
process per host (the first host is jax.distributed's coordinator, each process gets its id on its command line), and
stops the rest when one fails. The checkout (`workdir`) and the launch folder are the same paths on every host (a
shared disk), as run.output_dir must be: process 0 writes each weight version there for the services to load.

Every value reaches launch.sh as one quoted shell word; a remote command is built of quoted words and handed to ssh as
one more; the API key goes to a remote host on ssh's standard input, never on a command line."""

from __future__ import annotations

import dataclasses
import os
import shlex

from drgrpo_jax.config.schema import Config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.launch.cluster import (
    CONFIG_NAME,
    KEY_ENV,
    KEY_FILE,
    LOOPBACK,
    activate,
    assign,
    check_count,
    check_pattern,
    check_text,
    launch_path,
    refuse_loopback,
    serve_command,
    service_devices,
    train_command,
)

# ssh reads a part that starts with '-' as an option, and an empty host as none: each part is neither
HOST = (r"([A-Za-z0-9_][A-Za-z0-9_.-]*@)?[A-Za-z0-9_][A-Za-z0-9_.-]*",
        "an ssh destination (host or user@host, each part non-empty and without a leading '-')")
MEM_FRACTION = "0.9"  # XLA_PYTHON_CLIENT_MEM_FRACTION of a GPU trainer: what the plan's HEADROOM assumes


@dataclasses.dataclass(frozen=True)
class HostsOptions:
    launch_dir: str  # absolute: the rendered files and the logs
    workdir: str  # absolute: the checkout the processes run in, the same path on every host
    hosts: tuple[str, ...] = ()  # ssh destinations, one process each; localhost and 127.0.0.1 run here
    local: int = 0  # or this many CPU processes here (gloo collectives)
    gpus_per_host: int = 8
    serve_gpus: int = 0  # GPUs (CPU devices with local) of the first host for generation services
    local_devices: int = 1  # CPU devices of each local process
    port: int = 30000  # first service port
    coordinator_port: int = 8476
    python: str = "python3"
    venv: str = ""  # a virtual environment every process activates (absolute, or relative to workdir)
    health_timeout: int = 900

    @property
    def processes(self) -> int:
        return self.local or len(self.hosts)

    @property
    def names(self) -> tuple[str, ...]:
        return self.hosts or ("127.0.0.1",) * self.local


def _is_local(host: str) -> bool:
    return host in LOOPBACK


def _address(host: str) -> str:
    """The host's address as the others reach it (user@ dropped; localhost as 127.0.0.1)."""
    name = host.rpartition("@")[2]
    return "127.0.0.1" if _is_local(name) else name


def _check(config: Config, o: HostsOptions) -> None:
    if bool(o.hosts) == bool(o.local):
        raise ConfigError("--hosts", "give one of --hosts h1,h2,... (ssh) or --local N (CPU processes here)")
    for host in o.hosts:
        check_pattern("--hosts", host, *HOST)
    for flag, value in [("--out", o.launch_dir), ("--workdir", o.workdir), ("--python", o.python),
                        ("--venv", o.venv)]:
        check_text(flag, value)
    for flag, count, low in [("--local", o.local, 0), ("--gpus-per-host", o.gpus_per_host, 1),
                             ("--serve-gpus", o.serve_gpus, 0), ("--local-devices", o.local_devices, 1),
                             ("--port", o.port, 1), ("--coordinator-port", o.coordinator_port, 1),
                             ("--health-timeout", o.health_timeout, 1)]:
        check_count(flag, count, low)
    if config.mesh.num_processes != o.processes:
        raise ConfigError("--hosts", f"{o.processes} processes, but mesh.num_processes = {config.mesh.num_processes}")
    ways = service_devices(config)
    if o.serve_gpus % ways:
        raise ConfigError("--serve-gpus", f"{o.serve_gpus} GPUs do not split into services of {ways} "
                                          "(rollout.service_mesh)")
    if o.hosts and o.serve_gpus >= o.gpus_per_host:
        raise ConfigError("--serve-gpus", f"{o.serve_gpus} of --gpus-per-host {o.gpus_per_host} leave no GPU for the "
                                          "trainer")
    if not o.serve_gpus and not all(_is_local(h) for h in o.names):
        refuse_loopback(config, "give --serve-gpus K (services on the first host), or the services' host names")


def _key_env(config: Config, o: HostsOptions) -> str:
    """The variable the key travels in ('': no key): the config's, or KEY_ENV where the render starts services."""
    return config.rollout.api_key_env or (KEY_ENV if o.serve_gpus else "")


def own_key(config: Config, o: HostsOptions) -> bool:
    return bool(o.serve_gpus) and not config.rollout.api_key_env


def _service_urls(config: Config, o: HostsOptions) -> list[str]:
    ways = service_devices(config)
    first = _address(o.names[0])
    return [f"http://{first}:{o.port + k}" for k in range(o.serve_gpus // ways)] or list(config.rollout.urls)


def _remote(o: HostsOptions, key: str, command: str) -> str:
    """A remote host's command: in the checkout, the environment activated, the key read from standard input."""
    read_key = [f"IFS= read -r line && export {key}=\"${{line#*=}}\""] if key else []
    return " && ".join([f"cd {shlex.quote(o.workdir)}", *activate(o.venv), *read_key, command])


def _ssh(host: str, remote: str, key: str) -> str:
    return f"ssh -- {shlex.quote(host)} {shlex.quote(remote)}" + (" <<< \"$key_line\"" if key else "")


def _services(config: Config, o: HostsOptions, key: str) -> list[str]:
    """Lines that start the services on the first host: here (pids in $serve_pids) or over ssh (pids in a file)."""
    ways, host = service_devices(config), o.names[0]
    bind = "127.0.0.1" if all(_is_local(h) for h in o.names) else "0.0.0.0"
    logs = launch_path(o.launch_dir, o.workdir, "logs")
    lines = []
    for k in range(o.serve_gpus // ways):
        if o.local:
            env = ["JAX_PLATFORMS=cpu", *([f"XLA_FLAGS=--xla_force_host_platform_device_count={ways}"] * (ways > 1))]
        else:
            first = o.gpus_per_host - o.serve_gpus + k * ways
            env = [f"CUDA_VISIBLE_DEVICES={','.join(str(g) for g in range(first, first + ways))}"]
        serve = serve_command(o.python, config, launch_path(o.launch_dir, o.workdir, CONFIG_NAME), str(o.port + k),
                              key, host=bind)
        log = shlex.quote(f"{logs}/serve_{k}.log")
        if _is_local(host):
            lines.append(f"env {' '.join(env)} {serve} > {log} 2>&1 < /dev/null & serve_pids+=($!)")
        else:
            start = f"mkdir -p {shlex.quote(logs)} && {{ nohup env {' '.join(env)} {serve} > {log} 2>&1 < /dev/null " \
                    f"& echo $! >> {shlex.quote(logs + '/serve.pids')}; }}"
            lines.append(_ssh(host, _remote(o, key, start), key) + " || fail 'starting a service over ssh failed'")
    return lines


def _stop_services(o: HostsOptions) -> list[str]:
    lines = ["stop_services() {", "  for pid in \"${serve_pids[@]}\"; do kill \"$pid\"; done 2> /dev/null"]
    if o.serve_gpus and not _is_local(o.names[0]):
        pids = shlex.quote(launch_path(o.launch_dir, o.workdir, "logs", "serve.pids"))
        lines.append(f"  {_ssh(o.names[0], _remote(o, '', f'kill $(cat {pids}) 2> /dev/null; rm -f {pids}'), '')}"
                     " || true")
    return [*lines, "}", "trap stop_services EXIT"]


def _wait(o: HostsOptions, urls: list[str]) -> list[str]:
    """Every service's /health, from where the first trainer runs; services started here are watched meanwhile."""
    if not urls:
        return []
    tries, quoted = o.health_timeout // 2, " ".join(shlex.quote(u) for u in urls)
    if not _is_local(o.names[0]):
        loop = f"for u in {quoted}; do for t in $(seq {tries}); do curl -sf \"$u/health\" > /dev/null && continue 2; " \
               f"sleep 2; done; echo \"$u/health: no answer in {o.health_timeout} s\" >&2; exit 1; done"
        return [f"ssh -- {shlex.quote(o.names[0])} {shlex.quote(loop)} || fail 'the services did not answer /health'"]
    return [f"for u in {quoted}; do",
            f"  for t in $(seq {tries}); do",
            "    curl -sf \"$u/health\" > /dev/null && continue 2",
            "    for k in \"${!serve_pids[@]}\"; do kill -0 \"${serve_pids[$k]}\" 2> /dev/null || fail \"generation "
            "service $k exited before answering /health: $(tail -n 1 \"$logs/serve_$k.log\")\"; done",
            "    sleep 2",
            "  done",
            f"  fail \"$u/health: no answer in {o.health_timeout} s\"",
            "done"]


def _trainers(config: Config, o: HostsOptions, key: str, urls: list[str]) -> list[str]:
    words = [assign("rollout.urls", f"[{','.join(urls)}]")] if urls else []
    words += [assign("rollout.api_key_env", key)] if key else []
    lines = []
    for i, host in enumerate(o.names):
        dist = [assign("mesh.coordinator_address", f"{_address(o.names[0])}:{o.coordinator_port}"),
                f"mesh.num_processes={o.processes}", f"mesh.process_id={i}"] if o.processes > 1 else []
        if o.local:
            env = ["JAX_PLATFORMS=cpu", "JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo",
                   f"XLA_FLAGS=--xla_force_host_platform_device_count={o.local_devices}"]
        else:
            trainer_gpus = ",".join(str(g) for g in range(o.gpus_per_host - o.serve_gpus))
            env = [f"XLA_PYTHON_CLIENT_MEM_FRACTION={MEM_FRACTION}",
                   *([f"CUDA_VISIBLE_DEVICES={trainer_gpus}"] if i == 0 and o.serve_gpus else [])]
        train = train_command(o.python, launch_path(o.launch_dir, o.workdir, CONFIG_NAME), *dist, *words,
                              detect=False)
        log = f"\"$logs\"/train_{i}.log"
        command = f"env {' '.join(env)} {train}"
        start = command if _is_local(host) else _ssh(host, _remote(o, key, f"exec {command}"), key)
        lines.append(f"{start} > {log} 2>&1 & pids+=($!)")
    return lines


def launch_script(config: Config, o: HostsOptions) -> str:
    key = _key_env(config, o)
    if own_key(config, o):
        keyfile = shlex.quote(launch_path(o.launch_dir, o.workdir, KEY_FILE))
        key_lines = [f"IFS= read -r key_line < {keyfile} || fail {shlex.quote(f'{KEY_FILE}: no key')}",
                     f"export {key}=\"${{key_line#*=}}\""]
    elif key:
        key_lines = [f"[ -n \"${{{key}:-}}\" ] || fail \"rollout.api_key_env: {key} is not set or empty here\"",
                     f"key_line=\"{key}=${key}\""]
    else:
        key_lines = []
    where = f"{o.local} CPU processes here" if o.local else f"hosts {','.join(o.hosts)}"
    urls = _service_urls(config, o)
    lines = ["#!/bin/bash",
             f"# The trainer on {where}: the services first, then one process per host; the first failure stops",
             "# the rest. Logs: logs/ in this folder. Arguments: none (the run's settings are run.yaml).",
             "set -uo pipefail",
             f"cd {shlex.quote(o.workdir)} || exit 1", *activate(o.venv),
             f"logs={shlex.quote(launch_path(o.launch_dir, o.workdir, 'logs'))}; mkdir -p \"$logs\" || exit 1",
             "fail() { echo \"launch.sh: $*\" >&2; exit 1; }",
             *key_lines,
             "pids=() serve_pids=()",
             *_stop_services(o),
             *_services(config, o, key),
             *_wait(o, urls),
             *_trainers(config, o, key, urls),
             "rc=0",
             "while [ ${#pids[@]} -gt 0 ]; do  # the first failure stops the others",
             "  wait -n -p ended \"${pids[@]}\"; rc=$?",
             "  left=(); for p in \"${pids[@]}\"; do [ \"$p\" = \"$ended\" ] || left+=(\"$p\"); done",
             "  pids=(\"${left[@]}\")",
             "  [ $rc -eq 0 ] && continue",
             "  echo \"launch.sh: a trainer process exited $rc; stopping the others (logs in $logs)\" >&2",
             "  kill \"${pids[@]}\" 2> /dev/null; break",
             "done",
             f"for ((i = 0; i < {o.processes}; i++)); do",
             "  tail -n 3 \"$logs/train_$i.log\" | sed \"s/^/[process $i] /\"",
             "done",
             "exit $rc"]
    return "\n".join(lines) + "\n"


def render(config: Config, o: HostsOptions) -> dict[str, str]:
    _check(config, o)
    if not os.path.isabs(o.launch_dir) or not os.path.isabs(o.workdir):
        raise ConfigError("--out", f"the launch folder {o.launch_dir!r} and --workdir {o.workdir!r} must be absolute")
    return {"launch.sh": launch_script(config, o)}
