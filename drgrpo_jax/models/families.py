"""Decoder families as typed definitions: one `Family` entry per family holds every trait its name decides.

Code asks `config.traits.<trait>` (models/config.py), never compares family names. Adding a family is one entry
in `FAMILIES` plus its HF names: its tensors in models/hf_io.py and, where its config.json has keys of its own,
its dialect in models/config.py's `_HF_DIALECTS`.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Literal

# The MLP: "dense" one MLP per layer; "glu" a mixture whose router takes the top k of a softmax and whose experts
# are activation(gate) * up (Qwen3-MoE, Mixtral); "gpt_oss" a biased router whose top k logits are softmaxed, and
# biased experts with a clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`) in place of the activation.
Experts = Literal["dense", "glu", "gpt_oss"]
# HF's attention biases: "flag" one attention_bias flag for q/k/v/o alike; "qkv" q/k/v always and o never (Qwen2);
# "none" never (Mixtral).
AttentionBias = Literal["flag", "qkv", "none"]
# Which layers slide their window, read from config.json: "none" never; "every" every layer when it names a window
# (Mistral's); "alternate" its layer_types, else every other layer from the first (GPT-OSS); "pattern" its
# layer_types, else all but every sliding_window_pattern-th (Gemma 3).
Sliding = Literal["none", "every", "alternate", "pattern"]


@dataclasses.dataclass(frozen=True)
class Family:
    """What one decoder family's name decides: its HF names and the traits no config may combine otherwise."""

    name: str  # DecoderConfig.family, as checkpoints and the plan name it
    hf_architecture: str  # the transformers class config.json's `architectures` names
    hf_model_types: tuple[str, ...]  # config.json model_types read as this family; the first one is written
    gguf_architecture: str | None = None  # GGUF general.architecture read as this family; None: not from GGUF
    experts: Experts = "dense"  # the MLP of every layer (models/moe.py for a mixture)
    renormalise_topk: bool = False  # a mixture's k routing weights always sum to 1 (config.json has no flag for it)
    attention_bias: AttentionBias = "flag"  # which attention projections may carry biases
    qk_norm: bool = False  # RMSNorm on each query/key head before RoPE
    attention_sinks: bool = False  # a learned logit per query head joins each softmax's denominator, takes no value
    norm_plus_one: bool = False  # RMSNorm weight stored as w, applied as (1 + w), its product in float32 (Gemma)
    sandwich_norms: bool = False  # an extra RMSNorm after attention and after the MLP (Gemma 3)
    scale_embeddings: bool = False  # embeddings multiplied by sqrt(hidden_size) (Gemma)
    sliding: Sliding = "none"  # which layers slide their attention window
    local_rope: bool = False  # sliding layers rotate with a RoPE base of their own (Gemma 3)
    rope_theta: float = 10_000.0  # the RoPE base when config.json names none
    activation: str = "silu"  # the MLP gate's nonlinearity when config.json names none
    tie_word_embeddings: bool = False  # the output projection is the embedding, unless config.json says
    query_pre_attn_scalar: float | None = None  # attention scale scalar**-0.5, unless config.json says; None: H**-0.5

    @property
    def sparse(self) -> bool:
        """Every layer's MLP is a mixture of experts."""
        return self.experts != "dense"

    @property
    def gpt_oss_experts(self) -> bool:
        """GPT-OSS's mixture: a biased router, top-k-first softmax, biased experts with a clamped SwiGLU."""
        return self.experts == "gpt_oss"


# Read-only, as algorithms.py's ALGORITHMS: a family is added here, never registered from elsewhere.
FAMILIES: types.MappingProxyType[str, Family] = types.MappingProxyType({family.name: family for family in (
    Family("llama", "LlamaForCausalLM", ("llama",), gguf_architecture="llama"),
    Family("qwen2", "Qwen2ForCausalLM", ("qwen2",), gguf_architecture="qwen2", attention_bias="qkv"),
    Family("qwen3", "Qwen3ForCausalLM", ("qwen3",), gguf_architecture="qwen3", qk_norm=True),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", ("qwen3_moe",), experts="glu", qk_norm=True),
    Family("mixtral", "MixtralForCausalLM", ("mixtral",), experts="glu", renormalise_topk=True,
           attention_bias="none", sliding="every", rope_theta=1_000_000.0),
    Family("gpt_oss", "GptOssForCausalLM", ("gpt_oss",), experts="gpt_oss", renormalise_topk=True,
           attention_sinks=True, sliding="alternate", rope_theta=150_000.0),
    # The multimodal wrapper (model_type gemma3) is read through its text_config.
    Family("gemma3", "Gemma3ForCausalLM", ("gemma3_text", "gemma3"), gguf_architecture="gemma3", qk_norm=True,
           norm_plus_one=True, sandwich_norms=True, scale_embeddings=True, sliding="pattern", local_rope=True,
           rope_theta=1_000_000.0, activation="gelu_pytorch_tanh", tie_word_embeddings=True,
           query_pre_attn_scalar=256.0),
)})


def family_of_model_type(model_type: str | None) -> Family:
    """The family config.json's model_type names; ValueError for one no family reads."""
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    supported = sorted(t for family in FAMILIES.values() for t in family.hf_model_types)
    raise ValueError(f"model_type: {model_type!r} is not supported (supported: {supported})")
