"""Experiment trackers behind one small interface: TensorBoard, Weights & Biases, MLflow (`run.report_to`).

Every tracker gets the same things: the resolved config once, each metrics.jsonl row's finite numbers
at its step, and the sample completions as a table. Only process 0 opens trackers. A resumed run logs
into the same W&B / MLflow run: its id is kept in the run directory (`.wandb_run_id`, `.mlflow_run_id`).
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import os
import re
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from omegaconf import OmegaConf
from tensorboardX import SummaryWriter

from drgrpo_jax.config.load import dump_config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.weight_folders import read_text, scratch_folder, write_text

if TYPE_CHECKING:
    from drgrpo_jax.config.schema import Config

__all__ = ["MlflowTracker", "TensorBoardTracker", "Tracker", "WandbTracker", "check_trackers", "open_trackers",
           "scalars"]

_PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}
_SAMPLE_COLUMNS = ("step", "prompt_id", "question", "answer", "completion", "reward", "length", "truncated")


class Tracker(Protocol):
    """What the run log calls on each backend."""

    def metrics(self, row: dict[str, float], step: int) -> None: ...

    def samples(self, rows: list[dict[str, Any]], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's finite numbers (booleans and `step` left out): what every tracker plots."""
    return {key: float(value) for key, value in row.items()
            if key != "step" and isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value)}


def _sample_table(rows: list[dict[str, Any]]) -> tuple[list[Any], list[list[Any]]]:
    """(columns, rows) of the samples: the standard columns present in them, in a fixed order."""
    columns = [c for c in _SAMPLE_COLUMNS if any(c in row for row in rows)]
    return columns, [[row.get(c) for c in columns] for row in rows]


def _stable_id(output_dir: str, file_name: str, make: Any) -> tuple[str, bool]:
    """(the id saved in output_dir/file_name, or a new one from make(), whether it is new)."""
    saved = (read_text(os.path.join(output_dir, file_name)) or "").strip()
    return (saved, False) if saved else (make(), True)


def _save_id(output_dir: str, file_name: str, run_id: str) -> None:
    write_text(os.path.join(output_dir, file_name), run_id)


class TensorBoardTracker:
    """tensorboardX event files in output_dir/tensorboard (it writes gs:// itself, through google-cloud-storage);
    config and samples as text."""

    def __init__(self, output_dir: str, start_step: int, config_yaml: str = ""):
        # purge_step hides events a killed run wrote past its last checkpoint.
        self._writer = SummaryWriter(os.path.join(output_dir, "tensorboard"),
                                     purge_step=start_step + 1 if start_step else None)
        if config_yaml:
            self._writer.add_text("config", "    " + config_yaml.replace("\n", "\n    "), start_step)

    def metrics(self, row: dict[str, float], step: int) -> None:
        for key, value in row.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def samples(self, rows: list[dict[str, Any]], step: int) -> None:
        columns, table = _sample_table(rows)
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in r) + " |" for r in table]
        self._writer.add_text("samples", "\n".join(lines), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A W&B run (WANDB_MODE=offline works without a network: `wandb sync` uploads it later)."""

    def __init__(self, output_dir: str, project: str, name: str, config: dict[str, Any]):
        import wandb  # optional extra: wandb

        run_id, new = _stable_id(output_dir, ".wandb_run_id", lambda: secrets.token_hex(6))
        self._run = wandb.init(project=project, name=name, id=run_id, resume="allow",
                               dir=scratch_folder(output_dir), config=config)  # W&B's files are local ones
        if new:
            _save_id(output_dir, ".wandb_run_id", run_id)
        self._wandb = wandb

    def metrics(self, row: dict[str, float], step: int) -> None:
        self._run.log(row, step=step)

    def samples(self, rows: list[dict[str, Any]], step: int) -> None:
        columns, table = _sample_table(rows)
        self._run.log({"samples": self._wandb.Table(columns=columns, data=table)}, step=step)

    def close(self) -> None:
        self._run.finish()


_MLFLOW_BAD_CHARS = re.compile(r"[^\w./\- :]")


def mlflow_key(key: str) -> str:
    """A metric name MLflow accepts: `@` becomes `_at_` (pass@8 -> pass_at_8), other odd characters `_`."""
    return _MLFLOW_BAD_CHARS.sub("_", key.replace("@", "_at_"))


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"section.key": value as text} of a nested config."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            shown = list(value) if isinstance(value, tuple) else value  # as the YAML config writes it
            out[f"{prefix}{key}"] = str(shown)[:500]  # MLflow's smallest parameter-value limit
    return out


class MlflowTracker:
    """An MLflow run through MlflowClient (no global active run): params, config.yaml, metrics, sample tables."""

    def __init__(self, output_dir: str, tracking_uri: str, experiment: str, name: str, config: dict[str, Any],
                 config_yaml: str):
        from mlflow.tracking import MlflowClient  # optional extra: mlflow

        if tracking_uri.startswith("file:"):  # chosen explicitly: MLflow 3 refuses file stores without this opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=tracking_uri or None)
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self._client.create_experiment(experiment)
        self._run_id, new = _stable_id(
            output_dir, ".mlflow_run_id", lambda: self._client.create_run(experiment_id, run_name=name).info.run_id)
        if new:  # parameters are immutable in MLflow: a resumed run keeps those it started with
            from mlflow.entities import Param  # optional extra: mlflow

            params = [Param(k, v) for k, v in _flatten(config).items()]
            for start in range(0, len(params), 100):  # log_batch takes at most 100 params per call
                self._client.log_batch(self._run_id, params=params[start:start + 100])
            self._client.log_text(self._run_id, config_yaml, "config.yaml")
            _save_id(output_dir, ".mlflow_run_id", self._run_id)

    def metrics(self, row: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric  # optional extra: mlflow

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, now, step) for k, v in row.items()]
        for start in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics per call
            self._client.log_batch(self._run_id, metrics=metrics[start:start + 1000])

    def samples(self, rows: list[dict[str, Any]], step: int) -> None:
        columns, table = _sample_table(rows)
        data = {c: [r[i] for r in table] for i, c in enumerate(columns)}
        self._client.log_table(self._run_id, data=data, artifact_file=f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def check_trackers(config: Config) -> None:
    """ConfigError naming run.report_to when a listed tracker's package is not installed."""
    for i, name in enumerate(config.run.report_to):
        if importlib.util.find_spec(_PACKAGES[name]) is None:
            raise ConfigError(f"run.report_to[{i}]", f"{name} is not installed: pip install -e '.[{name}]' "
                                                     f"(or pip install {_PACKAGES[name]})")


def open_trackers(config: Config, output_dir: str, start_step: int,
                  metadata: dict[str, Any] | None = None) -> list[Tracker]:
    """The trackers run.report_to lists, each given the resolved config and `metadata` (what the run found out
    beside its config, e.g. `rollout_seeds_honoured: false`) as top-level keys after it."""
    check_trackers(config)
    run = config.run
    name = run.name or os.path.basename(os.path.normpath(output_dir))
    metadata = metadata or {}
    config_yaml = dump_config(config) + (OmegaConf.to_yaml(metadata) if metadata else "")
    as_dict: dict[str, Any] = OmegaConf.to_container(OmegaConf.structured(config))  # type: ignore[assignment]
    assert isinstance(as_dict, dict)
    as_dict.update(metadata)
    opened: list[Tracker] = []
    for kind in run.report_to:
        if kind == "tensorboard":
            opened.append(TensorBoardTracker(output_dir, start_step, config_yaml))
        elif kind == "wandb":
            opened.append(WandbTracker(output_dir, run.project, name, as_dict))
        else:
            opened.append(MlflowTracker(output_dir, run.mlflow_tracking_uri, run.project, name, as_dict, config_yaml))
    return opened


def close_all(trackers: Sequence[Tracker]) -> None:
    """Closes every tracker, then raises the first error any of them raised."""
    errors = []
    for tracker in trackers:
        try:
            tracker.close()
        except Exception as error:  # noqa: BLE001 - the others still close
            errors.append(error)
    if errors:
        raise errors[0]
