"""python -m drgrpo_jax.launch: each engine's files rendered from a recipe, byte for byte (tests/launch/golden/),
the Kubernetes objects through the `kubernetes` client's models, the JobSet against its CRD's schema
(golden/jobset_v1alpha2_schema.json, source in its `$comment`), the SkyPilot task against SkyPilot's schema
(golden/skypilot_task_schema.json: SkyPilot 0.14.1's `sky.utils.schemas.get_task_schema()` with its
`get_resources_schema()` as `resources`), and the one-line refusals when the config and the cluster disagree."""

from __future__ import annotations

import json
import os
import pathlib

import jsonschema
import pytest
import yaml
from kubernetes.client import ApiClient

from drgrpo_jax.config.load import load_config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.launch import gke, skypilot, slurm
from drgrpo_jax.launch.cli import main
from drgrpo_jax.launch.cluster import resolved_config

from support.paths import REPO

GOLDEN = pathlib.Path(__file__).parent / "golden"
RECIPE = os.path.join(REPO, "configs", "recipes", "qwen2.5_math_7b_dr_grpo_v5p64.yaml")
H100 = os.path.join(REPO, "configs", "recipes", "qwen2.5_math_7b_dr_grpo_8xh100.yaml")
PATHS = ["model.path=/shared/qwen2.5-math-7b", "data.path=/shared/math.jsonl", "run.output_dir=/shared/run"]
STAND_INS = ["mesh.coordinator_address=detected-at-launch:8476", "rollout.urls=[http://started-services:30000]"]


def _config(recipe: str, *overrides: str):
    return load_config(recipe, [*STAND_INS, *PATHS, *overrides])


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("DRGRPO_REGOLD"):  # DRGRPO_REGOLD=1 pytest tests/launch/test_render.py rewrites them
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} differs from its golden render"


def _strict(kind: str, obj: dict) -> None:
    """`obj` deserializes into the client's model of `kind` and serializes back unchanged: no unknown or mistyped
    field (the models drop the unknown ones silently, so the round trip is what catches them)."""
    client = ApiClient()
    model = client._ApiClient__deserialize(obj, kind)  # the client's own deserializer, used on API responses
    assert client.sanitize_for_serialization(model) == obj, kind


GKE = gke.GkeOptions(tpu="v5p-64", serve_tpu="v5p-8", services=2, image="us-docker.pkg.dev/p/r/drgrpo:1")


JOBSET_SCHEMA = json.loads((GOLDEN / "jobset_v1alpha2_schema.json").read_text())


def _closed(schema):
    """`schema` with every object that lists its properties closed to others (what kubectl's strict field validation
    and kubeconform -strict do; the CRD itself only prunes unknown fields, so a misspelling would pass silently)."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"):
        closed["additionalProperties"] = False
    return closed


JOBSET_VALIDATOR = jsonschema.Draft7Validator(_closed(JOBSET_SCHEMA))


def _gke_config():
    return _config(RECIPE, "mesh.num_processes=8", "rollout.service_mesh=tensor=4", "rollout.api_key_env=GEN_KEY")


def test_slurm_golden():
    config = _config(H100, "mesh.num_processes=2", "mesh.fsdp=16", "rollout.api_key_env=GEN_KEY")
    files = slurm.render(config, slurm.SlurmOptions("/shared/launch", "/shared/drgrpo_jax", services=4,
                                                    partition="h100", time="24:00:00"))
    for name, text in files.items():
        _check_golden(f"slurm/{name}", text)
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=20\n#SBATCH --gpus-per-node=8\n" \
           "#SBATCH --mem=0\n#SBATCH --exclusive\n" in files["train.sbatch"]  # 16 reward workers + 4
    assert "#SBATCH --ntasks=4\n#SBATCH --cpus-per-task=4\n#SBATCH --gpus-per-task=1\n" in files["serve.sbatch"]


RUN_YAML = "# the resolved config\n"  # the goldens' stand-in: they follow the launcher, not every config field


def test_gke_golden_and_valid_kubernetes_objects(monkeypatch):
    (configmap,) = yaml.safe_load_all(gke.render(_gke_config(), GKE)["config.yaml"])
    assert configmap["data"]["run.yaml"] == resolved_config(_gke_config())
    monkeypatch.setattr(gke, "resolved_config", lambda config: RUN_YAML)
    files = gke.render(_gke_config(), GKE)
    for name, text in files.items():
        _check_golden(f"gke/{name}", text)
    kinds = {"Service": "V1Service", "StatefulSet": "V1StatefulSet", "ConfigMap": "V1ConfigMap"}
    objects = [o for name in ("config.yaml", "services.yaml") for o in yaml.safe_load_all(files[name])]
    assert sorted(o["kind"] for o in objects) == sorted(kinds)
    for obj in objects:
        _strict(kinds[obj["kind"]], obj)
    (jobset,) = yaml.safe_load_all(files["jobset.yaml"])
    JOBSET_VALIDATOR.validate(jobset)  # the whole JobSet against its CRD's schema
    (replicated,) = jobset["spec"]["replicatedJobs"]
    _strict("V1JobSpec", replicated["template"]["spec"])  # the JobSet's Job, also through the client's models
    pod = replicated["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "2x4x4"}
    assert replicated["template"]["spec"]["parallelism"] == 8 and pod["containers"][0]["resources"]["limits"] == {
        "google.com/tpu": "4"}
    assert "mesh.coordinator_address=auto 'rollout.urls=[http://drgrpo-gen-0.drgrpo-gen:30000," \
           "http://drgrpo-gen-1.drgrpo-gen:30000]' rollout.api_key_env=DRGRPO_API_KEY" in pod["containers"][0][
               "command"][-1]


def _misspelled(jobset):
    jobset["spec"]["failurePolicy"]["maxRestart"] = jobset["spec"]["failurePolicy"].pop("maxRestarts")


def _mistyped(jobset):
    jobset["spec"]["replicatedJobs"][0]["replicas"] = "1"


def _unknown_in_pod(jobset):
    jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["nodeSelectors"] = {}


@pytest.mark.parametrize("mutate, message", [
    (_misspelled, "'maxRestart' was unexpected"),
    (_mistyped, "'1' is not of type 'integer'"),
    (_unknown_in_pod, "'nodeSelectors' was unexpected"),
])
def test_jobset_schema_refuses_a_broken_jobset(mutate, message):
    (jobset,) = yaml.safe_load_all(gke.render(_gke_config(), GKE)["jobset.yaml"])
    mutate(jobset)
    with pytest.raises(jsonschema.ValidationError, match=message):
        JOBSET_VALIDATOR.validate(jobset)


SKY_DIRS = ("/shared/launch", "/shared/drgrpo_jax")  # the launch folder and the checkout
SKY_SCHEMA = json.loads((GOLDEN / "skypilot_task_schema.json").read_text())


@pytest.mark.parametrize("recipe, overrides, options", [
    (RECIPE, ["mesh.num_processes=8"], skypilot.SkyOptions(*SKY_DIRS, tpu="v5p-64")),
    (H100, ["mesh.num_processes=2", "mesh.fsdp=16", "rollout.api_key_env=GEN_KEY"],
     skypilot.SkyOptions(*SKY_DIRS, gpus="H100:8")),
], ids=["tpu", "gpu"])
def test_skypilot_golden_and_valid_against_skypilots_schema(request, recipe, overrides, options):
    files = skypilot.render(_config(recipe, "rollout.urls=[http://gen:30000]", *overrides), options)
    _check_golden(f"skypilot/{request.node.callspec.id}.yaml", files["task.yaml"])
    jsonschema.validate(yaml.safe_load(files["task.yaml"]), SKY_SCHEMA)


@pytest.mark.parametrize("render, message", [
    (lambda: gke.render(_config(RECIPE, "mesh.num_processes=4"), GKE),
     "--tpu: v5p-64 has 32 chips on 8 hosts, but the mesh asks for 32 devices over mesh.num_processes = 4 "
     "processes"),
    (lambda: gke.render(_gke_config(), gke.GkeOptions("v5p-63", "v5p-8", 1, "i")),
     "--tpu: unknown TPU slice 'v5p-63'; one of v5p-8, v5p-16, v5p-32, v5p-64, v5p-128, v5p-256, v5p-512, "
     "v5litepod-1, v5litepod-4, v5litepod-8, v5litepod-16, v5litepod-32, v5litepod-64, v5litepod-128, "
     "v5litepod-256, v6e-1, v6e-4, v6e-8, v6e-16, v6e-32, v6e-64, v6e-128, v6e-256"),
    (lambda: gke.render(_config(RECIPE, "mesh.num_processes=8"), GKE),
     "--serve-tpu: v5p-8 has 4 chips on 1 hosts; a service takes one host of rollout.service_mesh's 1 devices"),
    (lambda: skypilot.render(_config(H100, "mesh.num_processes=2", "mesh.fsdp=16"),
                             skypilot.SkyOptions(*SKY_DIRS, gpus="H100:4")),
     "--gpus: H100:4 per node, but the mesh puts 8 devices on each of mesh.num_processes = 2 processes"),
    (lambda: slurm.render(_config(H100, "mesh.num_processes=4", "mesh.fsdp=2"), slurm.SlurmOptions("/l", "/w")),
     "mesh: data x fsdp x tensor x context = 2 devices do not split over mesh.num_processes = 4 processes"),
])
def test_disagreements_fail_in_one_line(render, message):
    with pytest.raises(ConfigError) as error:
        render()
    assert str(error.value) == message


def test_cli_writes_the_resolved_config_and_the_files(tmp_path, capsys):
    main(["slurm", "--config", H100, "--out", str(tmp_path), "--services", "1", *PATHS, "mesh.num_processes=2",
          "mesh.fsdp=16"])
    assert sorted(os.listdir(tmp_path)) == ["api_key.env", "run.yaml", "serve.sbatch", "submit.sh", "train.sbatch"]
    resolved = load_config(tmp_path / "run.yaml", ["mesh.coordinator_address=auto"])  # what every host loads
    assert (resolved.mesh.fsdp, resolved.mesh.num_processes, resolved.rollout.urls) == (16, 1, ())
    assert resolved.model.path == "/shared/qwen2.5-math-7b"
    assert f"start: bash {tmp_path}/submit.sh" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        main(["slurm", "--config", RECIPE, "--out", str(tmp_path / "x"), *PATHS, "mesh.num_processes=8"])
    assert str(refused.value).startswith("python -m drgrpo_jax.launch: config error: rollout.urls: must list the "
                                         "generation services when mesh.num_processes = 8")
