"""Our own generation service as an engine (`rollout.engine=ours`, `python -m drgrpo_jax.serve`).

It speaks SGLang's native API (`engines/sglang.py`) with two differences the client relies on: one request row per
prompt with n = G (the service draws each completion's seed from its row's), and seeds honoured whatever its flags.
"""

from __future__ import annotations

from typing import ClassVar

from drgrpo_jax.config.engines import EngineName
from drgrpo_jax.rollout.engines.base import Request
from drgrpo_jax.rollout.engines.sglang import SGLangEngine

__all__ = ["NativeEngine"]


class NativeEngine(SGLangEngine):
    """Our service: SGLang's routes, one row per prompt."""

    name: ClassVar[EngineName] = "ours"
    one_row_per_completion: ClassVar[bool] = False

    def check_startup(self, url: str, request: Request) -> bool:
        """Nothing to read: our service needs no start-up flag and always honours seeds."""
        return True
