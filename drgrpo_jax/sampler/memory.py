"""What one sampler batch holds on a device besides the weights: its KV cache, and the larger of two programs'
temporaries (the prefill's prompt cache and float32 attention scores, or the decode loop's RoPE tables and
sampling over the vocabulary). The service admits work within a budget of these bytes (serve/engine.py); the
plan adds the weights (plan/service.py). tests/plan/test_plan_service.py checks them against the compiled
programs' own memory analysis, long prompts included.
"""

from __future__ import annotations

import jax

from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.sampler.generate import PREFILL_CHUNK, mesh_rows

__all__ = ["SAMPLING_SHARD_COPIES", "SAMPLING_WHOLE_COPIES", "batch_memory", "batch_peak", "moe_dispatch"]

# The decode loop's float32 [rows, vocabulary] temporaries: copies of each device's vocabulary shard (logits,
# scaled, masked, ...) and copies of the whole vocabulary (the sort and cumulative mass of top-p/top-k gather
# it): fitted to the compiled loop's temporaries on CPU for tensor = 1, 2 and 4 (tests/plan/test_plan_service.py).
SAMPLING_SHARD_COPIES = 6
SAMPLING_WHOLE_COPIES = 2


def moe_dispatch(model: DecoderConfig, tokens: int, itemsize: int, tensor: int, grouped: bool) -> int:
    """Bytes one mixture-of-experts layer (models/moe.py) holds while it runs `tokens` tokens: the router's float32
    logits and probabilities [tokens, e], and per token-expert assignment the sorted copy of the token, the grouped
    matmuls' float32 gate, up and activated gate, the hidden and the float32 outputs with their copy in token
    order; without a grouped kernel (`grouped` False: ragged_dot on CPU), JAX's fallback masks the operand once
    per expert and keeps every expert's float32 product, e times larger, for each of the three projections.
    0 for a dense model."""
    if not model.moe:
        return 0
    D, e, k, f = model.hidden_size, model.num_experts, model.experts_per_token, model.moe_intermediate_size // tensor
    per_token = 2 * e * 4 + k * (D * itemsize + 3 * f * 4 + f * itemsize + 2 * D * 4)
    if not grouped:
        per_token += e * k * ((2 * D + f) * itemsize + (2 * f + D) * 4)
    return tokens * per_token


def batch_memory(model: DecoderConfig, rows: int, prompt_len: int, new_tokens: int, itemsize: int, *,
                 tensor: int = 1, data: int = 1, backend: str | None = None) -> dict[str, int]:
    """Bytes on one device of a (data, tensor) mesh while the sampler runs `rows` rows, every one its own prompt
    (the prefill's worst case), `prompt_len` and `new_tokens` as bucketed; `itemsize`: the cache dtype's;
    `backend` (default: JAX's) decides a mixture's dispatch buffers (`moe_dispatch`).

    The prefill writes at most PREFILL_CHUNK prompt columns a program, so its scores grow linearly with the
    prompt: [rows, heads, columns, prompt] for one layer at a time; a mixture's layer adds its dispatch buffers
    for those rows and columns, and the decode loop's for one token a row."""
    slots = prompt_len + new_tokens - 1
    mine = mesh_rows(rows, data) // data  # rows are padded to split evenly over data
    heads = model.num_heads // tensor
    per_slot = 2 * model.num_layers * (model.num_kv_heads // tensor) * model.head_dim * itemsize  # keys, values
    columns = min(prompt_len - 1, PREFILL_CHUNK)
    scores = mine * heads * columns * prompt_len * (4 + 4)  # one layer's float32 scores and softmax
    sampling = mine * model.vocab_size * 4 * (SAMPLING_WHOLE_COPIES + SAMPLING_SHARD_COPIES / tensor)
    grouped = (backend or jax.default_backend()) != "cpu"  # TPU and GPU lower ragged_dot to grouped matmuls
    return {"kv_cache": mine * slots * (per_slot + 4),  # + each slot's int32 position
            "prefill_attention": mine * prompt_len * per_slot + scores  # the prompts' own cache, then the rows'
            + moe_dispatch(model, mine * columns, itemsize, tensor, grouped),
            "decode_temporaries": mine * slots * model.head_dim * 4 * 2 + int(sampling)  # RoPE (cos, sin) a step
            + moe_dispatch(model, mine, itemsize, tensor, grouped)}


def batch_peak(figures: dict[str, int]) -> int:
    """The batch's peak: its cache, and the larger temporaries of the two programs (they never run at once)."""
    return figures["kv_cache"] + max(figures["prefill_attention"], figures["decode_temporaries"])
