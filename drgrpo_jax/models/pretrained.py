"""`from_pretrained`: an HF folder or a .gguf file in, as a Transformer (placed on a mesh when one is given)."""

from __future__ import annotations

import os

import jax.numpy as jnp
from jax.sharding import Mesh

from drgrpo_jax.models.hf_io import load_hf
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.sharding import ShardingRules


def from_pretrained(path: str, *, dtype=jnp.float32, mesh: Mesh | None = None,
                    rules: ShardingRules = ShardingRules(), remat: bool | str = False,
                    attention_impl: str = "auto") -> Transformer:
    """Load an HF folder (config.json + safetensors) or a .gguf file as a Transformer.

    `remat` (a policy of models/remat.py, or true/false) and `attention_impl` are runtime options of its
    DecoderConfig (the training forward's memory).
    """
    path = os.fspath(path)
    if path.endswith(".gguf"):
        from drgrpo_jax.models.gguf_io import load_gguf  # the gguf package is only imported for GGUF files

        return load_gguf(path, dtype=dtype, mesh=mesh, rules=rules, remat=remat, attention_impl=attention_impl)
    return load_hf(path, dtype=dtype, mesh=mesh, rules=rules, remat=remat, attention_impl=attention_impl)
