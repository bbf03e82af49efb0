"""Mixed precision: which dtype the model's GEMMs run in, apart from the dtype its parameters are kept in.

`compute_dtype="bfloat16"` with float32 parameters is the usual recipe: every GEMM rounds its operands to bfloat16
and accumulates in float32 (models/gemm.py; XLA's CPU bfloat16 GEMM is only fast with a float32 accumulator), and
the residual stream, norms, softmax, log-probs, loss, gradients and optimizer state stay float32; LoRA's float32
adapters compute the same way, the frozen base cast once (`matmul_weights_in`). "auto" picks bfloat16 where the
hardware multiplies it natively (`native_bfloat16`: TPUs, NVIDIA from Ampere on, x86 CPUs with AMX-BF16 or
AVX512-BF16), float32 elsewhere; `model.compute_dtype=float32` or `bfloat16` overrides it anywhere.
"""

from __future__ import annotations

import functools
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from flax import nnx

from drgrpo_jax.models.quant import SCALE_SUFFIX

# The floating dtypes a run names (model.dtype, model.compute_dtype, the service's --dtype) and what each is:
# the one table the config, the step, the service and the plan read (itemsize: DTYPES[name].itemsize).
DtypeName = Literal["float32", "bfloat16"]
DTYPES: dict[str, jnp.dtype] = {name: jnp.dtype(name) for name in get_args(DtypeName)}
_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of x86 bfloat16 dot-product instructions


# Names of the decoder's GEMM operands: projection weights, int8 weights' scales (bfloat16-exact, models/quant.py:
# the dequantised weight comes out in their dtype) and LoRA adapters (models/lora.py).
_MATMUL_SUFFIXES = ("_proj", "_proj" + SCALE_SUFFIX, "_lora_a", "_lora_b")


def matmul_weights_in(params: nnx.State, dtype: jnp.dtype) -> nnx.State:
    """The decoder layers' GEMM operands (`_MATMUL_SUFFIXES`) cast to `dtype`; int8 values, norms, biases and
    the embedding as they are.

    The train step casts a frozen LoRA base with it, once for every layer and micro-batch (already stored in
    `dtype`, model.lora.base_dtype, the cast is nothing). Trainable weights are not cast up front: a stacked
    bfloat16 copy would round their gradients to bfloat16 too; each layer's GEMMs cast them instead.
    """

    def one(path, x):
        names = (getattr(key, "key", getattr(key, "name", None)) for key in path)
        is_operand = any(isinstance(name, str) and name.endswith(_MATMUL_SUFFIXES) for name in names)
        return x.astype(dtype) if is_operand and jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree_util.tree_map_with_path(one, params)


@functools.cache
def _cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is missing, e.g. macOS)."""
    try:
        with open(cpuinfo) as f:
            return frozenset(word for line in f if line.startswith("flags") for word in line.split(":", 1)[1].split())
    except OSError:
        return frozenset()


def native_bfloat16(device: jax.Device, cpu_flags: frozenset[str] | None = None) -> bool:
    """Whether `device` multiplies bfloat16 natively (and so faster than float32)."""
    if device.platform == "tpu":
        return True
    if device.platform == "gpu":
        capability = getattr(device, "compute_capability", "0")
        return float(capability) >= 8.0  # Ampere's bfloat16 tensor cores
    if device.platform == "cpu":
        return any(flag in (_cpu_flags() if cpu_flags is None else cpu_flags) for flag in _CPU_BF16_FLAGS)
    return False


def resolve_compute_dtype(setting: str, param_dtype: str, device: jax.Device,
                          cpu_flags: frozenset[str] | None = None) -> DtypeName:
    """`setting` ("auto", "float32", "bfloat16") made concrete for `device` and parameters of `param_dtype`.

    bfloat16 parameters always compute in bfloat16 (there is nothing to cast); "auto" is bfloat16 where
    `native_bfloat16(device)`, float32 elsewhere.
    """
    if param_dtype == "bfloat16":
        return "bfloat16"
    if setting == "auto":
        return "bfloat16" if native_bfloat16(device, cpu_flags) else "float32"
    if setting not in DTYPES:
        raise ValueError(f"compute_dtype: unknown {setting!r}; choose auto, {' or '.join(DTYPES)}")
    return setting  # type: ignore[return-value]  # checked just above
