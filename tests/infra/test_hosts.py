"""Failing together: what every process raises when one of them failed (decided by type, one process here);
start-up under each cluster's variables (JAX's own detection, nothing connects)."""

import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from jax._src import clusters, xla_bridge  # JAX's detection: what `jax.distributed.initialize()` runs
from jax._src.clusters import cloud_tpu_cluster, cluster

from drgrpo_jax.errors import ConfigError, HostFailure, RewardError, RolloutError, StaleWeightsError
from drgrpo_jax.hosts import fail_together, failure_code, remote_failure, start_distributed


def test_the_failing_process_raises_its_own_error():
    with pytest.raises(StaleWeightsError, match="weight_version"), fail_together("sampling step 1"):
        raise StaleWeightsError("weight_version: got '1', expected '2'")
    with fail_together("nothing"):
        pass


@pytest.mark.parametrize("error, raised", [
    (RewardError("nan"), RewardError),
    (RolloutError("down", status=503), RolloutError),
    (StaleWeightsError("old"), RolloutError),
])
def test_the_other_processes_raise_reward_and_rollout_errors_as_themselves(error, raised):
    codes = np.asarray([0, failure_code(error), 0])
    failure = remote_failure(codes, "sampling step 3")
    assert type(failure) is raised and str(failure) == "sampling step 3 failed on process 1 (see its log)"


@pytest.mark.parametrize("error, kind", [(ConfigError("data.path", "no such file"), "ConfigError"),
                                         (KeyError("x"), "Exception")])
def test_anything_else_is_a_host_failure_not_a_config_error(error, kind):
    failure = remote_failure(np.asarray([failure_code(error), failure_code(RewardError("later"))]), "loading data")
    assert isinstance(failure, HostFailure) and not isinstance(failure, ConfigError)
    assert (failure.what, failure.process, failure.kind) == ("loading data", 0, kind)
    assert remote_failure(np.asarray([0, 0]), "loading data") is None


# ---------------------------------------------------------------------------------------------
# Start-up: mesh.coordinator_address=auto over JAX's own cluster detection (nothing connects here)
# ---------------------------------------------------------------------------------------------

_CLUSTER_VARIABLES = ("SLURM_", "OMPI_", "TPU_", "MEGASCALE_", "KUBERNETES_", "JOB_COMPLETION_INDEX", "JAX_COORDINATOR",
                      "JAX_LOCAL_DEVICE_IDS")


@pytest.fixture
def bare_env(monkeypatch):
    """No cluster's variables; set `running_in_cloud_tpu_vm` with `tpu_vm(monkeypatch)`."""
    for name in list(os.environ):
        if name.startswith(_CLUSTER_VARIABLES):
            monkeypatch.delenv(name)
    return monkeypatch


def tpu_vm(monkeypatch):
    """What JAX's TPU start-up records on a Cloud TPU VM (libtpu and chips found)."""
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)
    monkeypatch.setattr(cluster, "running_in_cloud_tpu_vm", True)


def detected(local_device_ids=(), timeout=1):
    """(the cluster JAX picks, the (address, processes, id, local device ids) it fills in) for what
    start_distributed("auto") passes: every argument unset but local_device_ids=[]."""
    env = next((e for e in clusters.ClusterEnv._cluster_types if not e.opt_in_only_method and e.is_env_present()),
               None)
    ids = None if local_device_ids is None else list(local_device_ids)
    return env, clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, ids, None, timeout)


def _slurm(env, procid=1, localid=1):
    for name, value in {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "2",
                        "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid)}.items():
        env.setenv(name, value)


def test_slurm_is_detected_and_every_gpu_of_the_node_stays_visible(bare_env):
    _slurm(bare_env)
    cluster_env, args = detected()
    port = 4242 % 2**12 + 65535 - 2**12 + 1  # JAX's port for the job id
    assert cluster_env is clusters.SlurmCluster and args == (f"gpu07:{port}", 2, 1, [])
    _, without = detected(local_device_ids=None)  # what JAX does when not told: one GPU, the task's local id
    assert without[3] == [1]
    bare_env.setenv("JAX_COORDINATOR_PORT", "7001")  # mesh.coordinator_port
    assert detected()[1][0] == "gpu07:7001"


def test_open_mpi_is_detected(bare_env):
    for name, value in {"OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
                        "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2",
                        "OMPI_COMM_WORLD_LOCAL_RANK": "0"}.items():
        bare_env.setenv(name, value)
    cluster_env, (address, count, process, ids) = detected()
    assert cluster_env is clusters.OmpiCluster and address.startswith("10.96.0.1:") and (count, process, ids) == \
        (4, 2, [])


def test_a_tpu_vm_pod_slice_is_detected_from_its_metadata(bare_env):
    tpu_vm(bare_env)
    metadata = {"agent-worker-number": "3", "worker-network-endpoints": "127.0.0.1,127.0.0.2,127.0.0.3,127.0.0.4",
                "tpu-env": ""}
    bare_env.setattr(cloud_tpu_cluster, "get_metadata", lambda key: (metadata[key], 200))
    cluster_env, args = detected()
    assert cluster_env is clusters.GceTpuCluster and args == ("127.0.0.1:8482", 4, 3, [])


def test_multi_slice_counts_every_slice_and_uses_the_megascale_coordinator(bare_env):
    tpu_vm(bare_env)  # GKE (xpk, JobSet) TPU pods: the worker list and id come as variables
    bare_env.setattr(cloud_tpu_cluster, "get_metadata", lambda key: ("", 404))  # a GKE node: no TPU VM attributes
    for name, value in {"TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.2,127.0.0.3,127.0.0.4", "TPU_WORKER_ID": "3",
                        "MEGASCALE_COORDINATOR_ADDRESS": "127.0.0.9:8080", "MEGASCALE_NUM_SLICES": "2",
                        "MEGASCALE_SLICE_ID": "1"}.items():
        bare_env.setenv(name, value)
    cluster_env, args = detected()
    assert cluster_env is clusters.GkeTpuCluster and args == ("127.0.0.9:8482", 8, 7, [])


@pytest.mark.parametrize("jobset", [True, False])
def test_a_jobset_or_indexed_job_is_detected_through_the_kubernetes_api(bare_env, jobset):
    """K8sCluster asks the API server for its pod and job (stood in here; the `kubernetes` client is faked)."""
    api = SimpleNamespace(config=SimpleNamespace(load_incluster_config=lambda: None),
                          client=SimpleNamespace(CoreV1Api=lambda: None, BatchV1Api=lambda: None,
                                                 exceptions=SimpleNamespace(ApiException=RuntimeError)))
    bare_env.setitem(sys.modules, "kubernetes", api)
    bare_env.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    bare_env.setenv("JOB_COMPLETION_INDEX", "1")
    labels = {"jobset.sigs.k8s.io/jobset-name": "drgrpo"} if jobset else {}
    job = SimpleNamespace(metadata=SimpleNamespace(name="drgrpo-slice-0", labels=labels),
                          spec=SimpleNamespace(parallelism=4))
    pod = SimpleNamespace(spec=SimpleNamespace(subdomain="trainers"))
    k8s = clusters.K8sCluster
    bare_env.setattr(k8s, "_controller", classmethod(lambda cls: SimpleNamespace(kind="Job")))
    bare_env.setattr(k8s, "_job", classmethod(lambda cls: job))
    bare_env.setattr(k8s, "_pod", classmethod(lambda cls: pod))
    cluster_env, args = detected(timeout=None)
    host = "drgrpo-slice-0-0." + ("drgrpo" if jobset else "trainers")
    assert cluster_env is k8s and args == (f"{host}:55527", 4, 1, [])


def test_start_distributed_passes_nothing_but_all_local_devices_on_auto(bare_env):
    calls = []
    bare_env.setenv("JAX_COORDINATOR_PORT", "0")  # recorded, so the value start_distributed sets goes after the test
    bare_env.setattr("jax.distributed.initialize", lambda *args, **kwargs: calls.append((args, kwargs)))
    start_distributed(None)
    assert calls == []
    start_distributed("auto", port=7001)
    assert calls.pop() == ((), {"local_device_ids": []})
    assert os.environ["JAX_COORDINATOR_PORT"] == "7001"
    start_distributed("10.0.0.2:8476", 4, 2)  # explicit: detection is off, so SLURM cannot narrow the devices
    assert calls.pop() == (("10.0.0.2:8476",), {"num_processes": 4, "process_id": 2, "local_device_ids": [],
                                                "cluster_detection_method": "deactivate"})


def test_auto_with_no_cluster_is_one_line_naming_the_key(bare_env):
    bare_env.setattr(xla_bridge, "backends_are_initialized", lambda: False)  # as in a fresh trainer process
    with pytest.raises(ConfigError, match=r"^mesh.coordinator_address: auto, but no cluster was detected "
                                          r"\(coordinator_address should be defined.\): run under") as error:
        start_distributed("auto")
    assert "\n" not in str(error.value)
