"""Decoder LMs (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral, GPT-OSS, Gemma 3 text) in Flax NNX, with HF safetensors
and GGUF weights in."""

from drgrpo_jax.models.config import DecoderConfig, RopeConfig, from_hf_config, to_hf_config
from drgrpo_jax.models.hf_io import save_pretrained
from drgrpo_jax.models.kv_cache import KVCache, cache_shardings, init_cache
from drgrpo_jax.models.params import param_specs
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.models.transformer import Transformer

__all__ = [
    "KVCache",
    "DecoderConfig",
    "RopeConfig",
    "Transformer",
    "cache_shardings",
    "from_hf_config",
    "from_pretrained",
    "init_cache",
    "param_specs",
    "save_pretrained",
    "to_hf_config",
]
