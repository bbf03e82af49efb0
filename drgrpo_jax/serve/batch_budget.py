"""The service's batch budget: the memory one batch may take on a device beside the weights (--max-batch-bytes, else
half of what a device has free when the service starts), what a batch takes at the shapes the scheduler buckets it
to, and how many queued rows fit one batch. The scheduler fills its batches within it and the routes refuse a
request that alone would not fit (service.py `check_request`). The figures themselves: sampler/memory.py."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

import jax
from jax.sharding import Mesh

from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.host_memory import available_bytes
from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.precision import DTYPES
from drgrpo_jax.sampler.batch import RowRequest, bucket
from drgrpo_jax.sampler.memory import batch_memory, batch_peak

__all__ = ["BatchBudget", "free_device_bytes"]


def free_device_bytes(mesh: Mesh | None) -> int:
    """What one of the service's devices has free: the accelerator's own figures, or on CPU the host's
    available memory shared by the mesh's devices."""
    devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
    stats = devices[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return available_bytes() // len(devices)


@dataclasses.dataclass(frozen=True)
class BatchBudget:
    """What one batch may take on a device beside the weights, and what a batch of given rows takes."""

    model: DecoderConfig
    itemsize: int  # the KV cache dtype's
    tensor: int  # the service mesh's ways (1, 1 without one)
    data: int
    max_rows: int  # --max-batch-size
    limit: int  # bytes

    @classmethod
    def of(cls, config: ServeConfig, model: DecoderConfig, mesh: Mesh | None) -> BatchBudget:
        ways = {"tensor": 1, "data": 1} if mesh is None else mesh.shape
        return cls(model, DTYPES[config.dtype].itemsize, ways["tensor"], ways["data"], config.max_batch_size,
                   config.max_batch_bytes or free_device_bytes(mesh) // 2)

    def batch_bytes(self, rows: int, longest_prompt: int, most_new_tokens: int, record: bool = False) -> int:
        """A batch's sampler memory on one device beside the weights (sampler/memory.py), shapes bucketed as
        the scheduler's `run_batch` buckets them; every row counted as its own prompt; `record`: some row returns
        its routed experts (the batch records them all)."""
        return batch_peak(batch_memory(self.model, rows, bucket(longest_prompt), bucket(most_new_tokens),
                                       self.itemsize, tensor=self.tensor, data=self.data, record=record))

    def rows_that_fit(self, rows: Iterable[RowRequest]) -> int:
        """How many of the first `rows` make one batch: up to max_rows, while the batch's memory stays within the
        limit (one row always: the request's check refused any that alone does not fit)."""
        longest = most_new = count = 0
        record = False
        for count, row in enumerate(itertools.islice(rows, self.max_rows), 1):
            longest, most_new = max(longest, len(row.prompt_ids)), max(most_new, row.params.max_new_tokens)
            record = record or row.return_routed_experts
            if count > 1 and self.batch_bytes(count, longest, most_new, record) > self.limit:
                return count - 1
        return count
