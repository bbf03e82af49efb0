"""SkyPilot: one task YAML for a TPU pod (every host runs `run`; JAX detects the pod) or a GPU cluster (one process per
node; SkyPilot's node variables name the coordinator and the process id). Spot through managed jobs
(`sky jobs launch`): a preemption relaunches the task, and `max_restarts_on_errors` restarts it after exit code 42.
The generation services are the config's rollout.urls (a SkyServe service or hosts of your own)."""

from __future__ import annotations

import dataclasses
import os
import re

import yaml

from drgrpo_jax.config.schema import Config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.launch.cluster import CONFIG_NAME, assign, check_slice, run_shape, tpu_slice, train_command

COORDINATOR_PORT = 8476


@dataclasses.dataclass(frozen=True)
class SkyOptions:
    launch_dir: str  # absolute: run.yaml's folder, mounted on every node
    workdir: str  # absolute: the checkout SkyPilot copies to every node (~/sky_workdir) and installs
    tpu: str = ""  # a TPU slice type (v5p-64) or
    gpus: str = ""  # GPUs per node, NAME:COUNT (H100:8)
    max_restarts: int = 10


def _gpus(spec: str) -> int:
    name, _, count = spec.partition(":")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not re.fullmatch(r"[0-9]+", count) or int(count) < 1:
        raise ConfigError("--gpus", f"must be NAME:COUNT (e.g. H100:8), got {spec!r}")
    return int(count)


def task(config: Config, o: SkyOptions) -> dict:
    if bool(o.tpu) == bool(o.gpus):
        raise ConfigError("--tpu", "give one of --tpu (a TPU pod) or --gpus (a GPU cluster)")
    if run_shape(config).processes > 1 and not config.rollout.urls:
        raise ConfigError("rollout.urls", "must list the generation services for a multi-host task")
    words = [assign("rollout.urls", f"[{','.join(config.rollout.urls)}]")]
    words += [assign("rollout.api_key_env", config.rollout.api_key_env)] if config.rollout.api_key_env else []
    resources: dict = {"use_spot": True, "job_recovery": {"max_restarts_on_errors": o.max_restarts}}
    if o.tpu:
        check_slice(config, tpu_slice(o.tpu, "--tpu"), "--tpu")
        resources |= {"accelerators": f"tpu-{o.tpu}", "accelerator_args": {"runtime_version": "tpu-ubuntu2204-base"}}
        nodes, extra = 1, "'.[train,tpu]'"  # a pod is one SkyPilot node; run goes to every host
    else:
        shape = run_shape(config)
        if _gpus(o.gpus) != shape.devices_per_process:
            raise ConfigError("--gpus", f"{o.gpus} per node, but the mesh puts {shape.devices_per_process} devices "
                                        f"on each of mesh.num_processes = {shape.processes} processes")
        resources["accelerators"] = o.gpus
        nodes, extra = shape.processes, "'.[train,cuda]'"
        # JAX has no SkyPilot detection: the node variables, expanded by the node's shell, say who is who
        words += [f'mesh.coordinator_address="$(echo "$SKYPILOT_NODE_IPS" | head -n1):{COORDINATOR_PORT}"',
                  'mesh.num_processes="$SKYPILOT_NUM_NODES"', 'mesh.process_id="$SKYPILOT_NODE_RANK"']
    run = train_command("python3", CONFIG_NAME, *words, detect=bool(o.tpu))
    # Absolute sources: `sky` resolves relative ones against where it runs, not against task.yaml
    task = {"name": "drgrpo-train", "resources": resources, "num_nodes": nodes, "workdir": o.workdir,
            "file_mounts": {f"~/sky_workdir/{CONFIG_NAME}": os.path.join(o.launch_dir, CONFIG_NAME)},
            "setup": f"pip install -e {extra}", "run": run}
    # The services' key: a secret with no value, which `sky jobs launch --secret NAME` fills from your environment
    return task | ({"secrets": {config.rollout.api_key_env: None}} if config.rollout.api_key_env else {})


def render(config: Config, o: SkyOptions) -> dict[str, str]:
    return {"task.yaml": yaml.safe_dump(task(config, o), sort_keys=False, width=120)}
