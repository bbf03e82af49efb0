"""Our own generation service as an engine (`rollout.engine=ours`, `python -m drgrpo_jax.serve`).

It speaks SGLang's native API (`engines/sglang.py`) with two differences the client relies on: one request row per
prompt with n = G (the service draws each completion's seed from its row's), and seeds honoured whatever its flags.
"""

from __future__ import annotations

from typing import ClassVar

from drgrpo_jax.config.engines import EngineName
from drgrpo_jax.errors import RolloutError
from drgrpo_jax.rollout.engines.base import Request, described
from drgrpo_jax.rollout.engines.sglang import SGLangEngine

__all__ = ["NativeEngine"]


class NativeEngine(SGLangEngine):
    """Our service: SGLang's routes, one row per prompt."""

    name: ClassVar[EngineName] = "ours"
    one_row_per_completion: ClassVar[bool] = False

    def check_startup(self, url: str, request: Request) -> bool:
        """Nothing to read: our service needs no start-up flag and always honours seeds."""
        return True

    def vocab_size(self, url: str, request: Request) -> int | None:
        """The `vocab_size` of its /get_model_info (None from a stand-in server without the route or the field)."""
        try:
            info = request("GET", url, "/get_model_info")
        except RolloutError as error:
            if error.status == 404:
                return None
            raise
        size = info.get("vocab_size") if isinstance(info, dict) else None
        if size is None:  # a stand-in that does not say
            return None
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise RolloutError(f"{url}/get_model_info: vocab_size: {described(size)} is not a vocabulary size",
                               url=url)
        return size
