"""Cloud TPU VM slices: `launch.sh` runs one `gcloud compute tpus tpu-vm scp/ssh NAME --worker=all` per step, the
same on every worker (the trainer runs with `mesh.coordinator_address=auto`: JAX finds the pod, so there are no
per-worker process ids). It ships the working tree as it is (tracked and untracked files git does not ignore) and
run.yaml into each worker's run folder `~/drgrpo_run`, stops what an earlier launch left there, installs, starts the
generation services and waits for their /health, then starts the trainer detached, restarting it after exit 42 up to
`max_restarts` times. `stop.sh` stops the trainer and the services on every worker.

What a worker does is `worker.sh` (shipped beside the tree): every value reaches the workers inside it, one quoted
shell word each, and the ssh commands are constants that name no value."""

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
    check_count,
    check_pattern,
    check_text,
    refuse_loopback,
    run_shape,
    serve_command,
    service_devices,
    train_command,
    weights_root,
)

RUN_DIR = "~/drgrpo_run"  # each worker's run folder: src/, run.yaml, worker.sh, logs and pid files
# Chips a process takes on a TPU VM host, as libtpu's bounds (TPU_CHIPS_PER_PROCESS_BOUNDS)
CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
TPU_NAME = (r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", "a TPU VM name (lowercase letters, digits and '-', a letter first)")
ZONE = (r"[a-z]+-[a-z]+[0-9]+-[a-z]", "a Compute Engine zone (e.g. us-east5-a)")
PROJECT = (r"[a-z][-a-z0-9.:]{4,61}[a-z0-9]", "a Google Cloud project id")
IPS = (r"[0-9A-Fa-f.:]+(,[0-9A-Fa-f.:]+)*", "a comma-separated list of IP addresses")
VERSION = (r"[0-9][0-9A-Za-z.+-]*", "a version (e.g. 0.10.2)")
# The ssh commands: constants (the stand-in `gcloud` of the tests maps /tmp/ to the worker's own folder)
STOP_HERE = f"cd {RUN_DIR} 2> /dev/null && bash worker.sh stop; rm -f /tmp/libtpu_lockfile"
PREPARE = (f"mkdir -p {RUN_DIR} && mv ~/drgrpo_worker.sh {RUN_DIR}/worker.sh && cd {RUN_DIR} && bash worker.sh stop "
           "&& rm -f /tmp/libtpu_lockfile && bash worker.sh prepare")


@dataclasses.dataclass(frozen=True)
class TpuVmOptions:
    launch_dir: str  # absolute: the rendered files
    workdir: str  # absolute: the checkout whose working tree the launch ships
    tpu: str  # the trainer's TPU VM (its name, as gcloud knows it)
    zone: str
    project: str = ""  # "": gcloud's default
    serve_tpu: str = ""  # a TPU VM of its own for the services, serve_chips chips of each of its workers
    serve_ips: str = ""  # its workers' IPs, comma-separated; "": `gcloud describe` at launch
    serve_chips: int = 0  # without serve_tpu: chips of the trainer's one worker beyond the mesh's, for services
    port: int = 30000  # first service port on a worker
    venv: str = ""  # a virtual environment on the workers (relative: under $HOME), made if missing
    jax_version: str = ""  # jax[tpu]==V installed where a worker lacks it ("": no pin)
    install: str = ""  # a shell command run in the run folder instead of the default install
    max_restarts: int = 3  # restarts after exit 42
    stop_grace: int = 120  # seconds between SIGTERM and SIGKILL
    retries: int = 3  # tries again of a failed gcloud scp or ssh
    retry_delay: int = 10  # seconds before the first try again, doubled after each
    health_timeout: int = 900  # seconds a worker waits for every service's /health


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the chips go: the trainer's (a one-worker slice that also serves) and each service's."""

    services: int  # per worker of the slice that serves
    service_chips: int  # rollout.service_mesh's devices
    first_service_chip: int
    trainer_chips: int  # 0: every chip of the worker (no TPU_VISIBLE_CHIPS)


def _check(o: TpuVmOptions) -> None:
    for flag, value, rule in [("--tpu", o.tpu, TPU_NAME), ("--serve-tpu", o.serve_tpu, TPU_NAME),
                              ("--zone", o.zone, ZONE), ("--project", o.project, PROJECT),
                              ("--serve-ips", o.serve_ips, IPS), ("--jax-version", o.jax_version, VERSION)]:
        if value or flag in ("--tpu", "--zone"):
            check_pattern(flag, value, *rule)
    for flag, value in [("--out", o.launch_dir), ("--workdir", o.workdir), ("--venv", o.venv),
                        ("--install", o.install)]:
        check_text(flag, value)
    for flag, count, low in [("--serve-chips", o.serve_chips, 0), ("--port", o.port, 1),
                             ("--max-restarts", o.max_restarts, 0), ("--stop-grace", o.stop_grace, 0),
                             ("--retries", o.retries, 0), ("--retry-delay", o.retry_delay, 0),
                             ("--health-timeout", o.health_timeout, 1)]:
        check_count(flag, count, low)
    if o.serve_tpu and not o.serve_chips:
        raise ConfigError("--serve-chips", "needs at least 1 with --serve-tpu (the chips of each of its workers)")
    if o.serve_ips and not o.serve_tpu:
        raise ConfigError("--serve-ips", "names the workers of --serve-tpu; give --serve-tpu too")


def layout(config: Config, o: TpuVmOptions) -> Layout:
    ways = service_devices(config)
    if o.serve_chips % ways or (o.serve_chips and ways not in CHIP_BOUNDS):
        raise ConfigError("--serve-chips", f"{o.serve_chips} chips do not split into services of {ways} "
                                           f"(rollout.service_mesh); 1, 2, 4 or 8 chips can form a service")
    if not o.serve_chips or o.serve_tpu:
        return Layout(o.serve_chips // ways, ways, 0, 0)
    shape = run_shape(config)
    if shape.processes != 1:
        raise ConfigError("--serve-chips", "without --serve-tpu only on a one-worker slice (all chips of a pod "
                                           f"train), but mesh.num_processes = {shape.processes}")
    if shape.devices_per_process not in CHIP_BOUNDS:
        raise ConfigError("--serve-chips", f"the mesh's {shape.devices_per_process} trainer chips: 1, 2, 4 or 8 "
                                           "can form a process's chips")
    return Layout(o.serve_chips // ways, ways, shape.devices_per_process, shape.devices_per_process)


def _chips(first: int, count: int) -> str:
    """The environment that gives a process chips first..first+count-1 of its worker."""
    chips = ",".join(str(c) for c in range(first, first + count))
    return f"TPU_VISIBLE_CHIPS={chips} TPU_CHIPS_PER_PROCESS_BOUNDS={CHIP_BOUNDS[count]} TPU_PROCESS_BOUNDS=1,1,1"


def key_env(config: Config, o: TpuVmOptions) -> str:
    """The variable the key travels in ('': no key): the config's, or KEY_ENV where the render starts services."""
    return config.rollout.api_key_env or (KEY_ENV if o.serve_chips else "")


def own_key(config: Config, o: TpuVmOptions) -> bool:
    """The launch folder's KEY_FILE holds the key (else launch.sh reads rollout.api_key_env's variable)."""
    return bool(o.serve_chips) and not config.rollout.api_key_env


def _install(o: TpuVmOptions) -> str:
    if o.install:
        return f"bash -c -- {shlex.quote(o.install)}"  # --: an install that starts with '-' is still the command
    project = "python3 -m pip install -q -e 'src[train]'"
    if not o.jax_version:
        return project
    pin = shlex.quote(f"import jax, libtpu; assert jax.__version__ == {o.jax_version!r}")
    jax = shlex.quote(f"jax[tpu]=={o.jax_version}")
    return f"{{ python3 -c {pin} 2> /dev/null || python3 -m pip install -q {jax}; }} && {project}"


def _venv(o: TpuVmOptions) -> tuple[list[str], list[str]]:
    """The lines that make the virtual environment where missing (prepare), and that activate it."""
    if not o.venv:
        return [], []
    folder = shlex.quote(o.venv) if o.venv.startswith("/") else f"\"$HOME\"/{shlex.quote(o.venv)}"
    return [f"[ -f {folder}/bin/activate ] || python3 -m venv {folder}"], activate(o.venv, '"$HOME"')


def worker_script(config: Config, o: TpuVmOptions) -> str:
    """worker.sh: `prepare`, `serve`, `wait`, `train` or `stop` on one worker, run in its run folder."""
    chips = layout(config, o)
    key = key_env(config, o)
    make_venv, use_venv = _venv(o)
    load_key = [f"load_key() {{ IFS= read -r line < {KEY_FILE} && export {key}=\"${{line#*=}}\"; }}"] if key else \
        ["load_key() { :; }"]
    serve_host = "0.0.0.0" if o.serve_tpu else "127.0.0.1"  # services beside the trainer stay on loopback
    services = []
    for k in range(chips.services):
        first = chips.first_service_chip + k * chips.service_chips
        serve = serve_command("python3", config, CONFIG_NAME, str(o.port + k), key, host=serve_host,
                              config_word='"$run/run.yaml"')
        services.append(f"  {_chips(first, chips.service_chips)} TPU_PROCESS_PORT={8477 + k} setsid nohup {serve} "
                        f"> serve_{k}.log 2>&1 < /dev/null & echo $! >> serve.pids")
    trainer_env = f"{_chips(0, chips.trainer_chips)} " if chips.trainer_chips else ""
    words = [f"rollout.api_key_env={key}"] if key else []
    train = train_command("python3", CONFIG_NAME, *words, detect=not chips.trainer_chips,
                          config_word='"$run/run.yaml"')
    grace = o.stop_grace
    lines = [
        "#!/bin/bash",
        "# One TPU VM worker's part of the launch, run in its run folder by launch.sh and stop.sh through gcloud ssh:",
        "#   worker.sh prepare | serve | wait | train | stop",
        "set -uo pipefail",
        f"cd \"$HOME\"/{RUN_DIR.removeprefix('~/')} || exit 1",
        "run=$PWD",
        *load_key,
        "urls() { cat urls 2> /dev/null; }",
        "# SIGTERM to the trainer's and the services' process groups (pid files) and to any trainer or service run",
        "# from this folder (a lost pid file; [.] keeps the pattern from matching this shell), SIGKILL after the grace",
        "stop() {",
        "  s=\"drgrpo_jax[.](train|serve) --config $run/run[.]yaml\"; g=$(cat trainer.pid serve.pids 2> /dev/null)",
        "  sig() { for p in $g; do kill -\"$1\" -- -\"$p\"; done 2> /dev/null; pkill -\"$1\" -f \"$s\"; }",
        "  up() { for p in $g; do kill -0 -- -\"$p\" 2> /dev/null && return; done; pgrep -f \"$s\" > /dev/null; }",
        f"  sig TERM; for t in $(seq {grace}); do up || break; sleep 1; done; sig KILL",
        "  rm -f trainer.pid serve.pids",
        "}",
        "prepare() {",
        "  rm -rf src && mkdir src && tar -xzf ~/drgrpo_src.tar.gz -C src && rm ~/drgrpo_src.tar.gz &&",
        f"  mv ~/drgrpo_run.yaml {CONFIG_NAME} && mv ~/drgrpo_urls urls || return 1",
        *([f"  mv ~/drgrpo_api_key.env {KEY_FILE} && chmod 600 {KEY_FILE} || return 1"] if key else []),
        *[f"  {line} || return 1" for line in make_venv],
        *[f"  {line} || return 1" for line in use_venv],
        f"  {_install(o)}",
        "}",
        "serve() {",
        *[f"  {line} || return 1" for line in use_venv],
        "  load_key || return 1",
        *(services or ["  :"]),
        "}",
        f"wait_health() {{  # every service's /health, up to {o.health_timeout} s",
        f"  end=$(($(date +%s) + {o.health_timeout})); IFS=, read -ra list <<< \"$(urls)\"",
        "  for u in \"${list[@]}\"; do",
        "    until curl -sf --max-time 10 \"$u/health\" > /dev/null; do [ \"$(date +%s)\" -ge $end ] && return 3; "
        "sleep 2; done",
        "  done",
        "}",
        "train() {  # detached in a process group of its own (trainer.pid); a running trainer is left be",
        "  if [ -f trainer.pid ] && kill -0 -- -\"$(cat trainer.pid)\" 2> /dev/null; then",
        "    echo \"trainer already running: $(cat trainer.pid)\"; return 0",
        "  fi",
        "  u=$(urls); words=(); [ -z \"$u\" ] || words=(\"rollout.urls=[$u]\")",
        f"  {trainer_env}setsid nohup bash worker.sh restarts {train} \"${{words[@]}}\" > trainer.log 2>&1 "
        "< /dev/null & echo $! > trainer.pid",
        "}",
        f"restarts() {{  # the trainer, again after exit {RESTART_EXIT_CODE} (preempted, saved) up to "
        f"{o.max_restarts} times",
        *[f"  {line} || exit 1" for line in use_venv],
        "  load_key || exit 1",
        f"  n=0; while :; do \"$@\"; c=$?; [ $c -eq {RESTART_EXIT_CODE} ] && [ $n -lt {o.max_restarts} ] || exit $c",
        f"    n=$((n + 1)); echo \"worker.sh: the trainer saved and exited {RESTART_EXIT_CODE} (preempted): restart $n "
        f"of {o.max_restarts}\" >&2",
        "  done",
        "}",
        "case \"${1:-}\" in",
        "  prepare|serve|train|stop) \"$1\" ;;",
        "  wait) wait_health ;;",
        "  restarts) shift; restarts \"$@\" ;;",
        "  *) echo \"worker.sh: prepare, serve, wait, train or stop, not '${1:-}'\" >&2; exit 2 ;;",
        "esac",
    ]
    return "\n".join(lines) + "\n"


def _gcloud_helpers(o: TpuVmOptions, name: str) -> list[str]:
    scope = [f"--zone={o.zone}", *([f"--project={o.project}"] if o.project else [])]
    return [
        f"fail() {{ echo \"{name}: $*\" >&2; exit 1; }}",
        f"scope=({' '.join(shlex.quote(s) for s in scope)})",
        "retry() {  # CMD...: again after a doubling pause, up to --retries more times (a flaky ssh or scp)",
        "  local try=1",
        "  until \"$@\"; do",
        f"    [ $try -le {o.retries} ] || fail \"${{*:1:6}} failed $try times (--retries {o.retries}): gcloud's "
        "message is above\"",
        f"    echo \"{name}: ${{*:1:6}} failed (try $try of {o.retries + 1}); again in "
        f"$(({o.retry_delay} << (try - 1))) s\" >&2",
        f"    sleep $(({o.retry_delay} << (try - 1))); try=$((try + 1))",
        "  done",
        "}",
        "ssh_all() { retry gcloud compute tpus tpu-vm ssh \"$1\" --worker=all \"${scope[@]}\" --command=\"$2\"; }",
    ]


def _urls(config: Config, o: TpuVmOptions) -> list[str]:
    """Lines that write the trainer's service URLs, comma-separated, into $stage/drgrpo_urls."""
    chips = layout(config, o)
    ports = [o.port + k for k in range(chips.services)]
    if not o.serve_tpu:
        urls = [f"http://127.0.0.1:{p}" for p in ports] if o.serve_chips else list(config.rollout.urls)
        return [f"printf '%s\\n' {shlex.quote(','.join(urls))} > \"$stage/drgrpo_urls\""]
    ips = shlex.quote(o.serve_ips) if o.serve_ips else \
        f"\"$(gcloud compute tpus tpu-vm describe {shlex.quote(o.serve_tpu)} \"${{scope[@]}}\" " \
        "--format='value(networkEndpoints[].ipAddress)' | tr ';' ',')\""
    return [f"ips={ips}",
            "[[ \"$ips\" =~ ^[0-9A-Fa-f.:]+(,[0-9A-Fa-f.:]+)*$ ]] || fail \"--serve-tpu: no IP addresses of its "
            "workers: '$ips'\"",
            "urls=(); IFS=, read -ra list <<< \"$ips\"",
            f"for ip in \"${{list[@]}}\"; do for port in {' '.join(map(str, ports))}; do "
            "urls+=(\"http://$ip:$port\"); done; done",
            "(IFS=,; echo \"${urls[*]}\") > \"$stage/drgrpo_urls\""]


def _key_lines(config: Config, o: TpuVmOptions, launch: str) -> list[str]:
    """Stage the key file: the launch folder's, or the variable rollout.api_key_env names, from this shell."""
    if not key_env(config, o):
        return []
    stage = "\"$stage/drgrpo_api_key.env\""
    if own_key(config, o):
        return [f"cp {launch}/{KEY_FILE} {stage}", f"shipped+=({stage})"]
    name = config.rollout.api_key_env
    return [f"[ -n \"${{{name}:-}}\" ] || fail \"rollout.api_key_env: {name} is not set or empty here\"",
            f"(umask 077; printf '%s=%s\\n' {name} \"${name}\" > {stage})", f"shipped+=({stage})"]


def launch_script(config: Config, o: TpuVmOptions) -> str:
    launch, work = shlex.quote(o.launch_dir), shlex.quote(o.workdir)
    tpu, serve_tpu = shlex.quote(o.tpu), shlex.quote(o.serve_tpu)
    prepare_and_serve = f"{PREPARE} && bash worker.sh serve"
    lines = [
        "#!/bin/bash",
        f"# The run on every worker of TPU VM {o.tpu}: ship the working tree of {o.workdir} and run.yaml, install,",
        "# start the services and wait for their /health, then start the trainer detached. Stop: stop.sh beside it.",
        "set -euo pipefail",
        *_gcloud_helpers(o, "launch.sh"),
        "stage=$(mktemp -d /tmp/drgrpo_launch.XXXXXX); trap 'rm -rf \"$stage\"' EXIT",
        f"git -C {work} ls-files -z -co --exclude-standard | grep -zvxFf <(git -C {work} ls-files -d) | "
        f"tar -C {work} --null -T - -czf \"$stage/drgrpo_src.tar.gz\" || "
        f"fail {shlex.quote(f'packing the working tree {o.workdir} failed')}",
        f"cp {launch}/{CONFIG_NAME} \"$stage/drgrpo_run.yaml\" && cp {launch}/worker.sh \"$stage/drgrpo_worker.sh\"",
        "shipped=(\"$stage/drgrpo_src.tar.gz\" \"$stage/drgrpo_run.yaml\" \"$stage/drgrpo_worker.sh\" "
        "\"$stage/drgrpo_urls\")",
        *_urls(config, o),
        *_key_lines(config, o, launch),
    ]
    serve_on = serve_tpu if o.serve_tpu else (tpu if o.serve_chips else "")
    def scp(name: str) -> str:
        return f"retry gcloud compute tpus tpu-vm scp \"${{shipped[@]}}\" {name}: --worker=all \"${{scope[@]}}\""

    if o.serve_tpu:
        lines += [scp(serve_tpu), f"ssh_all {serve_tpu} {shlex.quote(prepare_and_serve)}"]
    lines += [scp(tpu),
              f"ssh_all {tpu} {shlex.quote(prepare_and_serve if o.serve_chips and not o.serve_tpu else PREPARE)}"]
    if o.serve_chips or config.rollout.urls:
        stopped = f"; stopped the services, their logs: {RUN_DIR}/serve_*.log on {serve_on}" if serve_on else ""
        wait = shlex.quote(f"cd {RUN_DIR} && bash worker.sh wait")
        lines += [f"if ! gcloud compute tpus tpu-vm ssh {tpu} --worker=all \"${{scope[@]}}\" --command={wait}; then",
                  *([f"  ssh_all {serve_on} {shlex.quote(STOP_HERE)} > /dev/null 2>&1 || true"] if serve_on else []),
                  f"  fail \"no answer from $(tr , ' ' < \"$stage/drgrpo_urls\") /health on a worker of {o.tpu} within "
                  f"{o.health_timeout} s (--health-timeout){stopped}\"",
                  "fi"]
    scope = shlex.join([f"--zone={o.zone}", *([f"--project={o.project}"] if o.project else [])])
    tail = shlex.quote(f"tail -f {RUN_DIR.removeprefix('~/')}/trainer.log")
    follow = f"  gcloud compute tpus tpu-vm ssh {o.tpu} --worker=0 {scope} --command={tail}"
    stop = f"Stop (services too): bash {shlex.quote(os.path.join(o.launch_dir, 'stop.sh'))}"
    lines += [f"ssh_all {tpu} {shlex.quote(f'cd {RUN_DIR} && bash worker.sh train')}",
              f"echo \"Started on every worker of {o.tpu}; each worker's log is {RUN_DIR}/trainer.log, e.g.\"",
              f"echo {shlex.quote(follow)}", f"echo {shlex.quote(stop)}"]
    return "\n".join(lines) + "\n"


def stop_script(o: TpuVmOptions) -> str:
    """SIGTERM to the trainer and the services on every worker (the trainer saves), SIGKILL after the grace."""
    slices = [o.tpu, *([o.serve_tpu] if o.serve_tpu else [])]
    return "\n".join(["#!/bin/bash", f"# Stops the run on every worker of {', '.join(slices)}.", "set -euo pipefail",
                      *_gcloud_helpers(o, "stop.sh"),
                      *[f"ssh_all {shlex.quote(s)} {shlex.quote(STOP_HERE)}" for s in slices]]) + "\n"


def render(config: Config, o: TpuVmOptions) -> dict[str, str]:
    _check(o)
    root = weights_root(config)
    if o.serve_tpu and not root.startswith(("gs://", "/")):
        key = "run.weights_dir" if config.run.weights_dir else "run.output_dir"
        raise ConfigError(key, f"{root!r} is relative: each worker's own disk, which the services on --serve-tpu do "
                               "not see; give a path both slices mount (a shared disk, gcsfuse) or gs://BUCKET/PATH")
    if not o.serve_chips:
        refuse_loopback(config, "give --serve-chips K (services on this slice), or the services' host names")
    return {"launch.sh": launch_script(config, o), "stop.sh": stop_script(o), "worker.sh": worker_script(config, o)}
