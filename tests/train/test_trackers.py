"""Experiment trackers (TensorBoard, W&B offline, MLflow file store) and the Hub push, all without a network."""

import json
import os

import pytest

from drgrpo_jax.config.load import load_config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.train.hub import check_hub, push_folder
from drgrpo_jax.train.run_log import RunLog
from drgrpo_jax.train.trackers import MlflowTracker, check_trackers, mlflow_key, open_trackers, scalars

from support.hub_stand_in import StandInHub
from support.wandb_offline import wandb_offline_run

ROWS = [{"step": 1, "loss": 0.5, "reward_mean": 0.25, "pass@4": 0.75, "response_length_correct": None,
         "truncated": True, "nan": float("nan")},
        {"step": 2, "loss": 0.25, "reward_mean": 0.5, "pass@4": 1.0, "response_length_correct": 12.0}]
SAMPLES = [{"step": 2, "prompt_id": "p/0", "question": "1+1", "answer": "2", "completion": "2 | two\nok",
            "reward": 1.0, "length": 3, "truncated": False}]


def _config(tmp_path, *trackers):
    return load_config(None, ["model.path=x", f"run.output_dir={tmp_path}", f"run.report_to=[{','.join(trackers)}]",
                              f"run.mlflow_tracking_uri=file:{tmp_path / 'mlruns'}", "run.project=tests",
                              "run.name=tracked"])


def test_report_to_and_push_to_hub_are_checked_naming_the_key(monkeypatch):
    for override, key, words in [("run.report_to=[tensorbord]", "run.report_to[0]", "did you mean tensorboard"),
                                 ("run.report_to=[wandb,wandb]", "run.report_to", "twice"),
                                 ("run.push_to_hub=no_slash", "run.push_to_hub", "user/name"),
                                 ("train.eval_temperature=0", "train.eval_temperature", "> 0"),
                                 ("train.eval_samples=-1", "train.eval_samples", ">= 0")]:
        with pytest.raises(ConfigError, match=words) as error:
            load_config(None, ["model.path=x", override])
        assert error.value.key == key
    greedy_only = load_config(None, ["model.path=x", "train.eval_samples=0", "train.eval_temperature=0"])
    assert greedy_only.train.eval_samples == 0
    config = load_config(None, ["model.path=x", "run.report_to=[tensorboard,mlflow]"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[mlflow\]'") as error:
        check_trackers(config)
    assert error.value.key == "run.report_to[1]"


def test_scalars_keep_finite_numbers_only_and_mlflow_keys_are_legal():
    assert scalars(ROWS[0]) == {"loss": 0.5, "reward_mean": 0.25, "pass@4": 0.75}
    assert mlflow_key("eval/pass@4") == "eval/pass_at_4" and mlflow_key("reward/a+b") == "reward/a_b"


@pytest.mark.subprocess  # MLflow runs helper processes (git, its artifact repository)
def test_mlflow_file_store_gets_params_config_metrics_and_samples_and_a_resume_continues_the_run(tmp_path):
    from mlflow.tracking import MlflowClient

    config = _config(tmp_path, "mlflow")
    log = RunLog(str(tmp_path), 0, True, open_trackers(config, str(tmp_path), 0))
    assert isinstance(log.trackers[0], MlflowTracker)
    for row in ROWS:
        log.metrics(row)
    log.samples(SAMPLES)
    log.close()
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    experiment = client.get_experiment_by_name("tests")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["rollout.group_size"] == "8" and run.data.params["run.report_to"] == "['mlflow']"
    history = client.get_metric_history(run.info.run_id, "pass_at_4")  # pass@4 under MLflow's legal name
    assert [(m.step, m.value) for m in history] == [(1, 0.75), (2, 1.0)]
    assert "nan" not in run.data.metrics and "truncated" not in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "samples"} <= artifacts
    (table,) = client.list_artifacts(run.info.run_id, "samples")
    with open(client.download_artifacts(run.info.run_id, table.path, str(tmp_path / "dl"))) as f:
        stored = json.load(f)
    assert stored["columns"][:3] == ["step", "prompt_id", "question"] and stored["data"][0][4] == "2 | two\nok"
    # A resumed run (same run directory) logs into the same MLflow run.
    resumed = RunLog(str(tmp_path), 2, True, open_trackers(config, str(tmp_path), 2))
    resumed.metrics({"step": 3, "loss": 0.125})
    resumed.close()
    assert len(client.search_runs([experiment.experiment_id])) == 1
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3]


@pytest.mark.subprocess  # wandb.init starts its wandb-core service process
def test_wandb_offline_run_holds_the_config_scalars_and_sample_table(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = _config(tmp_path, "tensorboard", "wandb")
    log = RunLog(str(tmp_path), 0, True, open_trackers(config, str(tmp_path), 0))
    for row in ROWS:
        log.metrics(row)
    log.samples(SAMPLES)
    log.close()
    wandb_config, history = wandb_offline_run(str(tmp_path / "wandb"))
    assert [(row["_step"], row["loss"], row["pass@4"]) for row in history] == [(1, 0.5, 0.75), (2, 0.25, 1.0)]
    assert "nan" not in history[0] and "truncated" not in history[0]  # only finite numbers
    assert history[1]["samples/_type"] == "table-file" and history[1]["samples/nrows"] == 1
    assert wandb_config["rollout"]["group_size"] == 8 and wandb_config["run"]["name"] == "tracked"
    with open(tmp_path / ".wandb_run_id") as f:
        assert any(name.endswith(f.read().strip()) for name in os.listdir(tmp_path / "wandb"))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tensorboard"))


def test_push_to_hub_uploads_the_final_folder_and_refuses_offline_or_non_model_folders(tmp_path, monkeypatch):
    final = tmp_path / "final"
    final.mkdir()
    (final / "config.json").write_text("{}")
    (final / "model.safetensors").write_bytes(b"weights")
    hub = StandInHub(str(tmp_path / "hub"))
    url = push_folder(str(final), "me/policy", private=True, api=hub)
    assert url == "local://me/policy/commit/1 drgrpo_jax: final"
    assert hub.created == [("me/policy", "model", True, True)]
    assert sorted(os.listdir(tmp_path / "hub" / "me" / "policy")) == ["config.json", "model.safetensors"]
    with pytest.raises(ValueError, match="config.json"):
        push_folder(str(tmp_path / "hub"), "me/policy", api=hub)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE") as error:
        check_hub("me/policy")
    assert error.value.key == "run.push_to_hub"
    check_hub(None)  # off: nothing to check
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    check_hub("me/policy")
