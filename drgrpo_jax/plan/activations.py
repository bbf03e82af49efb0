"""The trainer's activation memory per device, per rematerialisation policy: estimates the plan adds to exact state.

`_per_layer` has each policy's per-layer formula and `activation_bytes` the sum over layers, recompute and
temporaries; tests/plan/test_plan.py checks every policy's figure against XLA's own memory_analysis() of a small
model's backward.
"""

from __future__ import annotations

from drgrpo_jax.config.derived import pack_length
from drgrpo_jax.config.schema import Config
from drgrpo_jax.models.attention import BLOCKWISE_MIN_LENGTH, block_widths
from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.logprobs import DEFAULT_CHUNK_SIZE
from drgrpo_jax.models.precision import DTYPES
from drgrpo_jax.models.remat import REMAT_POLICIES
from drgrpo_jax.sampler.memory import moe_dispatch

__all__ = ["activation_bytes", "activations_by_policy", "batch_bytes", "choose_remat", "expert_ways",
           "gathered_kv_bytes", "local_tokens", "logprob_chunk_bytes", "model_call", "rows_per_device",
           "stores_probabilities"]


def rows_per_device(config: Config) -> int:
    """Responses one device holds in one micro-batch."""
    r, a, m = config.rollout, config.algorithm, config.mesh
    per_update = r.prompts_per_step * r.group_size // a.minibatches_per_rollout
    return max(per_update // config.train.micro_batches // (m.data * m.fsdp), 1)


def expert_ways(config: Config, model: DecoderConfig) -> int:
    """The shards a mixture's MLP runs expert-parallel over in the trainer (models/moe.py `expert_shards`: the
    fsdp axis, ShardingRules.expert, where its ways divide the experts), else 1."""
    fsdp = config.mesh.fsdp
    return fsdp if model.moe and fsdp > 1 and model.num_experts % fsdp == 0 else 1


def model_call(config: Config) -> tuple[int, int]:
    """(rows b, tokens S) of one device's model call per micro-batch: padded responses (prompt + budget - 1
    tokens), or the packed rows (train.pack_rows of train.pack_length); with mesh.context > 1, the whole row, of
    which a device holds S / mesh.context tokens (`local_tokens`)."""
    if config.train.pack_rows:
        return config.train.pack_rows, pack_length(config)
    return rows_per_device(config), config.rollout.max_prompt_tokens + config.rollout.max_new_tokens - 1


def local_tokens(config: Config, S: int) -> int:
    """The tokens of a row of S that one device holds: its share of the mesh.context ways (rounded up)."""
    return -(-S // config.mesh.context)


def gathered_kv_bytes(config: Config, model: DecoderConfig, S: int) -> int:
    """One row's keys and values of one layer over the whole sequence, 2 * S * CH/t * a: what each context way
    all-gathers to attend its own queries to every key (0 with mesh.context = 1, where they are the layer's own)."""
    if config.mesh.context == 1:
        return 0
    return 2 * S * model.num_kv_heads * model.head_dim // config.mesh.tensor * DTYPES[config.model.dtype].itemsize


def stores_probabilities(attention_impl: str, seq_len: int, backend: str) -> bool:
    """Whether the training forward's attention keeps [S, S] probabilities (the reference: models.attention)."""
    if attention_impl == "auto":
        return backend == "cpu" and seq_len < BLOCKWISE_MIN_LENGTH
    return attention_impl == "reference"


def _per_layer(config: Config, model: DecoderConfig, S: int, probabilities: bool, keys: int | None = None
               ) -> dict[str, int]:
    """Bytes one row keeps per layer for the backward pass under each policy.

    Letters: capitals as in docs/shape_letters.md (D, I, Q, C, H from the model), S tokens per row of
    one model call on this device (its share with mesh.context > 1), a activation bytes (the parameter dtype), t
    tensor ways, `keys` the keys each query may see (the whole row; default S):

      none                 2S * (4D + (2Q + 2C)H/t + 3I/t) * a + A    (norm inputs, q/k/v/o, MLP gate/up/product)
      dots_saveable        S * (3D + (Q + 2C)H/t + 2I/t) * a + O      (layer input, every projection's output)
      save_attention_out   S * D * a + O                              (layer input, attention output)
      full                 S * D * a                                  (layer input)

    A is the attention's own state: the reference keeps float32 scores and probabilities 2 * (Q/t) * S * keys * 4, the
    memory-linear kernels (blockwise, cuDNN, splash) the float32 log-sum-exp (Q/t) * S * 4; O is the attention
    output S * QH/t * a, plus, for a memory-linear kernel, its own copy and log-sum-exp S * QH/t * a + (Q/t) * S * 4.
    Without remat XLA keeps about twice the listed tensors (float32 norm and RoPE intermediates, both sides of each
    cast), hence the 2S. A mixture of experts' MLP replaces the 3I/t and 2I/t terms with `_moe_per_token`'s.
    """
    a, t = DTYPES[config.model.dtype].itemsize, config.mesh.tensor
    D, I, Q, C, H = model.hidden_size, model.intermediate_size, model.num_heads, model.num_kv_heads, model.head_dim
    heads = Q // t
    attention_state = 2 * heads * S * (keys or S) * 4 if probabilities else heads * S * 4
    output = S * heads * H * a + (0 if probabilities else S * heads * H * a + heads * S * 4)
    if model.moe:
        mlp_none, mlp_dots = _moe_per_token(model, t, a, expert_ways(config, model))
        kept_none, kept_dots = S * mlp_none, S * mlp_dots
    else:
        kept_none, kept_dots = 2 * S * (3 * I // t) * a, S * (2 * I // t) * a
    projections = S * (3 * D + (Q + 2 * C) * H // t) * a + kept_dots
    return {"none": 2 * S * (4 * D + (2 * Q + 2 * C) * H // t) * a + kept_none + attention_state,
            "dots_saveable": projections + output, "save_attention_out": S * D * a + output, "full": S * D * a}


def _moe_per_token(model: DecoderConfig, t: int, a: int, shards: int) -> tuple[int, int]:
    """(none, dots_saveable) bytes a token keeps in one mixture-of-experts MLP: its dispatch buffers
    (sampler/memory.py's `moe_dispatch`, grouped, expert-parallel over `shards`), and under dots_saveable the
    router's output e * a and the three grouped matmuls' float32 outputs k * (2f/t + D) * 4, over the shards x
    copies rows of the all-to-all's fixed buffers when expert-parallel."""
    D, e, k, f = model.hidden_size, model.num_experts, model.experts_per_token, model.moe_intermediate_size // t
    return moe_dispatch(model, 1, a, t, True, shards), e * a + shards * k * (2 * f * 4 + D * 4)


def _fallback_backward(model: DecoderConfig, tokens: int, a: int, t: int) -> int:
    """What one mixture layer's backward holds beside the rest where ragged_dot has no grouped kernel (CPU): per
    token-expert assignment, JAX's fallback masks the three projections' operands once per expert and keeps each
    expert's float32 product, e * ((2D + f/t) * a + (2f/t + D) * 4). Expert-parallel, a shard's e / E experts
    see E times the copies: the same bytes."""
    if not model.moe:
        return 0
    D, e, k, f = model.hidden_size, model.num_experts, model.experts_per_token, model.moe_intermediate_size // t
    return tokens * e * k * ((2 * D + f) * a + (2 * f + D) * 4)


def activation_bytes(config: Config, model: DecoderConfig, policy: str, backend: str = "cpu") -> int:
    """Activations one device holds in the backward pass of one micro-batch under `policy`.

    L layers of `_per_layer` for b rows of s = S / mesh.context tokens (`model_call`, `local_tokens`), plus what
    one layer's backward recomputes beside them (the none figure less its own), plus what is live at once: the
    reference's float32 scores b * (Q/t) * s * S * 4 and its two bool masks 2 * b * s * S, or a blockwise kernel's
    block temporaries 3 * b * (Q/t) * W * 2W * 4 (W its query block, `block_widths`); with mesh.context > 1 also
    one layer's all-gathered keys and values of the whole row and their gradient, 2 * b * `gathered_kv_bytes`.
    """
    b, S = model_call(config)
    s = local_tokens(config, S)
    probabilities = stores_probabilities(config.model.attention_impl, S, backend)
    layer = _per_layer(config, model, s, probabilities, keys=S)
    heads = model.num_heads // config.mesh.tensor
    if probabilities:
        live = b * heads * s * S * 4 + 2 * b * s * S
    else:
        W, V = block_widths(s)
        live = 3 * b * heads * W * V * 4
    live += 2 * b * gathered_kv_bytes(config, model, S)
    recomputed = b * (layer["none"] - layer[policy])  # what one layer's backward rebuilds beside what it kept
    if backend == "cpu":  # no grouped matmuls: one layer's backward holds ragged_dot's fallback buffers
        live += _fallback_backward(model, b * s, DTYPES[config.model.dtype].itemsize, config.mesh.tensor)
    return model.num_layers * b * layer[policy] + recomputed + live


def activations_by_policy(config: Config, model: DecoderConfig, backend: str = "cpu") -> dict[str, int]:
    """activation_bytes of every policy, most memory first."""
    return {policy: activation_bytes(config, model, policy, backend) for policy in REMAT_POLICIES}


def choose_remat(by_policy: dict[str, int], budget: int) -> str:
    """The first policy (least recomputation) whose activations fit `budget` bytes; full when none does."""
    return next((policy for policy in REMAT_POLICIES if by_policy[policy] <= budget), "full")


def logprob_chunk_bytes(config: Config, model: DecoderConfig, chunk: int = DEFAULT_CHUNK_SIZE) -> int:
    """One chunk's float32 logits, probabilities and their gradient on one device: 3 * W * V/t * 4 for W tokens."""
    tokens = min(chunk, rows_per_device(config) * local_tokens(config, config.rollout.max_new_tokens))
    return 3 * tokens * (model.vocab_size // config.mesh.tensor) * 4


def batch_bytes(config: Config) -> int:
    """One optimizer window's Batch arrays on one device (ids, masks, advantages, two log-prob rows)."""
    r, a, m = config.rollout, config.algorithm, config.mesh
    rows = r.prompts_per_step * r.group_size // a.minibatches_per_rollout // (m.data * m.fsdp)
    per_row = r.max_prompt_tokens * 5 + r.max_new_tokens * (4 + 1 + 4 + 4) + 4 + 1
    return rows * per_row
