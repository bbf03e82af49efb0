"""What every engine's files share: the hosts and devices the run config asks for, the accelerators that hold them,
the resolved config the hosts read, and the trainer's and services' command lines."""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shlex
import urllib.parse

from drgrpo_jax.config.load import dump_config
from drgrpo_jax.config.schema import Config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.sharding import parse_service_mesh

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
LOOPBACK = ("localhost", "127.0.0.1", "::1")
CONFIG_NAME = "run.yaml"  # the resolved config beside the rendered files; every host and service reads it
# The services' API key, in the launch folder (mode 0600, written by the first render, kept by later ones) as
# KEY_ENV=<key>: what `kubectl create secret --from-env-file` and `xpk --env-file` read, and the sbatch scripts too.
KEY_FILE = "api_key.env"
KEY_ENV = "DRGRPO_API_KEY"  # the variable the services and the trainer find the key in (rollout.api_key_env)


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """A Cloud TPU slice type as GKE and SkyPilot name it."""

    name: str  # v5p-64, v5litepod-16, v6e-8
    gke_accelerator: str  # cloud.google.com/gke-tpu-accelerator
    topology: str  # cloud.google.com/gke-tpu-topology
    chips: int
    chips_per_host: int

    @property
    def hosts(self) -> int:
        return self.chips // self.chips_per_host


def _slices() -> dict[str, TpuSlice]:
    v5p = {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8", 512: "4x8x8"}
    v5e = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
    table = [TpuSlice(f"v5p-{cores}", "tpu-v5p-slice", top, cores // 2, min(4, cores // 2))
             for cores, top in v5p.items()]
    for family, accelerator in (("v5litepod", "tpu-v5-lite-podslice"), ("v6e", "tpu-v6e-slice")):
        table += [TpuSlice(f"{family}-{chips}", accelerator, top, chips, chips if chips <= 8 else 4)
                  for chips, top in v5e.items()]
    return {s.name: s for s in table}


TPU_SLICES = _slices()


def tpu_slice(name: str, flag: str) -> TpuSlice:
    if name not in TPU_SLICES:
        raise ConfigError(flag, f"unknown TPU slice {name!r}; one of {', '.join(TPU_SLICES)}")
    return TPU_SLICES[name]


@dataclasses.dataclass(frozen=True)
class Shape:
    """The run's processes (one per host unless several share a host) and the devices each one drives."""

    processes: int
    devices_per_process: int

    @property
    def devices(self) -> int:
        return self.processes * self.devices_per_process


def run_shape(config: Config) -> Shape:
    """mesh.data x fsdp x tensor x context devices over mesh.num_processes processes; a ConfigError when they do not
    split."""
    m = config.mesh
    devices = m.devices
    if devices % m.num_processes:
        raise ConfigError("mesh", f"data x fsdp x tensor x context = {devices} devices do not split over "
                                  f"mesh.num_processes = {m.num_processes} processes")
    return Shape(m.num_processes, devices // m.num_processes)


def check_slice(config: Config, chosen: TpuSlice, flag: str) -> None:
    """The slice has the mesh's chips and one host per process."""
    shape = run_shape(config)
    if (chosen.chips, chosen.hosts) != (shape.devices, shape.processes):
        raise ConfigError(flag, f"{chosen.name} has {chosen.chips} chips on {chosen.hosts} hosts, but the mesh asks "
                                f"for {shape.devices} devices over mesh.num_processes = {shape.processes} processes")


def service_devices(config: Config) -> int:
    """Devices of one generation service (rollout.service_mesh)."""
    mesh = parse_service_mesh(config.rollout.service_mesh, "rollout.service_mesh")
    return mesh.data * mesh.tensor


def resolved_config(config: Config) -> str:
    """The YAML every host reads: the config with its overrides applied. The processes are detected at launch
    (`mesh.coordinator_address=auto` on the command line) and the services' URLs are the launch's."""
    mesh = dataclasses.replace(config.mesh, coordinator_address=None, num_processes=1, process_id=0)
    return dump_config(dataclasses.replace(config, mesh=mesh, rollout=dataclasses.replace(config.rollout, urls=())))


def launch_config(config: Config) -> str:
    """run.yaml: the resolved config, headed by the processes the launch starts (the file says one: each host
    detects the count at launch, and `mesh.coordinator_address=auto` refuses any other)."""
    shape = run_shape(config)
    return (f"# {shape.processes} trainer processes of {shape.devices_per_process} devices each, detected at launch "
            "(mesh.coordinator_address=auto on the command line); mesh.num_processes stays 1 here\n"
            f"{resolved_config(config)}")


def new_key_file() -> str:
    """A fresh KEY_FILE's text: URL-safe characters only, so it reads back whole in any shell or env file."""
    return f"{KEY_ENV}={secrets.token_urlsafe(32)}\n"


def weights_root(config: Config) -> str:
    return not_an_option(config.run.weights_dir or f"{config.run.output_dir.rstrip('/')}/weights")


def not_an_option(path: str) -> str:
    """`path`, the same file, as no command reads it: a relative path that starts with '-' gets './' (else argparse,
    mkdir, cat, `.` take it for options)."""
    return f"./{path}" if path.startswith("-") else path


def _program(python: str) -> str:
    """The interpreter as a command's first word: a path as `not_an_option` gives it (the kernel hands a script's
    own path to its #! interpreter, which would read '-...' as options); a bare name is looked up on PATH as is."""
    return shlex.quote(not_an_option(python) if "/" in python else python)


def check_text(flag: str, value: str) -> str:
    """`value` on one line: a newline or control character would end a directive (#SBATCH) or a YAML scalar's
    line, and no path or name of ours needs one."""
    if _CONTROL.search(value):
        raise ConfigError(flag, f"{value!r} has a newline or control character")
    return value


def check_pattern(flag: str, value: str, pattern: str, what: str) -> str:
    """`value` whole matches `pattern` (what the engine allows for that field, said as `what`)."""
    if not re.fullmatch(pattern, value):
        raise ConfigError(flag, f"{value!r} is not {what}")
    return value


def assign(key: str, value: object) -> str:
    """`key=value` as one shell word: the trainer's dotted override, whatever `value` holds."""
    return shlex.quote(f"{key}={value}")


def train_command(python: str, config_path: str, *words: str, detect: bool = True, config_word: str = "") -> str:
    """The command every host runs unchanged (with `detect`, JAX finds the processes); `words` (and `config_word`,
    in place of `config_path`) are already shell words (quoted overrides, or a variable the shell expands at
    launch)."""
    start = ["mesh.coordinator_address=auto"] if detect else []
    return " ".join([_program(python), "-m", "drgrpo_jax.train", "--config", config_word or shlex.quote(config_path),
                     *start, *words])


def activate(venv: str, base: str = "") -> list[str]:
    """The line of a rendered script that activates the virtual environment `venv` (none without one); a relative
    `venv` is under `base`, a shell word (e.g. "$HOME"), when given."""
    if not venv:
        return []
    path = f"{venv.rstrip('/') or '/'}/bin/activate"
    if base and not venv.startswith("/"):
        return [f". {base}/{shlex.quote(path)}"]
    return [f". {shlex.quote(not_an_option(path))}"]


def refuse_loopback(config: Config, hint: str) -> None:
    """rollout.urls on loopback reach the trainer's own host, where nothing the render starts serves them."""
    for url in config.rollout.urls:
        if urllib.parse.urlsplit(url).hostname in LOOPBACK:
            raise ConfigError("rollout.urls", f"{url} is on the trainer's own node, where nothing starts a "
                                              f"service: {hint}")


def launch_path(launch_dir: str, workdir: str, *parts: str) -> str:
    """A path in the launch folder as scripts that `cd` into `workdir` see it: relative when it lies inside."""
    relative = os.path.relpath(launch_dir, workdir)
    folder = launch_dir if relative == ".." or relative.startswith("../") else relative
    return not_an_option(os.path.normpath(os.path.join(folder, *parts)))


def check_count(flag: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(flag, f"must be at least {low}, got {value}")


def serve_command(python: str, config: Config, config_path: str, port: str, key_env: str, *,
                  host: str = "0.0.0.0", config_word: str = "") -> str:
    """One generation service on `host` (default: all interfaces); with the key in `key_env` or, with none, refusing
    to start open. `port` (and `config_word`, in place of `config_path`) are shell words (a variable set at launch)."""
    words = [_program(python), "-m", "drgrpo_jax.serve", "--config", config_word or shlex.quote(config_path),
             "--host", host, "--port", port]
    words += ["--mesh", shlex.quote(config.rollout.service_mesh)] if config.rollout.service_mesh else []
    batch = config.rollout.service_batch_size
    words += ["--max-batch-size", str(int(batch))] if batch else []
    words += ["--weights-root", shlex.quote(weights_root(config))]
    words += ["--api-key-env", shlex.quote(key_env)] if key_env else ["--allow-unauthenticated"]
    return " ".join(words)
