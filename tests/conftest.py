"""Test setup: 8 fake CPU devices, no hub access, float32 matmuls at full precision."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402  (must come after XLA_FLAGS)

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_numpy_rank_promotion", "raise")
