"""The engine: served weights, their hot swap, and the one worker thread that batches requests into the sampler."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import yaml
from flax import nnx

from drgrpo_jax import sampling
from drgrpo_jax.models import from_pretrained
from drgrpo_jax.paths import local_folder
from drgrpo_jax.sampling import RowRequest

log = logging.getLogger("drgrpo_jax.serve")  # one logger name for the whole service, as before the split
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}  # ServeConfig.dtype -> parameter and KV-cache dtype


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How the service loads its model and batches requests."""

    model: str = ""  # HF folder (config.json + safetensors) or .gguf file
    host: str = "127.0.0.1"  # bind address; loopback unless told otherwise
    port: int = 30000  # TCP port (SGLang's default); 0 = any free port (see port_file)
    port_file: str = ""  # write the bound port here once serving (for parents that asked for port 0)
    dtype: str = "float32"  # parameter and KV-cache dtype: float32 | bfloat16
    weight_version: str = "0"  # version reported until the first update
    max_batch_size: int = 32  # rows (prompts x n) per sampler call
    batch_wait_ms: float = 5.0  # after the first request, wait this long for more to batch with it
    max_context: int = 0  # prompt + new tokens limit; 0 = the model's max_position_embeddings
    max_rows_per_request: int = 4096  # prompts x n accepted in one request
    tokenizer: str = ""  # tokenizer folder; "" = the model folder (none: text prompts are refused)
    served_model_name: str = ""  # name in OpenAI responses; "" = the model path
    parent_pid: int = 0  # shut down when this process is gone (set by rollout.LocalServer); 0 = off

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not supported (supported: {sorted(DTYPES)})")
        for name in ("max_batch_size", "max_rows_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.batch_wait_ms < 0 or self.max_context < 0:
            raise ValueError("batch_wait_ms, max_context: must be >= 0")


def load_config(path: str, overrides: dict[str, Any]) -> ServeConfig:
    """ServeConfig from a YAML file (a trainer config's `model` section and an optional `serve:` section)."""
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        # ValueError like every other bad-config error here, so callers catch one type.
        raise ValueError(f"{path}: must be a YAML mapping")  # noqa: TRY004
    fields = {f.name for f in dataclasses.fields(ServeConfig)}
    section = raw.get("serve", raw if "model" not in raw or isinstance(raw.get("model"), str) else {}) or {}
    unknown = sorted(set(section) - fields)
    if unknown:
        raise ValueError(f"serve.{unknown[0]}: unknown key (known: {sorted(fields)})")
    values = dict(section)
    model_section = raw.get("model")
    if isinstance(model_section, dict):  # a trainer config: model.path and model.dtype
        values.setdefault("model", model_section.get("path", ""))
        values.setdefault("dtype", model_section.get("dtype", "float32"))
        values.setdefault("tokenizer", model_section.get("tokenizer_path") or "")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return ServeConfig(**values)


@dataclasses.dataclass(frozen=True)
class Weights:
    """One immutable generation of served weights; swapped as a whole."""

    graphdef: nnx.GraphDef
    state: nnx.State
    config: Any  # drgrpo_jax.models.DecoderConfig
    version: str
    path: str


@dataclasses.dataclass(frozen=True)
class RowResult:
    """One completion."""

    output_ids: list[int]
    logprobs: list[float]
    stopped: bool  # ended on a stop/EOS token (the last of output_ids), else hit max_new_tokens
    weight_version: str


def load_weights(path: str, dtype: str, version: str) -> Weights:
    """Reads a checkpoint from disk (no device state is touched before it has loaded)."""
    model = from_pretrained(path, dtype=DTYPES[dtype])
    graphdef, state = nnx.split(model)
    return Weights(graphdef, state, model.config, str(version), path)


def check_compatible(old: Weights, new: Weights) -> None:
    """Raises ValueError naming the first difference that would make `new` a different model."""
    if new.config != old.config:
        diffs = [f.name for f in dataclasses.fields(old.config)
                 if getattr(old.config, f.name) != getattr(new.config, f.name)]
        raise ValueError(f"model config differs from the served model in {diffs}")
    old_leaves = jax.tree_util.tree_leaves_with_path(old.state)
    new_leaves = jax.tree_util.tree_leaves_with_path(new.state)
    if [p for p, _ in old_leaves] != [p for p, _ in new_leaves]:
        raise ValueError("parameter tree differs from the served model")
    for (keypath, a), (_, b) in zip(old_leaves, new_leaves):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"{jax.tree_util.keystr(keypath)}: shape/dtype {b.shape} {b.dtype} "
                             f"does not match the served {a.shape} {a.dtype}")
        if not bool(jnp.all(jnp.isfinite(b))):
            raise ValueError(f"{jax.tree_util.keystr(keypath)}: contains NaN or inf")


@dataclasses.dataclass
class _Job:
    """A request's rows and the future its handler awaits."""

    rows: list[RowRequest]
    future: concurrent.futures.Future
    results: list[RowResult | None]
    remaining: int


class Engine:
    """Owns the weights, the request queue and the one worker thread that runs the sampler."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.weights = load_weights(config.model, config.dtype, config.weight_version)
        self.max_context = config.max_context or self.weights.config.max_position_embeddings
        self._update_lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._pending: deque[tuple[_Job, int]] = deque()
        self.batches_run = 0
        self._worker = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._worker.start()

    @property
    def alive(self) -> bool:
        """Whether the worker thread is still serving."""
        return self._worker.is_alive()

    def submit(self, rows: Sequence[RowRequest]) -> concurrent.futures.Future:
        """Queues rows; the future resolves to their RowResults in order."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(_Job(list(rows), future, [None] * len(rows), len(rows)))
        return future

    def close(self) -> None:
        """Stops the worker after the batch it is running."""
        self._queue.put(None)
        self._worker.join(timeout=60)

    def update_weights(self, path: str, version: str) -> Weights:
        """Loads, checks and swaps in new weights; on any error the served weights stay as they were."""
        with self._update_lock, local_folder(path) as folder:  # a gs:// folder is copied to local disk first
            new = load_weights(folder, self.config.dtype, version)
            old = self.weights
            check_compatible(old, new)
            # Keep the old graphdef: it is the static key of the compiled programs (no recompiles).
            self.weights = Weights(old.graphdef, new.state, old.config, new.version, path)
            log.info("weights %s -> %s from %s", old.version, new.version, path)
            return self.weights

    def _take_rows(self) -> list[tuple[_Job, int]] | None:
        """Blocks for work, then gathers up to max_batch_size rows (None = shut down)."""
        while not self._pending:
            job = self._queue.get()
            if job is None:
                return None
            self._pending.extend((job, i) for i in range(len(job.rows)))
        deadline = time.monotonic() + self.config.batch_wait_ms / 1000
        while len(self._pending) < self.config.max_batch_size:
            try:
                job = self._queue.get(timeout=max(deadline - time.monotonic(), 0))
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)  # finish this batch, then stop
                break
            self._pending.extend((job, i) for i in range(len(job.rows)))
        count = min(len(self._pending), self.config.max_batch_size)
        return [self._pending.popleft() for _ in range(count)]

    def _run(self) -> None:
        """Worker loop: batch, sample, hand results back; an error fails only that batch's requests."""
        while (taken := self._take_rows()) is not None:
            weights = self.weights  # one read: the whole batch uses one version
            try:
                results = self.run_batch(weights, [job.rows[i] for job, i in taken])
            except Exception as error:  # reported to the batch's requests (and logged); the service goes on
                log.exception("batch failed")
                for job, _ in taken:
                    if not job.future.done():
                        job.future.set_exception(error)
                continue
            for (job, i), result in zip(taken, results):
                job.results[i] = result
                job.remaining -= 1
                if job.remaining == 0 and not job.future.done():
                    job.future.set_result(job.results)

    def run_batch(self, weights: Weights, rows: list[RowRequest]) -> list[RowResult]:
        """Samples one batch of rows on `weights`, padded to bucketed static shapes."""
        batch = sampling.make_batch(
            rows, weights.config.eos_token_ids, batch_size=sampling.batch_bucket(len(rows)),
            prompt_len=sampling.bucket(max(len(r.prompt_ids) for r in rows)))
        out = sampling.generate(weights.graphdef, weights.state, batch,
                                max_new_tokens=sampling.bucket(max(r.params.max_new_tokens for r in rows)),
                                cache_dtype=DTYPES[self.config.dtype])
        tokens, logprobs, lengths, stopped = jax.device_get(
            (out.tokens_BT, out.logprobs_BT, out.lengths_B, out.stopped_B))
        self.batches_run += 1
        return [RowResult(tokens[b, :lengths[b]].tolist(), logprobs[b, :lengths[b]].tolist(), bool(stopped[b]),
                          weights.version) for b in range(len(rows))]
