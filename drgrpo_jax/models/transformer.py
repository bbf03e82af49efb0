"""Decoder-only transformer (Llama, Qwen2, Qwen3, Qwen3-MoE, GPT-OSS, Gemma 3 text) as a Flax NNX module, with a KV
cache.

Shape letters (docs/shape_letters.md):
  B batch rows, T query positions, S key positions (cache slots), L layers, D model dim,
  I MLP hidden, Q query heads, C key/value heads, R query heads per kv head (Q = C * R),
  H head dim (h = H / 2, the rotary pairs; n = Q or C where queries and keys share code), V vocab,
  M flattened tokens (B * T), X and Y the input and output features of a projection, Z a LoRA adapter's rank;
  a mixture of experts' letters are models/moe.py's.

Layers are stored stacked ([L, ...], params.py): a full forward scans one compiled block; cached decoding runs
them unrolled over per-layer weights and a per-layer cache that a decode loop updates in place (kv_cache.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from drgrpo_jax.models import quant
from drgrpo_jax.models.attention import attention, choose_impl, reference_attention, self_attention_mask
from drgrpo_jax.models.config import LORA_TARGETS, DecoderConfig, RuntimeOptions
from drgrpo_jax.models.context_parallel import constrain_tokens, context_attention, context_impl, context_ways
from drgrpo_jax.models.gemm import dense
from drgrpo_jax.models.grad_sums import scan_layers
from drgrpo_jax.models.kv_cache import (
    KVCache,
    attend_slots,
    bits,
    split_cache,
    stack_cache,
    unbits,
    write_keys,
    write_values,
)
from drgrpo_jax.models.moe import Glu, RouterStats, clamped_swiglu, moe_mlp, router_stats
from drgrpo_jax.models.params import Blocks, init_value
from drgrpo_jax.models.remat import name_attention, name_projection

_F32 = jnp.float32


# ---------------------------------------------------------------- pure building blocks


def project(x_BTX: jax.Array, w: jax.Array, in_dims: int = 1, dtype=None) -> jax.Array:
    """x [B, T, *in] times w [*in, *out] over the `in_dims` trailing axes of x: [B, T, *out], as a 2-D GEMM in
    `dtype` (None: w's; `gemm.dense`)."""
    B, T = x_BTX.shape[:2]
    in_shape, out_shape = w.shape[:in_dims], w.shape[in_dims:]
    size_in, size_out = math.prod(in_shape), math.prod(out_shape)
    y_MY = dense(x_BTX.reshape(B * T, size_in), w.reshape(size_in, size_out), dtype)
    return y_MY.reshape(B, T, *out_shape)


def _project_f32(x_BTX: jax.Array, w_XY: jax.Array) -> jax.Array:
    """x [B, T, X] @ w [X, Y] with the float32 accumulator kept (inference: no custom gradient)."""
    return jnp.einsum("btx,xy->bty", x_BTX, w_XY, preferred_element_type=_F32)


def _lora_term(run: RuntimeOptions, p: dict[str, jax.Array], name: str, x_BTX: jax.Array,
               key: jax.Array | None) -> jax.Array | None:
    """float32 (alpha / r) * dropout(x) A B [B, T, *out] when projection `name` has an adapter (models/lora.py).

    Both GEMMs are `dense`s in the config's compute dtype (bfloat16 under mixed precision) accumulating in
    float32, the adapters' gradients float32; dropout and the low-rank activations between them stay float32.
    """
    if run.lora is None or f"{name}_lora_a" not in p:
        return None
    a, b = p[f"{name}_lora_a"], p[f"{name}_lora_b"]  # [*X, Z], [Z, *Y]
    B, T = x_BTX.shape[:2]
    x_MX = x_BTX.reshape(B * T, -1).astype(_F32)
    if key is not None and run.lora.dropout > 0:
        keep = 1.0 - run.lora.dropout
        kept_MX = jax.random.bernoulli(jax.random.fold_in(key, LORA_TARGETS.index(name)), keep, x_MX.shape)
        x_MX = jnp.where(kept_MX, x_MX / keep, 0.0)
    low_MZ = dense(x_MX, a.reshape(-1, a.shape[-1]), run.compute_dtype)
    y_MY = dense(low_MZ, b.reshape(b.shape[0], -1), run.compute_dtype) * run.lora.scale
    return y_MY.reshape(B, T, *b.shape[1:])


def _project(run: RuntimeOptions, p: dict[str, jax.Array], name: str, x_BTX: jax.Array, in_dims: int = 1,
             key: jax.Array | None = None) -> jax.Array:
    """`project` by weight `name` of layer `p` (int8 dequantised: models/quant.py), plus its adapter's term."""
    y_BTY = project(x_BTX, quant.weight(p, name), in_dims, run.compute_dtype)
    delta = _lora_term(run, p, name, x_BTX, key)
    return name_projection(y_BTY if delta is None else (y_BTY.astype(_F32) + delta).astype(y_BTY.dtype))


def _project_f32_lora(run: RuntimeOptions, p: dict[str, jax.Array], name: str, x_BTX: jax.Array) -> jax.Array:
    """`_project_f32` by weight `name`, plus its adapter's term (inference: no dropout)."""
    y_BTY = _project_f32(x_BTX, quant.weight(p, name))
    delta = _lora_term(run, p, name, x_BTX, None)
    return y_BTY if delta is None else y_BTY + delta


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, plus_one: bool) -> jax.Array:
    """RMSNorm in float32; Gemma applies (1 + w) in float32, Llama applies w after casting back."""
    x32 = x.astype(_F32)
    weight = weight.reshape((1,) * (x.ndim - weight.ndim) + weight.shape)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if plus_one:
        return (normed * (1.0 + weight.astype(_F32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def rope_tables(positions_BT: jax.Array, inv_freq: np.ndarray, scaling: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, T, H] for rotate-half RoPE, times `scaling` (YaRN's attention factor) where it is not 1."""
    angles_BTh = positions_BT.astype(_F32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    angles_BTH = jnp.concatenate([angles_BTh, angles_BTh], axis=-1)
    if scaling == 1.0:
        return jnp.cos(angles_BTH), jnp.sin(angles_BTH)
    return jnp.cos(angles_BTH) * scaling, jnp.sin(angles_BTH) * scaling


def apply_rope(x_BTnH: jax.Array, cos_BTH: jax.Array, sin_BTH: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the HF layout: first and second halves of each head pair up)."""
    x32 = x_BTnH.astype(_F32)
    half = x32.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos_BTH[:, :, None, :] + rotated * sin_BTH[:, :, None, :]
    return out.astype(x_BTnH.dtype)


def _activation(name: str, x: jax.Array) -> jax.Array:
    """MLP gate nonlinearity."""
    if name == "silu":
        return jax.nn.silu(x)
    return jax.nn.gelu(x, approximate=name == "gelu_pytorch_tanh")


def _expert_glu(config: DecoderConfig) -> Glu:
    """How an expert combines its gate and up projections: GPT-OSS's clamped SwiGLU, else activation(gate) * up."""
    if config.traits.gpt_oss_experts:
        return clamped_swiglu(config.swiglu_alpha, config.swiglu_limit)
    return lambda gate, up: _activation(config.activation, gate) * up


def _sinks(config: DecoderConfig, p: dict[str, jax.Array]) -> jax.Array | None:
    """A layer's attention sinks [Q] (GPT-OSS), or None."""
    return p["sinks"] if config.traits.attention_sinks else None


def rope_for_layers(config: DecoderConfig, positions_BT: jax.Array):
    """((cos, sin) for global layers, (cos, sin) for sliding layers), each [B, T, H]."""
    global_tables = rope_tables(positions_BT, config.rope.inv_freq(config.head_dim), config.rope.attention_scaling)
    if config.local_rope is None or not any(config.sliding_layers):
        return global_tables, global_tables
    local = config.local_rope
    return global_tables, rope_tables(positions_BT, local.inv_freq(config.head_dim), local.attention_scaling)


def _qkv(config: DecoderConfig, run: RuntimeOptions, p: dict[str, jax.Array], x_BTD: jax.Array, cos_BTH: jax.Array,
         sin_BTH: jax.Array, key: jax.Array | None = None):
    """A layer's normed, roped queries [B, T, Q, H] and new keys/values [B, T, C, H] (`key`: adapter dropout)."""
    eps, plus_one = config.rms_norm_eps, config.traits.norm_plus_one
    h_BTD = rms_norm(x_BTD, p["attn_norm"], eps, plus_one)
    q_BTQH = _project(run, p, "q_proj", h_BTD, key=key)
    k_BTCH = _project(run, p, "k_proj", h_BTD, key=key)
    v_BTCH = _project(run, p, "v_proj", h_BTD, key=key)
    if config.qkv_bias:
        q_BTQH, k_BTCH, v_BTCH = (
            q_BTQH + p["q_bias"][None, None], k_BTCH + p["k_bias"][None, None], v_BTCH + p["v_bias"][None, None])
    if config.traits.qk_norm:
        q_BTQH = rms_norm(q_BTQH, p["q_norm"], eps, plus_one)
        k_BTCH = rms_norm(k_BTCH, p["k_norm"], eps, plus_one)
    return apply_rope(q_BTQH, cos_BTH, sin_BTH), apply_rope(k_BTCH, cos_BTH, sin_BTH), v_BTCH


Routing = tuple[jax.Array, jax.Array]  # a mixture's (router logits [M, e], experts [M, k]) of one layer


def _after_attention(config: DecoderConfig, run: RuntimeOptions, p: dict[str, jax.Array], x_BTD: jax.Array,
                     o_BTQH: jax.Array, f32_gate: bool = False, key: jax.Array | None = None,
                     forced_BTk: jax.Array | None = None) -> tuple[jax.Array, Routing | None]:
    """Output projection and residual, then the MLP block and its residual; and a mixture's routing (else None).

    `forced_BTk`: the experts a mixture uses (router replay), in place of its router's choice.

    `f32_gate` (inference) applies the gate nonlinearity to the GEMMs' float32 outputs and rounds once:
    in bf16, XLA on CPU emulates the activation op by op, rounding after each (much slower at decode).
    """
    eps, plus_one = config.rms_norm_eps, config.traits.norm_plus_one
    a_BTD = _project(run, p, "o_proj", o_BTQH, in_dims=2, key=key)
    if config.o_bias:
        a_BTD = a_BTD + p["o_bias"][None, None]
    if config.traits.sandwich_norms:
        a_BTD = rms_norm(a_BTD, p["post_attn_norm"], eps, plus_one)
    x_BTD = x_BTD + a_BTD
    with jax.named_scope("mlp"):
        h_BTD = rms_norm(x_BTD, p["mlp_norm"], eps, plus_one)
        if config.moe:
            B, T, D = h_BTD.shape
            k = config.experts_per_token
            forced_Mk = None if forced_BTk is None else forced_BTk.reshape(B * T, k)
            m_MD, logits_Me, experts_Mk = moe_mlp(h_BTD.reshape(B * T, D), p, k, config.norm_topk_prob,
                                                  _expert_glu(config), run.compute_dtype,
                                                  config.traits.gpt_oss_experts, forced_Mk)
            return x_BTD + m_MD.reshape(B, T, D), (logits_Me, experts_Mk)
        if f32_gate:
            gate_BTI = _activation(config.activation, _project_f32_lora(run, p, "gate_proj", h_BTD))
            hidden_BTI = (gate_BTI * _project_f32_lora(run, p, "up_proj", h_BTD)).astype(h_BTD.dtype)
        else:
            gate_BTI = _activation(config.activation, _project(run, p, "gate_proj", h_BTD, key=key))
            hidden_BTI = gate_BTI * _project(run, p, "up_proj", h_BTD, key=key)
        m_BTD = _project(run, p, "down_proj", hidden_BTI, key=key)
        if config.traits.sandwich_norms:
            m_BTD = rms_norm(m_BTD, p["post_mlp_norm"], eps, plus_one)
        return x_BTD + m_BTD, None


def _layer_attention(config: DecoderConfig, run: RuntimeOptions, impl: str, q_BTQH: jax.Array, k_BTCH: jax.Array,
                     v_BTCH: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array, sliding: jax.Array,
                     sinks_Q: jax.Array | None, split: bool = False) -> jax.Array:
    """One scanned layer's attention by a memory-linear `impl` (`split`: rows in the context layout, their tokens
    over the mesh's context axis); the window is static, so mixed layers take a cond."""
    def attend(window):
        kernel = context_attention if split else attention
        return kernel(q_BTQH, k_BTCH, v_BTCH, positions_BT, segment_ids_BT, scale=config.attn_scale, window=window,
                      impl=impl, dtype=run.compute_dtype, sinks_Q=sinks_Q)

    kinds = set(config.sliding_layers)
    if config.sliding_window is None or kinds == {False}:
        return attend(None)
    if kinds == {True}:
        return attend(config.sliding_window)
    return jax.lax.cond(sliding, lambda: attend(config.sliding_window), lambda: attend(None))


def _run_blocks(config: DecoderConfig, run: RuntimeOptions, params: dict[str, jax.Array], x_BTD: jax.Array,
                positions_BT: jax.Array, segment_ids_BT: jax.Array, lora_key: jax.Array | None = None,
                grad_sums: dict[str, jax.Array] | None = None, routed_BTLk: jax.Array | None = None,
                with_stats: bool = False, counted_BT: jax.Array | None = None) -> tuple[jax.Array, RouterStats | None]:
    """All decoder layers of a full (cache-free) forward via lax.scan: one compiled block for L layers; and with
    `with_stats` (a mixture) the router's sums over the real tokens (segment id != 0; or `counted_BT`), else None.

    `lora_key` (training with adapter dropout): each layer draws its masks from its own fold of it.
    `grad_sums` (remat `full`): float32 sums shaped like params that take their gradient (models/grad_sums.py).
    `routed_BTLk` (a mixture): every layer's experts of every token (router replay), in place of its router's.

    Attention by `run.attention_impl` (`choose_impl`): the reference builds both [B, T, T] masks once for all
    layers; the others derive visibility from positions and segment ids inside their kernels. Traced on a mesh
    whose context axis has C > 1 ways, the rows come in the context layout (models/context_parallel.py) and every
    layer's activations keep to their shard's tokens (`context_impl` picks the kernel).
    """
    (cos_g, sin_g), (cos_l, sin_l) = rope_for_layers(config, positions_BT)
    compute = run.compute_dtype or x_BTD.dtype  # float32 activations under bf16 compute still get cuDNN
    split = context_ways() > 1
    impl = (context_impl if split else choose_impl)(run.attention_impl, seq_len=x_BTD.shape[1], dtype=compute,
                                                    head_dim=config.head_dim, sinks=config.traits.attention_sinks)
    masks = forward_masks(config, positions_BT, segment_ids_BT) if impl == "reference" and not split else None
    x_BTD = constrain_tokens(x_BTD) if split else x_BTD
    sliding_L = jnp.asarray(config.sliding_layers)
    layer_L = jnp.arange(config.num_layers)
    routed_LBTk = None if routed_BTLk is None else jnp.moveaxis(jnp.asarray(routed_BTLk, jnp.int32), 2, 0)
    real_M = (segment_ids_BT != 0 if counted_BT is None else counted_BT).reshape(-1)

    def block(carry, layer):
        x_BTD, stats = carry if with_stats else (carry, None)
        p, (sliding, index, forced_BTk) = layer
        key = None if lora_key is None else jax.random.fold_in(lora_key, index)
        with jax.named_scope("attention"):
            cos, sin = jnp.where(sliding, cos_l, cos_g), jnp.where(sliding, sin_l, sin_g)
            q_BTQH, k_BTCH, v_BTCH = _qkv(config, run, p, x_BTD, cos, sin, key)
            if masks is None:
                o_BTQH = _layer_attention(config, run, impl, q_BTQH, k_BTCH, v_BTCH, positions_BT, segment_ids_BT,
                                          sliding, _sinks(config, p), split)
            else:
                mask_BTS = jnp.where(sliding, masks[1], masks[0])
                o_BTQH = reference_attention(q_BTQH, k_BTCH, v_BTCH, mask_BTS, config.attn_scale, run.compute_dtype,
                                             _sinks(config, p))
            o_BTQH = name_attention(o_BTQH)
        x_BTD, routing = _after_attention(config, run, p, x_BTD, o_BTQH, key=key, forced_BTk=forced_BTk)
        x_BTD = constrain_tokens(x_BTD) if split else x_BTD
        if stats is None or routing is None:
            return x_BTD
        layer_stats = router_stats(*routing, real_M, index, config.num_layers)
        return x_BTD, jax.tree.map(jnp.add, stats, layer_stats)

    if not with_stats:
        return scan_layers(block, x_BTD, params, (sliding_L, layer_L, routed_LBTk), run.remat, grad_sums), None
    if not config.moe:
        raise ValueError(f"router stats: {config.family} has no router (a dense MLP in every layer)")
    e = config.num_experts
    zeros = RouterStats(counts_Le=jnp.zeros((config.num_layers, e), _F32), probs_e=jnp.zeros(e, _F32),
                        z=jnp.zeros((), _F32), rows=jnp.zeros((), _F32))
    return scan_layers(block, (x_BTD, zeros), params, (sliding_L, layer_L, routed_LBTk), run.remat, grad_sums)


def _run_blocks_unrolled(config: DecoderConfig, run: RuntimeOptions, layers: tuple[dict[str, jax.Array], ...],
                         x_BTD: jax.Array, positions_BT: jax.Array, masks: tuple[jax.Array, jax.Array], cache: KVCache,
                         rope=None):
    """Every layer as straight-line code over per-layer weights and a per-layer (split) cache; returns
    (x, keys, values, a mixture's experts [B, T, L, k] or None).

    Static layer indices and per-layer buffers: a scan step dynamic-slices every weight and the layer's
    cache out of the stacked arrays (copies, and on CPU a bf16 dynamic-slice goes through f32); here each
    layer's slots are written in place, then read.
    """
    tables = rope_for_layers(config, positions_BT) if rope is None else rope
    keys, values, experts = [], [], []
    for index, (p, sliding) in enumerate(zip(layers, config.sliding_layers)):
        with jax.named_scope(f"layer_{index}"):
            q_BTQH, k_BTCH, v_BTCH = _qkv(config, run, p, x_BTD, *tables[int(sliding)])
            keys.append(write_keys(cache.k[index], k_BTCH, cache.length))
            values.append(write_values(cache.v[index], v_BTCH, cache.length))
            o_BTQH = attend_slots(q_BTQH, keys[-1], values[-1], masks[int(sliding)], config.attn_scale,
                                  _sinks(config, p))
            x_BTD, routing = _after_attention(config, run, p, x_BTD, o_BTQH, f32_gate=True)
            if routing is not None:
                experts.append(routing[1].reshape(*x_BTD.shape[:2], -1))
    return x_BTD, tuple(keys), tuple(values), jnp.stack(experts, axis=2) if experts else None


def layer_params(params: dict[str, jax.Array], num_layers: int) -> tuple[dict[str, jax.Array], ...]:
    """The stacked block parameters split into one dict per layer (what `decode` steps read).

    Split once outside a decode loop, so the loop body reads each layer's weights in place.
    """
    return tuple({name: value[index] for name, value in params.items()} for index in range(num_layers))


def _window(config: DecoderConfig, q_pos_BT: jax.Array, k_pos_BS: jax.Array) -> jax.Array:
    """[B, T, S]: key inside the sliding window of the query (HF: q_pos - k_pos < window)."""
    if config.sliding_window is None:
        return jnp.ones((q_pos_BT.shape[0], q_pos_BT.shape[1], k_pos_BS.shape[1]), bool)
    return q_pos_BT[:, :, None] - k_pos_BS[:, None, :] < config.sliding_window


def forward_masks(config: DecoderConfig, positions_BT: jax.Array, segment_ids_BT: jax.Array):
    """(full, sliding) masks [B, T, T]: same non-zero segment, causal by index, window by position."""
    idx_T = jnp.arange(positions_BT.shape[1])
    full_BTS = self_attention_mask(segment_ids_BT, segment_ids_BT, idx_T, idx_T, positions_BT, positions_BT, None)
    return full_BTS, full_BTS & _window(config, positions_BT, positions_BT)


def cache_masks(config: DecoderConfig, positions_BT: jax.Array, cache_positions_BS: jax.Array):
    """(full, sliding) masks [B, T, S]: slot filled and its position <= the query's position."""
    k_pos = cache_positions_BS[:, None, :]
    full_BTS = (k_pos >= 0) & (k_pos <= positions_BT[:, :, None])
    return full_BTS, full_BTS & _window(config, positions_BT, cache_positions_BS)


class Transformer(nnx.Module):
    """Decoder-only LM; call it for float32 logits, `decode` for cached generation."""

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 runtime: RuntimeOptions | None = None):
        self.config = config  # the architecture (config.json)
        self.runtime = runtime or RuntimeOptions()  # how its forward runs: remat, attention, adapters, GEMM dtype
        D, V = config.hidden_size, config.vocab_size
        self.embed = nnx.Param(init_value("normal", rngs.params(), (V, D), dtype), logical_axes=("vocab", "embed"))
        self.blocks = Blocks(config, rngs=rngs, dtype=dtype)
        self.final_norm = nnx.Param(init_value("zeros" if config.traits.norm_plus_one else "ones", None, (D,), dtype),
                                    logical_axes=("embed",))
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(init_value("normal", rngs.params(), (D, V), dtype),
                                     logical_axes=("embed", "vocab"))

    def _embed(self, input_ids_BT: jax.Array, inference: bool = False) -> jax.Array:
        """Token embeddings (scaled by sqrt(D) in the weight dtype for Gemma, as HF does).

        `inference` gathers bf16 rows through `kv_cache.bits` (no gradient): a plain bf16 gather converts the whole
        table to f32 first on CPU.
        """
        table_VD = self.embed[...]
        if inference:
            x_BTD = unbits(jnp.take(bits(table_VD), input_ids_BT, axis=0), table_VD.dtype)
        else:
            x_BTD = jnp.take(table_VD, input_ids_BT, axis=0)
        if self.config.traits.scale_embeddings:
            x_BTD = x_BTD * jnp.asarray(math.sqrt(self.config.hidden_size), table_VD.dtype)
        return x_BTD

    def hidden_states(self, input_ids_BT: jax.Array, positions_BT: jax.Array | None = None,
                      segment_ids_BT: jax.Array | None = None, lora_key: jax.Array | None = None,
                      grad_sums: dict[str, jax.Array] | None = None, routed_experts_BTLk: jax.Array | None = None
                      ) -> jax.Array:
        """Final-normed hidden states [B, T, D] of a full (non-cached) forward (`lora_key`: adapter dropout).

        `grad_sums`: float32 sums shaped like `blocks.arrays()` that take the layers' gradient in place of them
        (remat `full`; models/grad_sums.py). `routed_experts_BTLk` (int32 [B, T, L, k], a mixture): the experts
        every layer uses for every token (router replay), their weights from this router's logits.
        """
        return self.hidden_states_and_router(input_ids_BT, positions_BT, segment_ids_BT, lora_key, grad_sums,
                                             routed_experts_BTLk, with_stats=False)[0]

    def hidden_states_and_router(self, input_ids_BT: jax.Array, positions_BT: jax.Array | None = None,
                                 segment_ids_BT: jax.Array | None = None, lora_key: jax.Array | None = None,
                                 grad_sums: dict[str, jax.Array] | None = None,
                                 routed_experts_BTLk: jax.Array | None = None, with_stats: bool = True,
                                 counted_BT: jax.Array | None = None) -> tuple[jax.Array, RouterStats | None]:
        """`hidden_states` and, `with_stats` (a mixture only), the router's sums over the real tokens, or those of
        `counted_BT` (bool) (`models/moe.py`: its loss terms and expert loads; they take the router's gradient).

        Traced on a mesh with a context axis of C > 1 ways, every [B, T] input comes in the context layout
        (`context_parallel.to_context_layout`: the step's forwards put it there) and so do the hidden states."""
        B, T = input_ids_BT.shape
        config = self.config
        if routed_experts_BTLk is not None:
            want = (B, T, config.num_layers, config.experts_per_token)
            if not config.moe:
                raise ValueError(f"routed_experts: {config.family} has no router (a dense MLP in every layer)")
            if tuple(routed_experts_BTLk.shape) != want:
                raise ValueError(f"routed_experts: shape {tuple(routed_experts_BTLk.shape)}, expected [B, T, L, k] = "
                                 f"{list(want)}")
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if segment_ids_BT is None:
            segment_ids_BT = jnp.ones((B, T), jnp.int32)
        x_BTD, stats = _run_blocks(config, self.runtime, self.blocks.arrays(), self._embed(input_ids_BT), positions_BT,
                                   segment_ids_BT, lora_key, grad_sums, routed_experts_BTLk, with_stats, counted_BT)
        return rms_norm(x_BTD, self.final_norm[...], config.rms_norm_eps, config.traits.norm_plus_one), stats

    def unembed_DV(self) -> jax.Array:
        """Output projection [D, V] (the embedding transposed when tied)."""
        if self.config.tie_word_embeddings:
            return self.embed[...].T
        return self.lm_head[...]

    def logits_from_hidden(self, hidden_BTD: jax.Array) -> jax.Array:
        """float32 logits from final hidden states (final soft-cap applied if the model has one)."""
        logits_BTV = jnp.einsum("btd,dv->btv", hidden_BTD, self.unembed_DV(), preferred_element_type=_F32)
        cap = self.config.final_logit_softcap
        return logits_BTV if cap is None else cap * jnp.tanh(logits_BTV / cap)

    def __call__(self, input_ids_BT: jax.Array, positions_BT: jax.Array | None = None,
                 segment_ids_BT: jax.Array | None = None) -> jax.Array:
        """float32 logits [B, T, V]."""
        return self.logits_from_hidden(self.hidden_states(input_ids_BT, positions_BT, segment_ids_BT))

    def decode(self, input_ids_BT: jax.Array, positions_BT: jax.Array, cache: KVCache,
               layers: tuple[dict[str, jax.Array], ...] | None = None, rope=None) -> tuple[jax.Array, KVCache]:
        """`decode_routed` without the experts."""
        return self.decode_routed(input_ids_BT, positions_BT, cache, layers, rope)[:2]

    def decode_routed(self, input_ids_BT: jax.Array, positions_BT: jax.Array, cache: KVCache,
                      layers: tuple[dict[str, jax.Array], ...] | None = None, rope=None
                      ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        """Write T tokens into cache slots [length, length + T), attend over the cache; (logits, new cache, a
        mixture's experts [B, T, L, k] int32 or None).

        Tokens with position -1 (padding) are stored as empty slots and are never visible. The caller sizes the
        cache: XLA clamps a write past its end onto the last slots. The cache comes stacked (`init_cache`,
        returned stacked) or split per layer (`split_cache`, returned split, what a decode loop carries); either
        way the layers run unrolled over per-layer weights and slots. A decode loop hoists two things out of
        its body: `layers` (`layer_params` of the blocks; else split here) and `rope`
        (`rope_for_layers(config, positions_BT)`; else computed here: XLA fuses cos/sin into every layer's
        rope and recomputes them in each layer of each step).
        """
        T = input_ids_BT.shape[1]
        positions_BT = positions_BT.astype(jnp.int32)
        cache_positions_BS = jax.lax.dynamic_update_slice(cache.positions_BS, positions_BT, (0, cache.length))
        masks = cache_masks(self.config, positions_BT, cache_positions_BS)
        x_BTD = self._embed(input_ids_BT, inference=True)
        stacked = not isinstance(cache.k, tuple)
        layers = layer_params(self.blocks.arrays(), self.config.num_layers) if layers is None else layers
        split = split_cache(cache) if stacked else cache
        x_BTD, k, v, experts_BTLk = _run_blocks_unrolled(self.config, self.runtime, layers, x_BTD, positions_BT, masks,
                                                         split, rope)
        if stacked:
            restacked = stack_cache(dataclasses.replace(split, k=k, v=v))
            k, v = restacked.k, restacked.v
        hidden_BTD = rms_norm(x_BTD, self.final_norm[...], self.config.rms_norm_eps, self.config.traits.norm_plus_one)
        new_cache = KVCache(k=k, v=v, positions_BS=cache_positions_BS, length=cache.length + T)
        return self.logits_from_hidden(hidden_BTD), new_cache, experts_BTLk
