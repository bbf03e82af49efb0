"""What a plan is made against without a download: the target devices' memory and public model architectures.

`python -m drgrpo_jax.plan --device NAME` reads DEVICES (or an alias); `--model-config NAME` and a model.path
named like a preset read PRESETS, copied from the public Hugging Face config.json files.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from drgrpo_jax.errors import ConfigError

__all__ = ["DEVICES", "GIB", "PRESETS", "DeviceSpec", "device_spec", "preset_name"]

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: memory per chip/GPU (what JAX sees as one device)."""

    name: str
    memory_bytes: int
    source: str  # where the figure comes from


# TPU: HBM per chip from the Cloud TPU system-architecture pages; GPU: `nvidia-smi` total memory.
DEVICES: dict[str, DeviceSpec] = {d.name: d for d in [
    DeviceSpec("tpu-v4", 32 * GIB, "Cloud TPU v4: 32 GiB HBM2 per chip"),
    DeviceSpec("tpu-v5e", 16 * GIB, "Cloud TPU v5e: 16 GiB HBM2 per chip"),
    DeviceSpec("tpu-v5p", 95 * GIB, "Cloud TPU v5p: 95 GiB HBM2e per chip"),
    DeviceSpec("tpu-v6e", 32 * GIB, "Cloud TPU v6e (Trillium): 32 GiB HBM per chip"),
    DeviceSpec("a100-40gb", 40960 * 1024**2, "A100 SXM4 40GB: 40960 MiB"),
    DeviceSpec("a100-80gb", 81920 * 1024**2, "A100 SXM4 80GB: 81920 MiB"),
    DeviceSpec("h100", 81559 * 1024**2, "H100 SXM5 80GB: 81559 MiB"),
    DeviceSpec("h200", 143771 * 1024**2, "H200 SXM 141GB: 143771 MiB"),
]}
_ALIASES = {"v4": "tpu-v4", "v5e": "tpu-v5e", "v5litepod": "tpu-v5e", "v5p": "tpu-v5p", "v6e": "tpu-v6e",
            "a100": "a100-80gb", "h100-80gb": "h100"}

# Architectures from the public Hugging Face config.json files, so a plan needs no download.
PRESETS: dict[str, dict[str, Any]] = {
    "Qwen2.5-Math-1.5B": {
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
        "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu"},
    "Qwen2.5-Math-7B": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu"},
    "Qwen3-30B-A3B": {  # every layer a mixture: 128 experts, 8 per token (mlp_only_layers [], decoder_sparse_step 1)
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
        "attention_bias": False, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "GPT-OSS-20B": {  # 24 layers of 32 experts, 4 per token; sliding (128) and full attention alternate
        "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
        "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "max_position_embeddings": 131072, "rope_theta": 150000.0, "rms_norm_eps": 1e-5,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "tie_word_embeddings": False, "eos_token_id": 200002, "pad_token_id": 199999, "hidden_act": "silu",
        "attention_bias": True, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
        "swiglu_limit": 7.0, "layer_types": ["sliding_attention", "full_attention"] * 12},
}


def device_spec(name: str) -> DeviceSpec:
    """The table entry for a device name or alias; ConfigError naming --device otherwise."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in DEVICES:
        raise ConfigError("--device", f"unknown device {name!r}; known: {', '.join(DEVICES)}")
    return DEVICES[key]


def preset_name(name: str) -> str | None:
    """The preset key matching a name or path basename (case-insensitive, 'Qwen/' prefix allowed)."""
    base = os.path.basename(os.path.normpath(name)).lower()
    return next((key for key in PRESETS if key.lower() == base), None)
