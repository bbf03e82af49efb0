"""Model configuration: one frozen dataclass for every supported decoder family, HF config in and out."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from drgrpo_jax.errors import FieldError
from drgrpo_jax.models.families import FAMILIES, Family, family_of_model_type
from drgrpo_jax.models.hf_fields import REQUIRED, SOURCE, is_int, read_choice, read_field, read_token_ids, shown
from drgrpo_jax.models.precision import DTYPES
from drgrpo_jax.models.remat import normalise_remat

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_pytorch_tanh", "gelu")
LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")
# Self-attention of a full forward (models/attention.py): "auto" picks by backend and length.
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "reference", "blockwise", "cudnn", "splash")
# Projections a LoRA adapter may target, by their Hugging Face module names (PEFT's `target_modules`).
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base and the frequency scaling an HF config asks for."""

    theta: float = 10_000.0  # base wavelength
    rope_type: str = "default"  # "default" | "linear" | "llama3" | "yarn"
    factor: float = 1.0  # linear / llama3 / yarn scaling factor
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 and yarn
    beta_fast: float = 32.0  # yarn only: rotations bounding the extrapolated (unscaled) frequencies
    beta_slow: float = 1.0  # yarn only: rotations bounding the interpolated (scaled) frequencies
    truncate: bool = True  # yarn only: the ramp's bounds rounded to whole dimensions
    attention_factor: float | None = None  # yarn only: cos/sin multiplier; None = 0.1 ln(factor) + 1

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type: {self.rope_type!r} is not supported (supported: {ROPE_TYPES})")
        if not self.theta > 0:
            raise ValueError(f"rope theta: must be > 0, got {self.theta}")
        if not self.factor > 0:
            raise ValueError(f"rope factor: must be > 0, got {self.factor}")

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies [H/2] in float32, computed the way transformers does."""
        exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        inv = (1.0 / (np.float32(self.theta) ** exponent)).astype(np.float32)
        if self.rope_type == "linear":
            return (inv / np.float32(self.factor)).astype(np.float32)
        if self.rope_type == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return np.where(medium, smoothed, scaled).astype(np.float32)
        if self.rope_type == "yarn":
            return self._yarn_inv_freq(head_dim)
        return inv

    def _yarn_inv_freq(self, head_dim: int) -> np.ndarray:
        """YaRN (transformers' `_compute_yarn_parameters`): frequencies below the ramp interpolated by `factor`,
        above it kept, linearly blended between."""
        base, old = float(self.theta), self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return head_dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        pos_freqs = np.float32(base) ** (np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim))
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
        extrapolation = (1 - ramp).astype(np.float32)
        return (1.0 / (np.float32(self.factor) * pos_freqs) * (1 - extrapolation)
                + 1.0 / pos_freqs * extrapolation).astype(np.float32)

    @property
    def attention_scaling(self) -> float:
        """The factor on cos and sin (YaRN's mscale: it scales queries and keys alike); 1 otherwise."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def to_hf(self) -> dict[str, Any] | None:
        """The HF `rope_scaling` dict (None for plain RoPE)."""
        if self.rope_type == "default":
            return None
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            out.update(
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        if self.rope_type == "yarn":
            out.update(original_max_position_embeddings=self.original_max_position_embeddings,
                       beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate)
            if self.attention_factor is not None:
                out["attention_factor"] = self.attention_factor
        return out


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Low-rank adapters on the listed projections: y = x W + (alpha / rank) * dropout(x) A B (PEFT's LoRA)."""

    rank: int = 16  # r: inner dimension of A [X, r] and B [r, Y]
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input while training (PEFT's lora_dropout)
    targets: tuple[str, ...] = LORA_TARGETS  # which projections get an adapter

    def __post_init__(self):
        if isinstance(self.targets, list):
            object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.rank, bool) or not isinstance(self.rank, (int, np.integer)) or self.rank < 1:
            raise FieldError("LoraSpec", "rank", f"must be an int >= 1, got {self.rank!r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise FieldError("LoraSpec", "alpha", f"must be finite and > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise FieldError("LoraSpec", "dropout", f"must be in [0, 1), got {self.dropout!r}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if not self.targets or unknown or len(set(self.targets)) != len(self.targets):
            raise FieldError("LoraSpec", "targets", f"{list(self.targets)} must be one or more distinct names of "
                                                    f"{list(LORA_TARGETS)}")

    @property
    def scale(self) -> float:
        """alpha / rank, the factor on the low-rank update."""
        return float(self.alpha) / int(self.rank)


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    """How a built model runs (not what it is: that is `DecoderConfig`, the architecture config.json names);
    `Transformer.runtime` holds them and its forward reads them."""

    remat: str = "none"  # a policy of models/remat.py
    attention_impl: str = "auto"  # one of ATTENTION_IMPLS for the cache-free forward
    lora: LoraSpec | None = None  # the low-rank adapters' rank, scale and dropout (models/lora.py); None = none
    compute_dtype: str | None = None  # the GEMM operands' dtype (None: the weights' dtype)

    def __post_init__(self):
        object.__setattr__(self, "remat", normalise_remat(self.remat))
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"attention_impl: {self.attention_impl!r} is not supported (supported: {ATTENTION_IMPLS})")
        if self.compute_dtype is not None and self.compute_dtype not in DTYPES:
            raise ValueError(f"compute_dtype: {self.compute_dtype!r} is not supported (None, {' or '.join(DTYPES)})")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Architecture of a decoder-only LM (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral, GPT-OSS, Gemma 3 text)."""

    family: str = "llama"  # a name in models/families.py's FAMILIES; `traits` is its entry
    vocab_size: int = 32_000  # V
    hidden_size: int = 512  # D
    intermediate_size: int = 1_376  # I (a mixture of experts keeps it for HF's config only: every MLP is sparse)
    num_layers: int = 4  # L
    num_heads: int = 8  # Q query heads
    num_kv_heads: int = 8  # C key/value heads (grouped-query attention when C < Q)
    head_dim: int = 64  # H
    max_position_embeddings: int = 2_048  # longest position the weights were trained for
    rms_norm_eps: float = 1e-6  # epsilon inside every RMSNorm
    rope: RopeConfig = RopeConfig()  # RoPE of global (full) attention layers
    local_rope: RopeConfig | None = None  # RoPE of sliding-window layers (Gemma 3); None = same as rope
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"; () = all full
    sliding_window: int | None = None  # keys with q_pos - k_pos >= window are hidden on sliding layers
    activation: str = "silu"  # MLP gate activation (one of ACTIVATIONS)
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama/Qwen3/Gemma attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama/Qwen3/Gemma attention_bias)
    query_pre_attn_scalar: float | None = None  # attention scale = scalar**-0.5 (Gemma); None = head_dim
    final_logit_softcap: float | None = None  # tanh soft-cap of output logits (None = off)
    tie_word_embeddings: bool = False  # output projection = embedding transposed
    bos_token_id: int | None = None  # beginning-of-sequence token
    eos_token_ids: tuple[int, ...] = ()  # every token that ends a generation
    pad_token_id: int | None = None  # padding token, if the checkpoint names one
    num_experts: int = 0  # e experts per sparse MLP (models/moe.py); 0 = a dense MLP in every layer
    experts_per_token: int = 0  # k experts each token is routed to (HF num_experts_per_tok)
    moe_intermediate_size: int = 0  # f: one expert's MLP hidden
    norm_topk_prob: bool = False  # the k routing weights renormalised to sum to 1 (else raw softmax shares)
    swiglu_alpha: float = 1.702  # GPT-OSS experts: the sigmoid's gain in gate * sigmoid(alpha * gate)
    swiglu_limit: float = 7.0  # GPT-OSS experts: gate clamped above, up clamped to [-limit, limit]

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family: {self.family!r} is not supported (supported: {tuple(FAMILIES)})")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name}: must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} must divide num_heads={self.num_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: must be even for rotary embeddings, got {self.head_dim}")
        self._check_experts()
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation: {self.activation!r} is not supported (supported: {ACTIVATIONS})")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types: has {len(self.layer_types)} entries, num_layers is {self.num_layers}")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"layer_types: unknown entries {bad} (supported: {LAYER_TYPES})")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_window: sliding_attention layers need a positive sliding_window")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window: must be positive or None, got {self.sliding_window}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps: must be > 0, got {self.rms_norm_eps}")
        if isinstance(self.eos_token_ids, list):
            object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))

    def _check_experts(self) -> None:
        """A mixture of experts (Qwen3-MoE, GPT-OSS) names e >= 1 experts, 1 <= k <= e of them per token and
        their hidden size f >= 1; a dense family names none."""
        if not self.traits.sparse:
            if self.num_experts:
                raise ValueError(f"num_experts: {self.family} has a dense MLP, got {self.num_experts} experts")
            return
        for name in ("num_experts", "experts_per_token", "moe_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name}: must be a positive int for a mixture of experts, got {value!r}")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token: {self.experts_per_token} exceeds num_experts={self.num_experts}")
        if self.traits.gpt_oss_experts and not (self.swiglu_alpha > 0 and self.swiglu_limit > 0):
            raise ValueError(f"swiglu_alpha/swiglu_limit: must be > 0, got {self.swiglu_alpha}, {self.swiglu_limit}")

    @property
    def traits(self) -> Family:
        """The family's fixed traits (norms, attention, experts, HF names): models/families.py."""
        return FAMILIES[self.family]

    @property
    def moe(self) -> bool:
        """Every layer's MLP is a mixture of experts (models/moe.py) instead of one dense MLP."""
        return self.num_experts > 0

    @property
    def attn_scale(self) -> float:
        """Multiplier of q.k scores."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: does it use the sliding window."""
        types = self.layer_types or ("full_attention",) * self.num_layers
        return tuple(t == "sliding_attention" for t in types)


# ---------------------------------------------------------------- config.json in, every field checked

def _decoder_part(hf: Any) -> dict[str, Any]:
    """The decoder's fields: config.json itself, or a multimodal wrapper's text_config with the wrapper's token ids
    and tying (Gemma 3 4B+)."""
    if not isinstance(hf, dict):
        raise ValueError(f"{SOURCE}: must be a JSON object, got {type(hf).__name__}")
    if hf.get("model_type") != "gemma3" or "text_config" not in hf:
        return hf
    text = dict(read_field(hf, "text_config", "object"))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        text.setdefault(key, hf.get(key))
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
    return text


def hf_num_layers(hf: dict[str, Any]) -> int:
    """config.json's num_hidden_layers (its text_config's for a multimodal wrapper), checked as `from_hf_config`
    checks it: the loaders compare it with the layers the weights hold before anything counts them one by one."""
    return read_field(_decoder_part(hf), "num_hidden_layers", "count")


def _rope_from_hf(params: dict[str, Any] | None, theta: float, context: int = 2048,
                  original_context: int | None = None, where: str = "rope_scaling.") -> RopeConfig:
    """RopeConfig from an HF rope_scaling / rope_parameters dict (`where` its name in errors); YaRN falls back as
    transformers does on the config's `original_context` (else its `context`) and a factor of their ratio."""
    params = params or {}
    if not isinstance(params, dict):
        raise FieldError(SOURCE, where.rstrip("."), f"must be a JSON object, got {shown(params)}")
    rope_type = read_choice(params, "rope_type" if "rope_type" in params else "type", ROPE_TYPES, "default", where)
    theta = float(read_field(params, "rope_theta", "positive", theta, where))

    def number(key: str, default: Any = REQUIRED) -> Any:
        value = read_field(params, key, "positive", default, where)
        return value if value is None else float(value)

    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=number("factor"))
    if rope_type == "llama3":
        low, high = number("low_freq_factor"), number("high_freq_factor")
        if high <= low:
            raise FieldError(SOURCE, where + "high_freq_factor", f"must exceed low_freq_factor={low}, got {high}")
        return RopeConfig(
            theta=theta, rope_type="llama3", factor=number("factor"), low_freq_factor=low, high_freq_factor=high,
            original_max_position_embeddings=read_field(params, "original_max_position_embeddings", "count",
                                                   where=where))
    original = read_field(params, "original_max_position_embeddings", "count", original_context or context, where)
    factor = number("factor", context / original)
    attention_factor = number("attention_factor", None)
    mscale, mscale_all_dim = (read_field(params, key, "scale", 0.0, where) for key in ("mscale", "mscale_all_dim"))
    if attention_factor is None and mscale and mscale_all_dim:
        def scale(m: float) -> float:
            return 0.1 * float(m) * math.log(factor) + 1.0 if factor > 1 else 1.0

        attention_factor = scale(mscale) / scale(mscale_all_dim)
    return RopeConfig(
        theta=theta, rope_type="yarn", factor=factor, original_max_position_embeddings=original,
        beta_fast=number("beta_fast", 32.0), beta_slow=number("beta_slow", 1.0),
        truncate=read_field(params, "truncate", "flag", True, where), attention_factor=attention_factor)


def from_hf_config(hf: dict[str, Any], generation: dict[str, Any] | None = None) -> DecoderConfig:
    """DecoderConfig from a parsed HF config.json (and optional generation_config.json); every field it reads is
    checked (type and range, a known name), a FieldError naming the first that is not."""
    hf = _decoder_part(hf)
    traits = family_of_model_type(hf.get("model_type"))
    _check_hf_support(hf, traits)
    hidden, num_heads = read_field(hf, "hidden_size", "count"), read_field(hf, "num_attention_heads", "count")
    context = read_field(hf, "max_position_embeddings", "count", 2048)
    num_layers = read_field(hf, "num_hidden_layers", "count")
    rope, local_rope = _ropes_from_hf(hf, traits, context)
    layer_types, sliding_window = _sliding_from_hf(hf, traits, num_layers)
    experts = _experts_from_hf(hf, traits, num_layers) if traits.sparse else {}
    attention_bias = read_field(hf, "attention_bias", "flag", False)
    scalar = traits.query_pre_attn_scalar
    activation_key = "hidden_activation" if hf.get("hidden_activation") is not None else "hidden_act"
    eos = list(read_token_ids(hf, "eos_token_id"))
    for token in read_token_ids(generation or {}, "eos_token_id"):
        if token not in eos:
            eos.append(token)
    return DecoderConfig(
        family=traits.name,
        vocab_size=read_field(hf, "vocab_size", "count"),
        hidden_size=hidden,
        intermediate_size=read_field(hf, "intermediate_size", "count"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=read_field(hf, "num_key_value_heads", "count", num_heads),
        head_dim=read_field(hf, "head_dim", "count", hidden // num_heads),
        max_position_embeddings=context,
        rms_norm_eps=float(read_field(hf, "rms_norm_eps", "positive", 1e-6)),
        rope=rope,
        local_rope=local_rope,
        layer_types=layer_types,
        sliding_window=sliding_window,
        activation=read_choice(hf, activation_key, ACTIVATIONS, traits.activation),
        qkv_bias=attention_bias or traits.attention_bias == "qkv",
        o_bias=attention_bias,
        query_pre_attn_scalar=None if scalar is None else float(read_field(hf, "query_pre_attn_scalar", "positive",
                                                                      scalar)),
        # transformers' Gemma 3 never applies attn_logit_softcapping (the field is a Gemma 2 leftover), so neither
        # do we: parity with the reference is the contract.
        final_logit_softcap=read_field(hf, "final_logit_softcapping", "positive", None),
        tie_word_embeddings=read_field(hf, "tie_word_embeddings", "flag", traits.tie_word_embeddings),
        bos_token_id=read_field(hf, "bos_token_id", "id", None),
        eos_token_ids=tuple(eos),
        pad_token_id=read_field(hf, "pad_token_id", "id", None) if hf.get("pad_token_id") != -1 else None,
        **experts,
    )


def _check_hf_support(hf: dict[str, Any], traits: Family) -> None:
    """ValueError for what a config.json may ask that no family here computes."""
    if read_field(hf, "mlp_bias", "flag", False):
        raise ValueError("mlp_bias: True is not supported (no supported checkpoint uses MLP biases)")
    if read_field(hf, "use_sliding_window", "flag", False):
        raise ValueError("use_sliding_window: Qwen2-style sliding window attention is not supported")
    if read_field(hf, "use_bidirectional_attention", "flag", False):
        raise ValueError("use_bidirectional_attention: only causal decoders are supported")
    quantized = read_field(read_field(hf, "quantization_config", "object", {}), "quant_method", "text", None,
                      "quantization_config.")
    if traits.gpt_oss_experts and quantized not in (None, "mxfp4"):  # MXFP4 is dequantized as read (mxfp4.py)
        raise ValueError(f"quantization_config: {quantized} experts are not supported; use the published "
                         "MXFP4 or an unquantised (bfloat16) GPT-OSS checkpoint")
    if not traits.gpt_oss_experts and quantized is not None:
        raise ValueError(f"quantization_config: {quantized} checkpoints are not supported; load the unquantised "
                         "(float) weights")


def _ropes_from_hf(hf: dict[str, Any], traits: Family, context: int) -> tuple[RopeConfig, RopeConfig | None]:
    """The full-attention layers' RoPE and, for a family whose sliding layers have their own, theirs (else None)."""
    read = functools.partial(_rope_from_hf, context=context,
                             original_context=read_field(hf, "original_max_position_embeddings", "count", None))
    params = hf.get("rope_parameters")
    theta = float(read_field(hf, "rope_theta", "positive", traits.rope_theta))
    if not traits.local_rope:
        if params:
            return read(params, theta, where="rope_parameters."), None
        return read(hf.get("rope_scaling"), theta), None
    if isinstance(params, dict) and "full_attention" in params:
        return (read(params["full_attention"], traits.rope_theta, where="rope_parameters.full_attention."),
                read(params.get("sliding_attention"), 10_000.0, where="rope_parameters.sliding_attention."))
    local_theta = float(read_field(hf, "rope_local_base_freq", "positive", 10_000.0))
    return read(hf.get("rope_scaling"), theta), RopeConfig(theta=local_theta)


def _sliding_from_hf(hf: dict[str, Any], traits: Family, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """Per layer attention types and the window, read as the family's `sliding` trait says."""
    window = read_field(hf, "sliding_window", "count", None)
    if traits.sliding == "none":  # Qwen's configs name a window they do not use (use_sliding_window: False)
        return (), None
    if traits.sliding == "every":  # Mistral's window: every layer or none
        return ("sliding_attention",) * num_layers if window else (), window
    every = 2 if traits.sliding == "alternate" else read_field(hf, "sliding_window_pattern", "count", 6)
    listed = read_field(hf, "layer_types", "list", None)
    if listed is not None and (len(listed) != num_layers or not all(t in LAYER_TYPES for t in listed)):
        raise FieldError(SOURCE, "layer_types", f"must list one of {list(LAYER_TYPES)} for each of the "
                                                 f"num_hidden_layers={num_layers} layers, got {shown(listed)}")
    layer_types = tuple(listed or (
        "sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)))
    return layer_types, window or (4096 if traits.sliding == "pattern" else None)


def _experts_from_hf(hf: dict[str, Any], traits: Family, num_layers: int) -> dict[str, Any]:
    """DecoderConfig's expert fields from a mixture's config; ValueError when some layer keeps a dense MLP.

    Layers are stacked and scanned as one block, so a model is all-dense or all-sparse: transformers makes layer i
    sparse when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (Qwen3-30B-A3B and -235B-A22B
    are all-sparse). The dense layers are found without counting every layer (num_hidden_layers is not yet
    compared with the weights).
    """
    step = read_field(hf, "decoder_sparse_step", "count", 1)
    mlp_only = read_field(hf, "mlp_only_layers", "list", [])
    if not all(is_int(i) for i in mlp_only):
        raise FieldError(SOURCE, "mlp_only_layers", f"must be a list of layer numbers, got {shown(mlp_only)}")
    stepped = [i for i in range(min(num_layers, 8 * step)) if (i + 1) % step][:8]  # layer 0 whenever step > 1
    dense = sorted({i for i in mlp_only if 0 <= i < num_layers} | set(stepped))
    if dense:
        raise ValueError(f"mlp_only_layers/decoder_sparse_step: layers {shown(dense)} keep a dense MLP; only models "
                         f"whose every layer is a mixture of experts are supported")
    # Qwen3-MoE names the experts' size moe_intermediate_size; Mixtral's and GPT-OSS's intermediate_size is theirs.
    experts_key = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
    fields: dict[str, Any] = dict(
        num_experts=read_field(hf, experts_key, "count"),
        experts_per_token=read_field(hf, "num_experts_per_tok", "count"),
        moe_intermediate_size=(read_field(hf, "moe_intermediate_size", "count", None)
                               or read_field(hf, "intermediate_size", "count")),
        norm_topk_prob=traits.renormalise_topk or read_field(hf, "norm_topk_prob", "flag", False))
    if traits.gpt_oss_experts:
        fields.update(swiglu_alpha=float(read_field(hf, "swiglu_alpha", "positive", 1.702)),
                      swiglu_limit=float(read_field(hf, "swiglu_limit", "positive", 7.0)))
    return fields


def _int_if_whole(value: float) -> int | float:
    """transformers' strict configs want ints where the value is whole (query_pre_attn_scalar)."""
    return int(value) if float(value).is_integer() else value


def to_hf_config(config: DecoderConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    """HF config.json contents that transformers reads back as the same architecture."""
    _check_hf_export(config)
    eos = list(config.eos_token_ids)
    out: dict[str, Any] = {
        "architectures": [config.traits.hf_architecture],
        "model_type": config.traits.hf_model_types[0],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope.theta,
        "rope_scaling": config.rope.to_hf(),
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": config.pad_token_id,
        "attention_bias": config.o_bias,
        "mlp_bias": False,
        "hidden_act": config.activation,
        "torch_dtype": torch_dtype,
        "use_cache": True,
    }
    dialect = _HF_DIALECTS.get(config.family)
    return dialect(config, out) if dialect else out


def _check_hf_export(config: DecoderConfig) -> None:
    """ValueError for a config whose family's HF config cannot say it (biases, renormalisation)."""
    bias, family = config.traits.attention_bias, config.family
    if bias == "qkv" and (not config.qkv_bias or config.o_bias):
        raise ValueError(f"qkv_bias/o_bias: {family} always has q/k/v biases and no output bias")
    if bias == "none" and (config.qkv_bias or config.o_bias):
        raise ValueError(f"qkv_bias/o_bias: {family} has no attention biases")
    if bias == "flag" and config.qkv_bias != config.o_bias:
        raise ValueError(f"qkv_bias/o_bias: {family} has one attention_bias flag; they must be equal")
    if config.traits.renormalise_topk and not config.norm_topk_prob:
        raise ValueError(f"norm_topk_prob: {family} always renormalises its top-k routing weights")


def _without(out: dict[str, Any], *keys: str) -> dict[str, Any]:
    """`out` less the keys a family's config.json does not have."""
    return {key: value for key, value in out.items() if key not in keys}


def _all_layer_types(config: DecoderConfig) -> list[str]:
    """Every layer's attention type, as config.json's layer_types lists them."""
    return list(config.layer_types or ("full_attention",) * config.num_layers)


def _gemma3_hf(config: DecoderConfig, out: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's keys: hidden_activation, its sliding layers' RoPE base, window and soft-caps."""
    return _without(out, "hidden_act") | dict(
        hidden_activation=config.activation,
        rope_local_base_freq=(config.local_rope or config.rope).theta,
        layer_types=_all_layer_types(config),
        sliding_window=config.sliding_window,
        query_pre_attn_scalar=_int_if_whole(config.query_pre_attn_scalar or config.head_dim),
        attn_logit_softcapping=None,
        final_logit_softcapping=config.final_logit_softcap,
    )


def _gpt_oss_hf(config: DecoderConfig, out: dict[str, Any]) -> dict[str, Any]:
    """GPT-OSS's keys: rope_parameters, the experts (intermediate_size is theirs), the clamped SwiGLU, windows."""
    rope = {"rope_theta": config.rope.theta, "rope_type": config.rope.rope_type, **(config.rope.to_hf() or {})}
    return _without(out, "rope_theta", "rope_scaling", "mlp_bias") | dict(
        num_local_experts=config.num_experts, num_experts_per_tok=config.experts_per_token,
        swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit, rope_parameters=rope,
        layer_types=_all_layer_types(config), sliding_window=config.sliding_window,
        intermediate_size=config.moe_intermediate_size)


def _mixtral_hf(config: DecoderConfig, out: dict[str, Any]) -> dict[str, Any]:
    """Mixtral's keys: the experts (intermediate_size is theirs), and a window on every layer or none."""
    sliding = config.sliding_layers
    if any(sliding) and not all(sliding):
        raise ValueError("layer_types: Mixtral slides its window on every layer or none")
    return _without(out, "attention_bias", "mlp_bias") | dict(
        num_local_experts=config.num_experts, num_experts_per_tok=config.experts_per_token,
        intermediate_size=config.moe_intermediate_size, sliding_window=config.sliding_window if all(sliding) else None)


def _qwen3_moe_hf(config: DecoderConfig, out: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's keys: the experts, every layer sparse, no window."""
    return out | dict(num_experts=config.num_experts, num_experts_per_tok=config.experts_per_token,
                      moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
                      decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, sliding_window=None)


def _qwen2_hf(config: DecoderConfig, out: dict[str, Any]) -> dict[str, Any]:
    """Qwen2's keys: no attention_bias flag (q/k/v biases always) and no window."""
    return _without(out, "attention_bias") | dict(use_sliding_window=False, sliding_window=None,
                                                  max_window_layers=config.num_layers)


# A family's config.json keys beyond the common ones (its HF names, as models/hf_io.py holds its tensors').
_HF_DIALECTS = {"gemma3": _gemma3_hf, "gpt_oss": _gpt_oss_hf, "mixtral": _mixtral_hf, "qwen3_moe": _qwen3_moe_hf,
                "qwen2": _qwen2_hf}
