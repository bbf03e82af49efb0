"""The generation service's memory per device and the batch that fits: estimates for drgrpo_jax.plan.

One service device holds the weights (and, serving LoRA adapters, a base copy of the adapted projections to merge
each pushed adapter into), a KV cache of rows x (prompt + budget - 1) slots, bucketed to powers of two as the
sampler does, the prefill's float32 attention scores and softmax, and two rows of float32 logits.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from drgrpo_jax.config.derived import child_service_batch_size
from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.precision import DTYPES
from drgrpo_jax.plan.hardware import GIB
from drgrpo_jax.sampler.generate import batch_bucket, bucket

if TYPE_CHECKING:
    from drgrpo_jax.config.schema import Config

__all__ = ["service_advice", "service_memory", "service_rows", "total"]


def total(figures: dict[str, int]) -> int:
    """The sum of a figures dict, leaving out private entries ("_...")."""
    return sum(v for k, v in figures.items() if not k.startswith("_"))


def service_rows(config: Config, serve_batch_size: int | None) -> int:
    """Rows one service samples at once: --serve-batch-size, else rollout.service_batch_size, else the default.

    The default: the trainer's child takes what the trainer starts it with; URLs split a rollout.
    """
    from drgrpo_jax.serve.engine import DEFAULT_MAX_BATCH_SIZE

    r = config.rollout
    if not serve_batch_size and r.service_batch_size is None and r.urls:
        # each service gets its share, capped by drgrpo_jax.serve's default --max-batch-size
        share = math.ceil(r.prompts_per_step * r.group_size / len(r.urls))
        return batch_bucket(min(share, DEFAULT_MAX_BATCH_SIZE))
    return batch_bucket(serve_batch_size or child_service_batch_size(config))


def service_memory(config: Config, model: DecoderConfig, weights_bytes: int, rows: int,
                   merge_bytes: int = 0) -> dict[str, int]:
    """One generation-service device: weights, KV cache, the prefill's attention scores and, with LoRA, the
    base copy of the adapted projections kept to merge each new adapter into (`merge_bytes`)."""
    a, r = DTYPES[config.model.dtype].itemsize, config.rollout
    prompt, new = bucket(r.max_prompt_tokens), bucket(r.max_new_tokens)
    slots = prompt + new - 1
    kv = 2 * model.num_layers * rows * slots * model.num_kv_heads * model.head_dim * a + rows * slots * 4
    prefill = rows * model.num_heads * (prompt - 1) * slots * (4 + 4)  # float32 scores and softmax
    return {"weights": weights_bytes, "adapter_merge": merge_bytes, "kv_cache": kv, "prefill_attention": prefill,
            "logits": rows * model.vocab_size * 4 * 2}


def service_advice(config: Config, model: DecoderConfig, weights: int, usable: int, rows: int,
                   merge_bytes: int = 0, tensor: int = 1) -> list[str]:
    """The largest batch one service device holds, or that the weights alone do not fit."""

    def per_device(batch: int) -> int:
        return total(service_memory(config, model, weights, batch, merge_bytes)) // tensor

    if (weights + merge_bytes) // tensor > usable:
        return [f"the generation service's weights ({weights / GIB:.1f} GiB) exceed one device: drgrpo_jax.serve "
                "uses one device per process, so run the service on a larger device (rollout.urls) or use a "
                "tensor-parallel server (SGLang-JAX, vLLM-TPU) there"]
    fits = rows
    while fits > 1 and per_device(fits) > usable:
        fits //= 2
    if per_device(fits) > usable:
        return ["even one row does not fit: lower rollout.max_new_tokens or rollout.max_prompt_tokens"]
    return [f"start each generation service with --max-batch-size {fits} (and list them in rollout.urls; "
            f"rollout.service_batch_size={fits} starts the trainer's own child so and lets the plan check it); "
            f"{rows} rows at once need {per_device(rows) / GIB:.1f} GiB"]


