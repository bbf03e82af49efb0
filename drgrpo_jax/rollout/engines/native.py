"""Our own generation service as an engine (`rollout.engine=ours`, `python -m drgrpo_jax.serve`).

It speaks SGLang's native API (`engines/sglang.py`) with differences the client relies on: one request row per
prompt with n = G (the service draws each completion's seed from its row's), seeds honoured whatever its flags, and
its prefix cache's counts in /get_model_info (`prefix_cache`), which the trainer logs.
"""

from __future__ import annotations

from typing import Any, ClassVar

from drgrpo_jax.config.engines import EngineName
from drgrpo_jax.errors import RolloutError
from drgrpo_jax.rollout.engines.base import PrefixCacheStats, Request, described, read_prefix_cache
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
        size = _model_info(url, request).get("vocab_size")
        if size is None:  # a stand-in that does not say
            return None
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise RolloutError(f"{url}/get_model_info: vocab_size: {described(size)} is not a vocabulary size",
                               url=url)
        return size

    def prefix_cache(self, url: str, request: Request) -> PrefixCacheStats | None:
        """The `prefix_cache` of its /get_model_info (None from a service without one)."""
        return read_prefix_cache(_model_info(url, request).get("prefix_cache"), f"{url}/get_model_info: prefix_cache")


def _model_info(url: str, request: Request) -> dict[str, Any]:
    """Its /get_model_info; {} from a stand-in server without the route or with no object there."""
    try:
        info = request("GET", url, "/get_model_info")
    except RolloutError as error:
        if error.status == 404:
            return {}
        raise
    return info if isinstance(info, dict) else {}
