"""GGUF files in: metadata to DecoderConfig, tensors dequantised (gguf package) into HF layout, then the HF path."""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from drgrpo_jax.models.config import RuntimeOptions, from_hf_config, hf_num_layers
from drgrpo_jax.models.families import FAMILIES, Family
from drgrpo_jax.models.hf_io import build_model, check_layer_count, check_weights, hf_param_reader
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.sharding import ShardingRules

# GGUF general.architecture -> the family it names.
_ARCHITECTURES = {family.gguf_architecture: family for family in FAMILIES.values() if family.gguf_architecture}
# Architectures whose q/k rows llama.cpp's converter interleaves per head (its Llama layout, not Qwen's or Gemma's).
_PERMUTED_QK = ("llama",)
# GGUF per-block tensor name -> HF per-layer name; ffn_norm is the pre-MLP norm in every family.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_BLOCK_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_METADATA = "the GGUF metadata"  # where a GGUF model's config comes from, as its load errors name it


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value (str, number or list), or default when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _required(reader: gguf.GGUFReader, key: str) -> Any:
    """One metadata value the model cannot be built without; ValueError naming it when absent."""
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"{key}: missing from the GGUF file's metadata")
    return value


def _hf_name(gguf_name: str, family: Family) -> str | None:
    """HF tensor name of a GGUF tensor (None for tensors we do not use)."""
    top, _, kind = gguf_name.rpartition(".")
    if top in _TOP_NAMES:
        return f"{_TOP_NAMES[top]}.{kind}"
    match = _BLOCK_RE.match(gguf_name)
    if not match:
        return None
    layer, name, kind = match.groups()
    names = {**_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"}
    if family.sandwich_norms:
        names.update(_GEMMA_BLOCK_NAMES)
    return f"model.layers.{layer}.{names[name]}.{kind}" if name in names else None


def _family(arch: str) -> Family:
    """The family a GGUF general.architecture names; ValueError for one no family reads."""
    if arch not in _ARCHITECTURES:
        raise ValueError(f"general.architecture: {arch!r} is not supported (supported: {sorted(_ARCHITECTURES)})")
    return _ARCHITECTURES[arch]


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleaving (it stores each head's rotary halves interleaved)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_hf_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """An HF config.json dict describing the model in a GGUF file (as transformers derives it)."""
    arch = _field(reader, "general.architecture")
    family = _family(arch)
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("rope_freqs: GGUF files with per-frequency RoPE factors (Llama 3.1+) are not supported; "
                         "load the Hugging Face folder instead")
    if _field(reader, f"{arch}.rope.scaling.type", "none") not in ("none", None):
        raise ValueError(f"{arch}.rope.scaling.type: RoPE scaling in GGUF metadata is not supported")
    hidden = int(_required(reader, f"{arch}.embedding_length"))
    heads = int(_required(reader, f"{arch}.attention.head_count"))
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ValueError("weights: tensor 'token_embd.weight' is missing from the GGUF file")
    hf: dict[str, Any] = {
        "model_type": family.hf_model_types[0],
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", int(embed.shape[-1]))),
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_required(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // max(heads, 1))),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10_000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "attention_bias": family.attention_bias == "flag" and "blk.0.attn_q.bias" in names,
    }
    if _field(reader, f"{arch}.attention.sliding_window"):
        hf["sliding_window"] = int(_field(reader, f"{arch}.attention.sliding_window"))
    if family.query_pre_attn_scalar is not None:  # GGUF stores none: llama.cpp scales by head_dim**-0.5
        hf["query_pre_attn_scalar"] = hf["head_dim"]
    return hf


class GGUFIndex:
    """HF tensor name -> dequantised float32 tensor in HF layout, read on demand."""

    def __init__(self, reader: gguf.GGUFReader, num_heads: int, num_kv_heads: int):
        self._arch = _field(reader, "general.architecture")
        self._family = _family(self._arch)
        self._heads = {"self_attn.q_proj": num_heads, "self_attn.k_proj": num_kv_heads}
        self._tensors = {}
        for tensor in reader.tensors:
            name = _hf_name(tensor.name, self._family)
            if name is not None:
                self._tensors[name] = tensor

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> Iterable[str]:
        return self._tensors.keys()

    def header(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape in HF layout, "F32"): `get` dequantizes every GGML type the gguf package reads to float32."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape)), "F32"

    def get(self, name: str) -> np.ndarray:
        """Dequantised tensor; q/k rows un-permuted for Llama; Gemma's stored (1 + w) norms back to w."""
        if name not in self._tensors:
            raise KeyError(f"weights: tensor {name!r} is missing from the GGUF file")
        tensor = self._tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        module = name.rsplit(".", 1)[0].split(".", 3)[-1]
        if self._arch in _PERMUTED_QK and module in self._heads:
            w = _unpermute_rows(w, self._heads[module])
        if self._family.norm_plus_one and "norm" in name.rsplit(".", 2)[-2]:
            w = w - 1.0
        return w


def _open(path: str) -> gguf.GGUFReader:
    """The file's reader; ValueError naming the file when it is not a GGUF file (the gguf package names none)."""
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, struct.error) as error:  # a bad magic, or a header cut short
        why = " ".join(str(error).split()) or type(error).__name__
        raise ValueError(f"{path} is not a GGUF file ({why})") from None


def load_gguf(path: str, *, dtype=jnp.float32, mesh: Mesh | None = None, rules: ShardingRules = ShardingRules(),
              runtime: RuntimeOptions | None = None) -> Transformer:
    """A Transformer from a GGUF file (any quantisation the gguf package can dequantise); its metadata is checked
    against its tensors' shapes (`hf_io.check_weights`) before any is dequantised."""
    reader = _open(path)
    hf = gguf_hf_config(reader)
    index = GGUFIndex(reader, hf["num_attention_heads"], hf["num_key_value_heads"])
    check_layer_count(index, hf_num_layers(hf), _METADATA)  # as load_hf: the block count against the blocks first
    config = from_hf_config(hf)
    check_weights(index, config, _METADATA)
    return build_model(config, hf_param_reader(index, config), dtype=dtype, mesh=mesh, rules=rules, runtime=runtime)


def load_gguf_tokenizer(path: str) -> Any:
    """The HF fast tokenizer (with chat template) a GGUF file describes, read without torch.

    transformers' `gguf_file=` path reads the metadata through a module that imports torch; the
    trainer must not need torch, so the metadata comes from the `gguf` package and only the
    conversion is transformers'.
    """
    # train extra: the core library imports without transformers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    reader = _open(path)
    metadata = {key: field.contents() for key, field in reader.fields.items()
                if key.startswith("tokenizer.") or key == "general.architecture"}
    grouped = {group: {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in mapping.GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece files
    for name, key in mapping._SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = mapping.convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)
