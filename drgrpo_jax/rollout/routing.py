"""Which of several generation services samples which prompt of a generate call.

A call with routing keys (the episode driver gives each turn its episode's opening, `route_key`) is routed by
rendezvous hashing: each key ranks the URLs by a hash of (URL, key) and goes to the first that can take it. So a
group's episodes and every turn of each reach the service that holds their prefix in its cache; the choice depends
only on the key and the URL strings, so every process of a trainer makes the same one; a URL that fails moves only
its own keys, spread over the others by their next choice, and gets them back once it answers again. A call without
keys has no prefix to keep between calls (a group's completions travel in one request whatever the split): it is
cut into contiguous equal shares, whole groups each, as even as a round allows. `Router` remembers the URLs that
failed: for `rest_s` they are asked only when no other URL is left, so a dead service does not cost every call its
retries.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Collection, Sequence

import numpy as np

__all__ = ["Router", "by_key", "evenly", "ranking", "route_key"]


def route_key(ids: Sequence[int]) -> bytes:
    """The routing key of a token prefix: a hash of its ids (as little-endian int64, so the same on every host)."""
    return hashlib.blake2b(np.asarray(ids, "<i8").tobytes(), digest_size=16).digest()


def _weight(url: str, key: bytes) -> int:
    """The rendezvous weight of `url` for `key`."""
    return int.from_bytes(hashlib.blake2b(url.encode() + b"\0" + key, digest_size=8).digest(), "big")


def ranking(key: bytes, urls: Sequence[str]) -> list[int]:
    """The indices of `urls` in the order `key` prefers them (the highest weight first)."""
    return sorted(range(len(urls)), key=lambda u: (-_weight(urls[u], key), u))


def by_key(keys: Sequence[bytes], urls: Sequence[str], usable: Sequence[int]) -> dict[int, list[int]]:
    """The positions of `keys` by the URL index that takes them: each key's first choice among `usable`."""
    allowed = set(usable)
    shares: dict[int, list[int]] = {}
    for position, key in enumerate(keys):
        chosen = next(u for u in ranking(key, urls) if u in allowed)
        shares.setdefault(chosen, []).append(position)
    return shares


def evenly(count: int, usable: Sequence[int], first: int) -> dict[int, list[int]]:
    """`count` positions cut into contiguous, nearly equal shares (empty ones dropped), handed to `usable` in its
    order from its entry at `first` (mod its length: processes start at different URLs)."""
    bounds = np.linspace(0, count, len(usable) + 1).round().astype(int)
    spans = [(int(a), int(b)) for a, b in itertools.pairwise(bounds) if b > a]
    start = first % len(usable)
    return {url: list(range(a, b)) for url, (a, b) in zip([*usable[start:], *usable[:start]], spans)}


class Router:
    """The shares of a generate call's prompts over the URLs, and when each URL last failed one."""

    def __init__(self, rest_s: float):
        self.rest_s = rest_s
        self._failed_at: dict[str, float] = {}  # monotonic seconds

    def failed(self, url: str) -> None:
        self._failed_at[url] = time.monotonic()

    def answered(self, url: str) -> None:
        self._failed_at.pop(url, None)

    def shares(self, urls: Sequence[str], pending: Sequence[int], keys: Sequence[bytes] | None, first_url: int,
               failed: Collection[int]) -> list[tuple[int, list[int]]]:
        """(URL index, the `pending` prompts it samples) for every URL given some, among the URLs not `failed` in
        this call: the rested ones (`rest_s` since they failed) if any is left; by `keys` (each prompt's), else in
        contiguous shares from `first_url`. Empty when every URL has failed."""
        usable = [u for u in range(len(urls)) if u not in failed]
        if not usable:
            return []
        now = time.monotonic()
        rested = [u for u in usable if now - self._failed_at.get(urls[u], -np.inf) >= self.rest_s] or usable
        shares = evenly(len(pending), rested, first_url) if keys is None else \
            by_key([keys[i] for i in pending], urls, rested)
        return [(url, [pending[position] for position in positions]) for url, positions in shares.items()]
