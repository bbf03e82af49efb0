"""What one sampler batch holds on a device besides the weights: its KV cache, and the larger of two programs'
temporaries (the prefill's prompt cache and float32 attention scores, or the decode loop's RoPE tables and
sampling over the vocabulary). The service admits work within a budget of these bytes (serve/batch_budget.py); the
plan adds the weights (plan/service.py). tests/plan/test_plan_service.py checks them against the compiled
programs' own memory analysis, long prompts included.
"""

from __future__ import annotations

import jax

from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.sampler.batch import mesh_rows
from drgrpo_jax.sampler.programs import PREFILL_CHUNK

__all__ = ["SAMPLING_SHARD_COPIES", "SAMPLING_WHOLE_COPIES", "batch_memory", "batch_peak", "fallback_weights",
           "moe_dispatch"]

# The decode loop's float32 [rows, vocabulary] temporaries: copies of each device's vocabulary shard (logits,
# scaled, masked, ...) and copies of the whole vocabulary (the sort and cumulative mass of top-p/top-k gather
# it): fitted to the compiled loop's temporaries on CPU for tensor = 1, 2 and 4 (tests/plan/test_plan_service.py).
SAMPLING_SHARD_COPIES = 6
SAMPLING_WHOLE_COPIES = 2


def moe_dispatch(model: DecoderConfig, tokens: int, itemsize: int, tensor: int, grouped: bool,
                 shards: int = 1) -> int:
    """Bytes one mixture-of-experts layer (models/moe.py) holds while it runs `tokens` tokens: the router's float32
    logits and probabilities [tokens, e], and per token-expert assignment the sorted copy of the token and the
    float32 output with its copy in token order, besides, with grouped matmuls, their float32 gate, up and
    activated gate and the hidden, or without (`grouped` False: ragged_dot on CPU) the operand JAX's fallback masks
    once per expert, [e, assignments, input dim], for one projection at a time; the weights' copies that fallback
    makes are `fallback_weights`. Fitted to the compiled layer on CPU (tests/sampler/test_moe_memory.py).

    Expert-parallel over `shards` (the trainer's fsdp ways where they divide the experts): each shard's all-to-all
    buffers hold every one of its copies once per shard (dropless, a fixed size: models/moe.py), sent and
    received in the operand's dtype and returned in float32 beside int32 indices, and its e / shards experts run
    over all shards x copies rows. 0 for a dense model."""
    if not model.moe:
        return 0
    D, e, k, f = model.hidden_size, model.num_experts, model.experts_per_token, model.moe_intermediate_size // tensor
    projections = 3 * f * 4 + f * itemsize if grouped else e // shards * max(D, f) * itemsize
    exchange = 0 if shards == 1 else k * shards * (2 * D * itemsize + D * 4 + 2 * 4)
    return tokens * (2 * e * 4 + exchange + k * shards * (D * itemsize + 2 * D * 4 + projections))


def fallback_weights(model: DecoderConfig, itemsize: int, tensor: int, grouped: bool) -> int:
    """Bytes of one layer's expert weights ragged_dot's CPU fallback (`grouped` False) copies, transposed for its
    dot over (experts, input dim): gate, up and down, [e, D, f] each, live together; 0 with grouped matmuls or
    for a dense model."""
    if grouped or not model.moe:
        return 0
    return 3 * model.num_experts * model.hidden_size * (model.moe_intermediate_size // tensor) * itemsize


def batch_memory(model: DecoderConfig, rows: int, prompt_len: int, new_tokens: int, itemsize: int, *,
                 tensor: int = 1, data: int = 1, backend: str | None = None, record: bool = False) -> dict[str, int]:
    """Bytes on one device of a (data, tensor) mesh while the sampler runs `rows` rows, every one its own prompt
    (the prefill's worst case), `prompt_len` and `new_tokens` as bucketed; `itemsize`: the cache dtype's;
    `backend` (default: JAX's) decides a mixture's dispatch buffers (`moe_dispatch`); `record`: a mixture's
    batch records its routed experts (sampler/generate.py `record_experts`: int32 [rows, new_tokens, L, k] and
    the prompts' [rows, prompt_len, L, k], carried like the cache).

    The prefill writes at most PREFILL_CHUNK prompt columns a program, so its scores grow linearly with the
    prompt: [rows, heads, columns, prompt] for one layer at a time; a mixture's layer holds its dispatch buffers
    for those rows and columns in their place (whichever is larger), the decode loop's for one token a row."""
    slots = prompt_len + new_tokens - 1
    mine = mesh_rows(rows, data) // data  # rows are padded to split evenly over data
    heads = model.num_heads // tensor
    per_slot = 2 * model.num_layers * (model.num_kv_heads // tensor) * model.head_dim * itemsize  # keys, values
    columns = min(prompt_len - 1, PREFILL_CHUNK)
    scores = mine * heads * columns * prompt_len * (4 + 4)  # one layer's float32 scores and softmax
    sampling = mine * model.vocab_size * 4 * (SAMPLING_WHOLE_COPIES + SAMPLING_SHARD_COPIES / tensor)
    grouped = (backend or jax.default_backend()) != "cpu"  # TPU and GPU lower ragged_dot to grouped matmuls
    # The decode loop hoists every layer's fallback copies of the expert weights out of its body, beside the
    # layers' slices (plan/service.py's layer_split; the prefill makes its copies in their place).
    copies = model.num_layers * fallback_weights(model, itemsize, tensor, grouped)
    routed = mine * (new_tokens + prompt_len) * model.num_layers * model.experts_per_token * 4
    return {"kv_cache": mine * slots * (per_slot + 4),  # + each slot's int32 position
            "recorded_experts": routed if record and model.moe else 0,
            # the prompts' own cache, then one layer's scores or its dispatch buffers (never live at once)
            "prefill_attention": mine * prompt_len * per_slot
            + max(scores, moe_dispatch(model, mine * columns, itemsize, tensor, grouped)),
            "decode_temporaries": mine * slots * model.head_dim * 4 * 2 + int(sampling)  # RoPE (cos, sin) a step
            + moe_dispatch(model, mine, itemsize, tensor, grouped) + copies}


def batch_peak(figures: dict[str, int]) -> int:
    """The batch's peak: its cache and recorded experts, and the larger temporaries of the two programs (they
    never run at once)."""
    return figures["kv_cache"] + figures["recorded_experts"] + max(figures["prefill_attention"],
                                                                   figures["decode_temporaries"])
