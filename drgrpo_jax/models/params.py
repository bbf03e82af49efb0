"""The decoder's parameters: every array's shape, logical axes and initial value, and the stacked `Blocks`.

Shape letters as in transformer.py (docs/shape_letters.md). Layers are stacked along a leading L axis, so a
full forward scans one compiled block; `param_specs` is what sharding, LoRA and the plan read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from drgrpo_jax.models.config import DecoderConfig

_F32 = jnp.float32


def _param_specs(config: DecoderConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...], str]]:
    """Per stacked layer parameter: (shape, logical axes, init kind)."""
    L, D, I = config.num_layers, config.hidden_size, config.intermediate_size
    Q, C, H = config.num_heads, config.num_kv_heads, config.head_dim
    norm = "zeros" if config.traits.norm_plus_one else "ones"
    specs: dict[str, tuple[tuple[int, ...], tuple[str | None, ...], str]] = {
        "attn_norm": ((L, D), ("layers", "embed"), norm),
        "q_proj": ((L, D, Q, H), ("layers", "embed", "q_heads", "head_dim"), "normal"),
        "k_proj": ((L, D, C, H), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "v_proj": ((L, D, C, H), ("layers", "embed", "kv_heads", "head_dim"), "normal"),
        "o_proj": ((L, Q, H, D), ("layers", "q_heads", "head_dim", "embed"), "normal"),
        "mlp_norm": ((L, D), ("layers", "embed"), norm),
    }
    specs.update(_expert_specs(config) if config.moe else {
        "gate_proj": ((L, D, I), ("layers", "embed", "mlp"), "normal"),
        "up_proj": ((L, D, I), ("layers", "embed", "mlp"), "normal"),
        "down_proj": ((L, I, D), ("layers", "mlp", "embed"), "normal"),
    })
    if config.qkv_bias:
        specs["q_bias"] = ((L, Q, H), ("layers", "q_heads", "head_dim"), "zeros")
        specs["k_bias"] = ((L, C, H), ("layers", "kv_heads", "head_dim"), "zeros")
        specs["v_bias"] = ((L, C, H), ("layers", "kv_heads", "head_dim"), "zeros")
    if config.o_bias:
        specs["o_bias"] = ((L, D), ("layers", "embed"), "zeros")
    if config.traits.attention_sinks:
        specs["sinks"] = ((L, Q), ("layers", "q_heads"), "normal")
    if config.traits.qk_norm:
        specs["q_norm"] = ((L, H), ("layers", "head_dim"), norm)
        specs["k_norm"] = ((L, H), ("layers", "head_dim"), norm)
    if config.traits.sandwich_norms:
        specs["post_attn_norm"] = ((L, D), ("layers", "embed"), norm)
        specs["post_mlp_norm"] = ((L, D), ("layers", "embed"), norm)
    return specs


def _expert_specs(config: DecoderConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...], str]]:
    """A sparse MLP's router and its e experts' stacked weights (models/moe.py), with GPT-OSS's biases.

    The expert axis shards like `embed` does elsewhere (ShardingRules.expert), so an expert's own model dim stays
    whole (None): one logical axis per mesh axis.
    """
    L, D, e, f = config.num_layers, config.hidden_size, config.num_experts, config.moe_intermediate_size
    specs: dict[str, tuple[tuple[int, ...], tuple[str | None, ...], str]] = {
        "router": ((L, D, e), ("layers", "embed", None), "normal"),
        "expert_gate": ((L, e, D, f), ("layers", "expert", None, "mlp"), "normal"),
        "expert_up": ((L, e, D, f), ("layers", "expert", None, "mlp"), "normal"),
        "expert_down": ((L, e, f, D), ("layers", "expert", "mlp", None), "normal"),
    }
    if config.traits.gpt_oss_experts:
        specs.update({
            "router_bias": ((L, e), ("layers", None), "zeros"),
            "expert_gate_bias": ((L, e, f), ("layers", "expert", "mlp"), "zeros"),
            "expert_up_bias": ((L, e, f), ("layers", "expert", "mlp"), "zeros"),
            "expert_down_bias": ((L, e, D), ("layers", "expert", None), "zeros"),
        })
    return specs


def param_specs(config: DecoderConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """Every parameter's (shape, logical axes), keyed by its path ("embed", "blocks/q_proj", ...)."""
    out: dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]] = {
        "embed": ((config.vocab_size, config.hidden_size), ("vocab", "embed")),
        "final_norm": ((config.hidden_size,), ("embed",)),
    }
    if not config.tie_word_embeddings:
        out["lm_head"] = ((config.hidden_size, config.vocab_size), ("embed", "vocab"))
    for name, (shape, axes, _) in _param_specs(config).items():
        out[f"blocks/{name}"] = (shape, axes)
    return out


def init_value(kind: str, key: jax.Array | None, shape: tuple[int, ...], dtype) -> jax.Array:
    """Random or constant initial value."""
    if kind == "normal":
        if key is None:
            raise ValueError("a 'normal' initial value needs a random key")
        return (0.02 * jax.random.normal(key, shape, _F32)).astype(dtype)
    return (jnp.ones if kind == "ones" else jnp.zeros)(shape, dtype)


class Blocks(nnx.Module):
    """All decoder layers' parameters, stacked along a leading layer axis."""

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        for name, (shape, axes, kind) in _param_specs(config).items():
            setattr(self, name, nnx.Param(init_value(kind, rngs.params(), shape, dtype), logical_axes=axes))

    def arrays(self) -> dict[str, jax.Array]:
        """The stacked parameter arrays by name."""
        return {name: value[...] for name, value in vars(self).items() if isinstance(value, nnx.Param)}
