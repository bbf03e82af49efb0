"""The run directory's outputs: metrics.jsonl, the trackers (TensorBoard, W&B, MLflow), samples.jsonl and
versioned HF weight exports.

Only process 0 writes; every process joins the gathers (multi-host arrays are collected first). On a bucket
(run.output_dir=gs://...) the JSON Lines files are rewritten whole with each step's rows, as a bucket has no
appends: a reader always gets one complete metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from drgrpo_jax.jsonl import read_jsonl
from drgrpo_jax.train.trackers import TensorBoardTracker, Tracker, close_all, scalars
from drgrpo_jax.weight_folders import is_remote, read_text, write_text

__all__ = ["RunLog", "read_metrics"]


def _json_value(value: Any) -> Any:
    """numpy scalars to Python; NaN/inf to None (JSON has neither)."""
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# ---------------------------------------------------------------------------------------------
# Output: metrics.jsonl, TensorBoard, samples.jsonl (process 0 only)
# ---------------------------------------------------------------------------------------------


class _JsonLines:
    """One JSON Lines file of the run log, without the rows a run that died before its next checkpoint wrote past
    `last_step`. On a disk a row is appended; on a bucket the object is rewritten whole (its rows kept here)."""

    def __init__(self, path: str, last_step: int):
        self.path = path
        text = read_text(path)
        kept = [line for line in (text or "").splitlines(keepends=True)
                if line.strip() and json.loads(line).get("step", 0) <= last_step]
        self._lines: list[str] | None = kept if is_remote(path) else None
        if self._lines is not None:
            if text is not None:
                write_text(path, "".join(kept))
        elif text is not None:
            with open(path + ".tmp", "w") as f:
                f.writelines(kept)
            os.replace(path + ".tmp", path)

    def append(self, rows: list[dict[str, Any]]) -> None:
        lines = [json.dumps({k: _json_value(v) for k, v in row.items()}) + "\n" for row in rows]
        if self._lines is None:
            with open(self.path, "a") as f:
                f.writelines(lines)
        else:
            self._lines += lines
            write_text(self.path, "".join(self._lines))


class RunLog:
    """Appends metrics and samples as JSON lines and mirrors them to the experiment trackers.

    `trackers`: the backends (drgrpo_jax.train.trackers; None = TensorBoard alone), opened by process 0 only.
    """

    def __init__(self, output_dir: str, start_step: int, enabled: bool, trackers: Sequence[Tracker] | None = None):
        self.enabled = enabled
        self.metrics_path = os.path.join(output_dir, "metrics.jsonl")
        self.samples_path = os.path.join(output_dir, "samples.jsonl")
        self.trackers: list[Tracker] = []
        if enabled:
            self._metrics, self._samples = (_JsonLines(path, start_step)
                                            for path in (self.metrics_path, self.samples_path))
            self.trackers = list(trackers) if trackers is not None else [TensorBoardTracker(output_dir, start_step)]

    def metrics(self, row: dict[str, Any]) -> None:
        """One metrics.jsonl row; its finite numbers also go to every tracker."""
        if not self.enabled:
            return
        self._metrics.append([row])
        values = scalars(row)
        for tracker in self.trackers:
            tracker.metrics(values, int(row["step"]))

    def samples(self, rows: list[dict[str, Any]]) -> None:
        """Sample completions, one JSON line each, and one table per step in every tracker."""
        if not self.enabled or not rows:
            return
        self._samples.append(rows)
        for tracker in self.trackers:
            tracker.samples(rows, int(rows[0]["step"]))

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        close_all(trackers)


# ---------------------------------------------------------------------------------------------
# Weights out: versioned HF folders the service loads
# ---------------------------------------------------------------------------------------------


def read_metrics(run_dir: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, evaluation rows) of RUN_DIR/metrics.jsonl, each by step; the last row of a repeated step wins
    (a run resumed from a checkpoint logs again the steps after it).

    FileNotFoundError without metrics.jsonl; ValueError naming the line that is not JSON.
    """
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{os.fspath(run_dir)!r} has no metrics.jsonl")
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    for row in read_jsonl(path):
        if "eval/accuracy" in row:
            evals[row["step"]] = row
        elif "loss" in row:
            train[row["step"]] = row
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]
