"""GKE: the trainer as a JobSet over a TPU slice, the generation services as a StatefulSet behind a headless
Service (stable URLs: NAME-gen-I.NAME-gen:30000), the run config as a ConfigMap, the API key as a Secret
made from the launch folder's api_key.env; and the
matching `xpk workload create` command.

Exit code 42 (a preempted trainer that saved) fails the pod by the Job's backoff limit, which the JobSet answers by
restarting every Job (up to maxRestarts); any other failure matches the pod failure policy and fails the JobSet."""

from __future__ import annotations

import base64
import dataclasses
import shlex

import yaml

from drgrpo_jax.checkpoint import RESTART_EXIT_CODE
from drgrpo_jax.config.schema import Config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.launch.cluster import (
    CONFIG_NAME,
    KEY_ENV,
    KEY_FILE,
    assign,
    check_pattern,
    check_slice,
    resolved_config,
    serve_command,
    service_devices,
    tpu_slice,
    train_command,
)

PORT = 30000  # every service's port
COORDINATOR_PORT = 8482  # JAX's coordinator port on TPUs, which `mesh.coordinator_address=auto` uses
# What each field may hold: --name prefixes the objects' DNS-1035 labels (and xpk's workload name, 40 at most)
NAME = (r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", "a Kubernetes name (lowercase letters, digits and '-', a letter first, "
                                           "40 at most)")
IMAGE = (r"[A-Za-z0-9][A-Za-z0-9._/:@-]*", "a container image reference (registry/path:tag or @sha256:...)")
CLUSTER = (r"[A-Za-z]([-A-Za-z0-9]{0,38}[A-Za-z0-9])?", "a GKE cluster name (letters, digits and '-', 40 at most)")


@dataclasses.dataclass(frozen=True)
class GkeOptions:
    tpu: str
    serve_tpu: str
    services: int
    image: str
    name: str = "drgrpo"
    max_restarts: int = 10
    cluster: str = "CLUSTER"


def _check(o: GkeOptions) -> None:
    """The names the objects and the xpk command carry, as Kubernetes, registries and GKE allow them."""
    for flag, value, (pattern, what) in [("--name", o.name, NAME), ("--image", o.image, IMAGE),
                                         ("--cluster", o.cluster, CLUSTER)]:
        check_pattern(flag, value, pattern, what)


def _tpu_pod(o: GkeOptions, slice_name: str, flag: str, container: dict) -> dict:
    chosen = tpu_slice(slice_name, flag)
    container = {**container, "image": o.image,
                 "resources": {"limits": {"google.com/tpu": str(chosen.chips_per_host)}},  # a quantity
                 "volumeMounts": [{"name": "config", "mountPath": "/config"}]}
    return {"nodeSelector": {"cloud.google.com/gke-tpu-accelerator": chosen.gke_accelerator,
                             "cloud.google.com/gke-tpu-topology": chosen.topology},
            "containers": [container],
            "volumes": [{"name": "config", "configMap": {"name": f"{o.name}-config"}}]}


def _key_env(o: GkeOptions) -> list[dict]:
    return [{"name": KEY_ENV, "valueFrom": {"secretKeyRef": {"name": f"{o.name}-api-key", "key": KEY_ENV}}}]


def urls(o: GkeOptions) -> list[str]:
    return [f"http://{o.name}-gen-{i}.{o.name}-gen:{PORT}" for i in range(o.services)]


def trainer_command(config: Config, o: GkeOptions) -> str:
    """The services' URLs: the StatefulSet's, or with none started the config's rollout.urls."""
    services = urls(o) if o.services else config.rollout.urls
    return train_command("python3", f"/config/{CONFIG_NAME}", assign("rollout.urls", f"[{','.join(services)}]"),
                         assign("rollout.api_key_env", KEY_ENV))


def _check_output_dir(config: Config) -> None:
    """The trainer's pods and the services share no volume and a restarted pod starts empty: the run's folder
    must outlive them (a bucket, or an absolute path you mount into the image)."""
    output_dir = config.run.output_dir
    if not (output_dir.startswith("gs://") or output_dir.startswith("/")):
        raise ConfigError("run.output_dir", f"{output_dir!r} is relative: a pod's own disk, lost on a restart and "
                                            "unseen by the services; give gs://BUCKET/PATH")


def jobset(config: Config, o: GkeOptions) -> dict:
    chosen = tpu_slice(o.tpu, "--tpu")
    check_slice(config, chosen, "--tpu")
    container = {"name": "trainer", "command": ["bash", "-c", trainer_command(config, o)],
                 "env": _key_env(o), "ports": [{"containerPort": COORDINATOR_PORT}]}
    pod = {**_tpu_pod(o, o.tpu, "--tpu", container), "restartPolicy": "Never", "hostNetwork": True,
           "dnsPolicy": "ClusterFirstWithHostNet"}
    job = {"parallelism": chosen.hosts, "completions": chosen.hosts, "backoffLimit": 0,
           "completionMode": "Indexed",
           "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
               "containerName": "trainer", "operator": "NotIn", "values": [RESTART_EXIT_CODE]}}]},
           "template": {"spec": pod}}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": o.name, "annotations": {
                "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}},
            "spec": {"failurePolicy": {"maxRestarts": o.max_restarts, "rules": [
                {"name": "failOnOtherExitCodes", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]},
                     "replicatedJobs": [{"name": "slice", "replicas": 1, "template": {"spec": job}}]}}


def services(config: Config, o: GkeOptions) -> list[dict]:
    """The headless Service and the StatefulSet of `o.services` generation services."""
    chosen = tpu_slice(o.serve_tpu, "--serve-tpu")
    if chosen.hosts != 1 or chosen.chips != service_devices(config):
        raise ConfigError("--serve-tpu", f"{chosen.name} has {chosen.chips} chips on {chosen.hosts} hosts; a service "
                                         f"takes one host of rollout.service_mesh's {service_devices(config)} devices")
    labels = {"app": f"{o.name}-gen"}
    serve = serve_command("python3", config, f"/config/{CONFIG_NAME}", str(PORT), KEY_ENV)
    container = {"name": "serve", "command": ["bash", "-c", serve], "env": _key_env(o),
                 "ports": [{"containerPort": PORT}],
                 "readinessProbe": {"httpGet": {"path": "/health", "port": PORT}, "periodSeconds": 10}}
    return [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{o.name}-gen"},
             "spec": {"clusterIP": "None", "selector": labels, "ports": [{"port": PORT, "name": "http"}]}},
            {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": f"{o.name}-gen"},
             "spec": {"serviceName": f"{o.name}-gen", "replicas": o.services, "podManagementPolicy": "Parallel",
                      "selector": {"matchLabels": labels},
                      "template": {"metadata": {"labels": labels},
                                   "spec": _tpu_pod(o, o.serve_tpu, "--serve-tpu", container)}}}]


def config_objects(config: Config, o: GkeOptions) -> list[dict]:
    """The resolved config as a ConfigMap. The key's Secret is made from the launch folder's KEY_FILE
    (`kubectl create secret generic NAME-api-key --from-env-file=DIR/api_key.env`), never rendered."""
    return [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{o.name}-config"},
             "data": {CONFIG_NAME: resolved_config(config)}}]


def xpk_command(config: Config, o: GkeOptions) -> str:
    """xpk's JobSet for the trainer (it restarts on exit code 42 up to --max-restarts). Its pods mount no ConfigMap,
    so the command carries the resolved config; the key comes from KEY_FILE beside xpk.sh (`$here`)."""
    unpack = f"echo {base64.b64encode(resolved_config(config).encode()).decode()} | base64 -d > /config/{CONFIG_NAME}"
    words = shlex.join(["xpk", "workload", "create", f"--cluster={o.cluster}", f"--workload={o.name}",
                        f"--tpu-type={o.tpu}", "--num-slices=1", f"--docker-image={o.image}",
                        f"--max-restarts={o.max_restarts}", "--command",
                        f"mkdir -p /config && {unpack} && {trainer_command(config, o)}"])
    return f'{words} --env-file="$here/{KEY_FILE}"'


def _yaml(objects: list[dict]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False, width=120)


def render(config: Config, o: GkeOptions) -> dict[str, str]:
    _check(o)
    _check_output_dir(config)
    trainer = _yaml([jobset(config, o)])  # the trainer's slice first: its refusal names the run's mesh
    files = {"config.yaml": _yaml(config_objects(config, o))}
    files |= {"services.yaml": _yaml(services(config, o))} if o.services else {}  # none: rollout.urls's own
    return {**files, "jobset.yaml": trainer,
            "xpk.sh": "#!/bin/bash\n# The trainer through xpk instead of jobset.yaml (apply services.yaml first: "
                      "the trainer reads their URLs).\nset -euo pipefail\nhere=$(cd \"$(dirname \"$0\")\" && pwd)\n"
                      f"{xpk_command(config, o)}\n"}
