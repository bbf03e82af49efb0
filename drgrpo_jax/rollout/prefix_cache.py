"""The services' prefix caches as the trainer sees them: the readings a client keeps to turn each service's counts
since start-up (`engines.base.PrefixCacheStats`, as its engine reads them) into a round's, and the round's row in
metrics.jsonl.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from drgrpo_jax.errors import RolloutError
from drgrpo_jax.rollout.engines.base import Engine, PrefixCacheStats, Request

log = logging.getLogger("drgrpo_jax.rollout")
__all__ = ["PrefixCacheReadings", "prefix_cache_metrics"]


class PrefixCacheReadings:
    """Each URL's last reading, so that a round's reading is what the caches did since the one before."""

    def __init__(self) -> None:
        self._seen: dict[str, PrefixCacheStats] = {}
        self._lock = threading.Lock()  # a round's reading on the sampling thread, an evaluation's on the main one

    def delta(self, engine: Engine, urls: Sequence[str], request: Request) -> PrefixCacheStats | None:
        """What the caches at `urls` did since the last reading, summed; None when none reports a cache. A URL that
        cannot be read now (it failed, or answered something that is no cache report: a warning) adds nothing; its
        next reading counts from its last."""
        total: PrefixCacheStats | None = None
        with self._lock:
            for url in urls:
                try:
                    now = engine.prefix_cache(url, request)
                except RolloutError as error:
                    log.warning("%s: no prefix cache counts this round: %s", url, error)
                    continue
                if now is None:
                    continue
                delta = now.since(self._seen.get(url))
                self._seen[url] = now
                total = delta if total is None else total + delta
        return total


def prefix_cache_metrics(cache: PrefixCacheStats) -> dict[str, float | None]:
    """A round's metrics: the share of prompt tokens read from the caches (None when nothing was prefilled), the
    tokens read and those prefilled, the blocks evicted, and the blocks they hold now (summed over the services)."""
    read = cache.hit_tokens + cache.miss_tokens
    return {"rollout/prefix_cache_hit_rate": cache.hit_tokens / read if read else None,
            "rollout/prefix_cache_hit_tokens": cache.hit_tokens,
            "rollout/prefix_cache_prefilled_tokens": cache.miss_tokens,
            "rollout/prefix_cache_evicted_blocks": cache.evicted_blocks,
            "rollout/prefix_cache_cached_blocks": cache.cached_blocks}
