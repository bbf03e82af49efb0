"""DecoderConfig is the architecture alone (what config.json says); how a model runs is its RuntimeOptions."""

import dataclasses

import pytest

from drgrpo_jax.models.config import DecoderConfig, RopeConfig, RuntimeOptions, from_hf_config, to_hf_config

_COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
               head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1, eos_token_ids=(2, 3),
               pad_token_id=0)
_WINDOWS = dict(layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=4)
_EXPERTS = dict(num_experts=4, experts_per_token=2, moe_intermediate_size=8, norm_topk_prob=True)

# Between them, every DecoderConfig field off its default.
CONFIGS = (
    DecoderConfig(family="llama", **_COMMON, qkv_bias=True, o_bias=True,
                  rope=RopeConfig(theta=500.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=16)),
    DecoderConfig(family="qwen2", **_COMMON, qkv_bias=True, tie_word_embeddings=True),
    DecoderConfig(family="gemma3", **_COMMON, **_WINDOWS, activation="gelu_pytorch_tanh", query_pre_attn_scalar=12.0,
                  final_logit_softcap=3.0, local_rope=RopeConfig(theta=100.0)),
    DecoderConfig(family="gpt_oss", **_COMMON | {"intermediate_size": 8}, **_WINDOWS, **_EXPERTS, qkv_bias=True,
                  o_bias=True, swiglu_alpha=1.5, swiglu_limit=5.0),
    DecoderConfig(family="qwen3_moe", **_COMMON, **_EXPERTS),
)


def test_every_decoder_config_field_is_the_architecture_config_json_carries():
    """A field config.json does not carry (a runtime option) would not come back from its export: none is left."""
    for config in CONFIGS:
        assert from_hf_config(to_hf_config(config)) == config, config.family
    untouched = [f.name for f in dataclasses.fields(DecoderConfig)
                 if all(getattr(config, f.name) == f.default for config in CONFIGS)]
    assert not untouched, f"no config here sets {untouched}: the round trip above proves nothing about them"


def test_runtime_options_are_apart_from_the_architecture():
    runtime = {f.name for f in dataclasses.fields(RuntimeOptions)}
    assert runtime == {"remat", "attention_impl", "lora", "compute_dtype"}
    assert not runtime & {f.name for f in dataclasses.fields(DecoderConfig)}
    with pytest.raises(ValueError, match="attention_impl: 'flash' is not supported"):
        RuntimeOptions(attention_impl="flash")
    with pytest.raises(ValueError, match="compute_dtype: 'float16' is not supported"):
        RuntimeOptions(compute_dtype="float16")
    assert RuntimeOptions(remat="full").remat == "full"
