"""An HF folder, a .gguf file or a Hub id in: the model as a Transformer (placed on a mesh when given) and its
tokenizer. A Hub id `org/name[@revision]` reads its snapshot in the HF cache (drgrpo_jax/hub_ids.py)."""

from __future__ import annotations

import copy
import os
import threading
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from drgrpo_jax.errors import ConfigError
from drgrpo_jax.hub_ids import TOKENIZER_FILES, local_model
from drgrpo_jax.models.config import RuntimeOptions
from drgrpo_jax.models.gguf_io import load_gguf, load_gguf_tokenizer
from drgrpo_jax.models.hf_io import load_hf
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.sharding import ShardingRules

__all__ = ["PerThreadTokenizer", "from_pretrained", "load_tokenizer"]


def from_pretrained(path: str, *, dtype=jnp.float32, mesh: Mesh | None = None,
                    rules: ShardingRules = ShardingRules(), remat: str = "none",
                    attention_impl: str = "auto") -> Transformer:
    """Load an HF folder (config.json + safetensors), a Hub id of one or a .gguf file as a Transformer.

    `remat` (a policy of models/remat.py) and `attention_impl` are its `RuntimeOptions` (the training forward's
    memory), not part of its DecoderConfig.
    """
    path = local_model(os.fspath(path), "model.path")
    runtime = RuntimeOptions(remat=remat, attention_impl=attention_impl)
    load = load_gguf if path.endswith(".gguf") else load_hf
    return load(path, dtype=dtype, mesh=mesh, rules=rules, runtime=runtime)


class PerThreadTokenizer:
    """A tokenizer each thread calls through its own copy, made on the thread's first use; otherwise the loaded
    tokenizer itself (its attributes and methods, `save_pretrained` included).

    A HF fast tokenizer keeps its truncation and padding settings on the object each call goes through, so two
    threads sharing one encode with each other's settings, or raise "Already borrowed" (tokenizers < 0.23.1,
    huggingface/tokenizers#537). The trainer encodes prompts while its sampling thread decodes, and the service
    tokenizes on `asyncio.to_thread`'s threads."""

    def __init__(self, tokenizer: Any):
        object.__setattr__(self, "_loaded", tokenizer)  # only ever copied: no call changes its settings
        object.__setattr__(self, "_copies", threading.local())

    def _own(self) -> Any:
        """This thread's copy of the loaded tokenizer."""
        copies = self._copies
        if not hasattr(copies, "tokenizer"):
            copies.tokenizer = copy.deepcopy(self._loaded)
        return copies.tokenizer

    def __getattr__(self, name: str) -> Any:  # called only for names the wrapper lacks: the tokenizer's
        return getattr(self._own(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        """Sets it on the loaded tokenizer; every thread copies the changed one at its next use."""
        setattr(self._loaded, name, value)
        object.__setattr__(self, "_copies", threading.local())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._own()(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._own())

    def __reduce__(self) -> tuple:  # a threading.local does not pickle: the loaded tokenizer does
        return PerThreadTokenizer, (self._loaded,)

    def __repr__(self) -> str:
        return f"PerThreadTokenizer({self._loaded!r})"


def load_tokenizer(model_path: str, tokenizer_path: str | None) -> PerThreadTokenizer:
    """The HF tokenizer of an HF folder, of a .gguf file (read without torch), or of tokenizer_path (either may be
    a Hub id), safe to share across threads."""
    from transformers import AutoTokenizer  # train extra: the core library imports without transformers

    key = "model.tokenizer_path" if tokenizer_path else "model.path"
    if tokenizer_path:
        tokenizer_path = local_model(tokenizer_path, key, TOKENIZER_FILES)
    else:
        model_path = local_model(model_path, key, TOKENIZER_FILES)
    try:
        if tokenizer_path:
            return PerThreadTokenizer(AutoTokenizer.from_pretrained(tokenizer_path))
        if model_path.endswith(".gguf"):
            return PerThreadTokenizer(load_gguf_tokenizer(model_path))
        return PerThreadTokenizer(AutoTokenizer.from_pretrained(model_path))
    except Exception as error:  # OSError, ValueError, missing files: the message names the key
        raise ConfigError(key, f"cannot load a tokenizer: {type(error).__name__}: {error}") from None
