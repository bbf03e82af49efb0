"""What XLA compiled: the dot types of an optimised program's text (tests/step/, tests/models/)."""

from __future__ import annotations

import re


def compiled_dots(compiled_text: str, shapes: bool = False) -> list[tuple[str, str, str]]:
    """(result, lhs, rhs) types of every dot, fused ones included, in an optimised (compiled) XLA program's text:
    element types (`f32`), or with `shapes` element types and dimensions (`f32[4,8]`).

    The compiled program's dot types are this CPU's: XLA upcasts a bf16 dot to float32 where the CPU has no
    bf16 dot instructions, so a test asserting bf16 dots skips there (the caller's numerics still ran).
    """
    import jax
    import pytest

    from drgrpo_jax.models.precision import native_bfloat16

    if not native_bfloat16(jax.devices()[0]):
        pytest.skip("the compiled bf16 dots are checked on CPUs with bf16 dot instructions (avx512_bf16, amx_bf16)")
    types = dict(re.findall(r"%([\w.\-]+) = (\w+\[[\d,]*\])", compiled_text))
    dots = re.findall(r"= (\w+\[[\d,]*\])\S* dot\(%([\w.\-]+), %([\w.\-]+)\)", compiled_text)
    kind = (lambda t: t) if shapes else (lambda t: t.split("[")[0])
    return [(kind(out), kind(types.get(lhs, "?")), kind(types.get(rhs, "?"))) for out, lhs, rhs in dots]
