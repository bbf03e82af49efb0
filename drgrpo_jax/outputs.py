"""The run directory's outputs: metrics.jsonl, the trackers (TensorBoard, W&B, MLflow), samples.jsonl and
versioned HF weight exports.

Only process 0 writes; every process joins the gathers (multi-host arrays are collected first).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from drgrpo_jax.paths import copy_folder, is_remote, remove_folder, versions_in
from drgrpo_jax.trackers import Tracker, close_all, scalars

__all__ = ["RunLog", "WeightPublisher", "host_array"]


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


def _truncate_jsonl(path: str, last_step: int) -> None:
    """Drops rows written after `last_step` (by a run that died before its next checkpoint)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= last_step]
    with open(path + ".tmp", "w") as f:
        f.writelines(rows)
    os.replace(path + ".tmp", path)


class RunLog:
    """Appends metrics and samples as JSON lines and mirrors them to the experiment trackers.

    `trackers`: the backends (drgrpo_jax.trackers; None = TensorBoard alone), opened by process 0 only.
    """

    def __init__(self, output_dir: str, start_step: int, enabled: bool, trackers: Sequence[Tracker] | None = None):
        self.enabled = enabled
        self.metrics_path = os.path.join(output_dir, "metrics.jsonl")
        self.samples_path = os.path.join(output_dir, "samples.jsonl")
        self.trackers: list[Tracker] = []
        if enabled:
            for path in (self.metrics_path, self.samples_path):
                _truncate_jsonl(path, start_step)
            from drgrpo_jax.trackers import TensorBoardTracker

            self.trackers = list(trackers) if trackers is not None else [TensorBoardTracker(output_dir, start_step)]

    def _append(self, path: str, row: dict[str, Any]) -> None:
        with open(path, "a") as f:
            f.write(json.dumps({k: _json_value(v) for k, v in row.items()}) + "\n")

    def metrics(self, row: dict[str, Any]) -> None:
        """One metrics.jsonl row; its finite numbers also go to every tracker."""
        if not self.enabled:
            return
        self._append(self.metrics_path, row)
        values = scalars(row)
        for tracker in self.trackers:
            tracker.metrics(values, int(row["step"]))

    def samples(self, rows: list[dict[str, Any]]) -> None:
        """Sample completions, one JSON line each, and one table per step in every tracker."""
        if not self.enabled or not rows:
            return
        for row in rows:
            self._append(self.samples_path, row)
        for tracker in self.trackers:
            tracker.samples(rows, int(rows[0]["step"]))

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        close_all(trackers)


# ---------------------------------------------------------------------------------------------
# Weights out: versioned HF folders the service loads
# ---------------------------------------------------------------------------------------------


class WeightPublisher:
    """Exports params to root/v{version} (process 0 writes; every process joins the gather).

    With `mirror` (run.weights_dir: a folder every service reads, or gs://bucket/path) each version
    is also copied to mirror/v{version}, which is then the path the services are told to load.
    With `lora` (the model's DecoderConfig, which carries the adapters' spec), params are LoRA adapters
    and each version is a PEFT adapter folder naming `base_model`, a few MB instead of the whole model.
    """

    def __init__(self, root: str, graphdef: Any, keep: int = 2, mirror: str | None = None, *,
                 lora: Any = None, base_model: str = "", push_merged: bool = False):
        self.root, self.graphdef, self.keep = os.path.abspath(root), graphdef, keep
        self.mirror = mirror if mirror is None or is_remote(mirror) else os.path.abspath(mirror)
        self.lora, self.base_model, self.push_merged = lora, base_model, push_merged

    def export(self, params: Any, path: str, tokenizer: Any = None) -> str:
        """Writes `params` as an HF folder (a PEFT adapter folder with LoRA) at `path` atomically."""
        import jax
        from flax import nnx

        from drgrpo_jax.models import save_pretrained
        from drgrpo_jax.models.lora import adapter_arrays, save_adapter

        host_params = jax.tree.map(host_array, params)  # a collective in multi-host runs
        if jax.process_index() == 0:
            with _atomic_folder(path) as tmp:
                if self.lora is None:
                    save_pretrained(nnx.merge(self.graphdef, host_params), tmp, tokenizer=tokenizer)
                else:
                    save_adapter(adapter_arrays(host_params), self.lora, tmp, base_model=self.base_model)
                    if tokenizer is not None:
                        tokenizer.save_pretrained(tmp)
        return path

    def export_merged(self, params: Any, frozen: Any, path: str, tokenizer: Any = None) -> str:
        """Writes the base with the LoRA adapters merged in as an HF folder at `path` atomically."""
        import jax
        from flax import nnx

        from drgrpo_jax.models import save_pretrained
        from drgrpo_jax.models.lora import merged_model

        host_params, host_frozen = jax.tree.map(host_array, (params, frozen))
        if jax.process_index() == 0:
            with _atomic_folder(path) as tmp:
                save_pretrained(merged_model(nnx.merge(self.graphdef, host_params, host_frozen)), tmp,
                                tokenizer=tokenizer)
        return path

    def local_path(self, version: int) -> str:
        """The trainer's own copy of version `version`."""
        return os.path.join(self.root, f"v{version}")

    def publish(self, params: Any, version: int, frozen: Any = None) -> str:
        """Exports version `version` (and mirrors it), keeps the newest `keep`; returns the path services load.

        With LoRA and `push_merged`, the version is the merged model (`frozen`: the base), not the adapter.
        """
        import jax

        if self.lora is not None and self.push_merged:
            path = self.export_merged(params, frozen, self.local_path(version))
        else:
            path = self.export(params, self.local_path(version))
        if jax.process_index() != 0:
            return path if self.mirror is None else f"{self.mirror.rstrip('/')}/v{version}"
        _prune(self.root, version, self.keep)
        if self.mirror is None:
            return path
        target = f"{self.mirror.rstrip('/')}/v{version}"
        remove_folder(target)  # a partial copy left by a run that died mid-copy
        copy_folder(path, target)
        _prune(self.mirror, version, self.keep)
        return target


@contextlib.contextmanager
def _atomic_folder(path: str) -> Iterator[str]:
    """A temporary folder that replaces `path` once the block has written it (a crash leaves `path` as it was)."""
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    yield tmp
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def _prune(root: str, version: int, keep: int) -> None:
    """Deletes all but the newest `keep` versions up to `version`, and every version above it."""
    versions = versions_in(root)
    older = [v for v in versions if v < version]
    # Versions above this one were written by a run that died after its last checkpoint: stale.
    for stale in older[:max(len(older) - keep + 1, 0)] + [v for v in versions if v > version]:
        remove_folder(f"{root.rstrip('/')}/v{stale}")


def host_array(x: Any) -> np.ndarray:
    """A whole array as numpy on this host (gathered across processes when it spans several)."""
    import jax

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
