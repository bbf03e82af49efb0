"""An HF folder, a .gguf file or a Hub id in: the model as a Transformer (placed on a mesh when given) and its
tokenizer. A Hub id `org/name[@revision]` reads its snapshot in the HF cache (drgrpo_jax/hub_ids.py)."""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from drgrpo_jax.errors import ConfigError
from drgrpo_jax.hub_ids import TOKENIZER_FILES, local_model
from drgrpo_jax.models.gguf_io import load_gguf, load_gguf_tokenizer
from drgrpo_jax.models.hf_io import load_hf
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.sharding import ShardingRules

__all__ = ["from_pretrained", "load_tokenizer"]


def from_pretrained(path: str, *, dtype=jnp.float32, mesh: Mesh | None = None,
                    rules: ShardingRules = ShardingRules(), remat: str = "none",
                    attention_impl: str = "auto") -> Transformer:
    """Load an HF folder (config.json + safetensors), a Hub id of one or a .gguf file as a Transformer.

    `remat` (a policy of models/remat.py) and `attention_impl` are runtime options of its
    DecoderConfig (the training forward's memory).
    """
    path = local_model(os.fspath(path), "model.path")
    if path.endswith(".gguf"):
        return load_gguf(path, dtype=dtype, mesh=mesh, rules=rules, remat=remat, attention_impl=attention_impl)
    return load_hf(path, dtype=dtype, mesh=mesh, rules=rules, remat=remat, attention_impl=attention_impl)


def load_tokenizer(model_path: str, tokenizer_path: str | None) -> Any:
    """The HF tokenizer of an HF folder, of a .gguf file (read without torch), or of tokenizer_path; either may be
    a Hub id."""
    from transformers import AutoTokenizer  # train extra: the core library imports without transformers

    key = "model.tokenizer_path" if tokenizer_path else "model.path"
    if tokenizer_path:
        tokenizer_path = local_model(tokenizer_path, key, TOKENIZER_FILES)
    else:
        model_path = local_model(model_path, key, TOKENIZER_FILES)
    try:
        if tokenizer_path:
            return AutoTokenizer.from_pretrained(tokenizer_path)
        if model_path.endswith(".gguf"):
            return load_gguf_tokenizer(model_path)
        return AutoTokenizer.from_pretrained(model_path)
    except Exception as error:  # OSError, ValueError, missing files: the message names the key
        raise ConfigError(key, f"cannot load a tokenizer: {type(error).__name__}: {error}") from None
