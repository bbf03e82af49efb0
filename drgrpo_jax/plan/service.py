"""The generation service's memory per device and the batch that fits: estimates for drgrpo_jax.plan.

One service device holds the weights (and, serving LoRA adapters, a base copy of the adapted projections to merge
each pushed adapter into), a KV cache of rows x (prompt + budget - 1) slots, bucketed to powers of two as the
sampler does, the prefill's float32 attention scores and softmax, and two rows of float32 logits.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.plan.activations import ITEMSIZE
from drgrpo_jax.plan.hardware import GIB

if TYPE_CHECKING:
    from drgrpo_jax.config.schema import Config

__all__ = ["bucket", "service_advice", "service_memory", "service_rows", "total"]


def total(figures: dict[str, int]) -> int:
    """The sum of a figures dict, leaving out private entries ("_...")."""
    return sum(v for k, v in figures.items() if not k.startswith("_"))


def bucket(n: int, minimum: int = 16) -> int:
    """The service's static size for n (sampling.bucket: powers of two from `minimum`)."""
    return 1 << (max(int(n), minimum, 1) - 1).bit_length()


def service_rows(config: Config, serve_batch_size: int | None) -> int:
    """Rows one service samples at once: --serve-batch-size, else rollout.service_batch_size, else the default.

    The default: the trainer's child takes a whole rollout (or the eval set); URLs split a rollout.
    """
    r = config.rollout
    rollout_rows = r.prompts_per_step * r.group_size
    serve_batch_size = serve_batch_size or r.service_batch_size
    if serve_batch_size is None:
        if r.urls:  # each service gets its share, capped by drgrpo_jax.serve's default --max-batch-size (32)
            return bucket(min(math.ceil(rollout_rows / len(r.urls)), 32), minimum=1)
        return bucket(max(rollout_rows, config.data.eval_size), minimum=1)
    return bucket(serve_batch_size, minimum=1)


def service_memory(config: Config, model: DecoderConfig, weights_bytes: int, rows: int,
                   merge_bytes: int = 0) -> dict[str, int]:
    """One generation-service device: weights, KV cache, the prefill's attention scores and, with LoRA, the
    base copy of the adapted projections kept to merge each new adapter into (`merge_bytes`)."""
    a, r = ITEMSIZE[config.model.dtype], config.rollout
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


