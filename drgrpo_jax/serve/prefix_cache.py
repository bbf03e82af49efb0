"""The service's prefix cache: prompt KV blocks kept across requests in a page pool (sampler/prefix_pool.py), found
by chained block hashes of token ids, evicted least recently used within --prefix-cache-bytes, and belonging to the
one generation of weights that wrote them.

A prompt's block i is keyed by the hash of block i - 1's key and its own BLOCK_TOKENS token ids, so a key names
the whole prefix up to its block's end. A hit is the longest run of a prompt's leading blocks that are cached,
leaving at least one token to prefill (the first token's draw needs the prompt's last logits). When the pool is
full, the least recently used block goes; a prompt's leading blocks are touched after its later ones, so a chain
loses its tail first and a cached block's parent is always cached.

Weights: blocks belong to the `Weights` object whose batch wrote them. A batch on other weights (a push, an adapter
merged, a rollback) empties the index before it looks anything up, so no block of version v is ever read at v + 1;
a batch still running on v (in-flight updates keep theirs) stores nothing once a newer batch has looked up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.kv_cache import KVCache
from drgrpo_jax.sampler.batch import batch_bucket, bucket
from drgrpo_jax.sampler.prefix_pool import (
    BLOCK_TOKENS,
    PagePool,
    block_bytes,
    gather_prefix,
    grow_pool,
    init_pool,
    left_padded_table,
    store_blocks,
)

__all__ = ["Prefix", "PrefixCache", "block_hashes"]

_FIRST_BLOCKS = 16  # the pool's first size; it doubles from there up to the budget


def block_hashes(prompt: Sequence[int]) -> list[bytes]:
    """The chained key of each whole block of `prompt`."""
    keys, parent = [], b""
    for start in range(0, len(prompt) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        tokens = np.asarray(prompt[start:start + BLOCK_TOKENS], np.int64).tobytes()
        parent = hashlib.blake2b(parent + tokens, digest_size=16).digest()
        keys.append(parent)
    return keys


@dataclasses.dataclass(frozen=True)
class Prefix:
    """What a batch takes from the cache: per distinct prompt its cached leading tokens, the prompts' cache holding
    them (None: no hit), and the slots the batch prefills after them."""

    prompts: list[tuple[int, ...]]
    cached: list[int]  # leading tokens of each prompt in `cache` (multiples of BLOCK_TOKENS)
    cache: KVCache | None  # the prompts' split cache, `cached_slots` slots filled (gather_prefix)
    cached_slots: int  # M x BLOCK_TOKENS: the cached region of every prompt's slots
    prompt_len: int  # the slots prefilled after them: cached_slots + prompt_len = bucket(longest prompt)
    weights: Any  # the Weights the blocks belong to


class PrefixCache:
    """Prompt blocks of finished batches, LRU within a byte budget, for one generation of weights at a time."""

    def __init__(self, config: DecoderConfig, budget_bytes: int, dtype, mesh: Mesh | None = None):
        self.block_bytes = block_bytes(config, jnp.dtype(dtype).itemsize)
        self.capacity = budget_bytes // self.block_bytes - 1  # the pool's scratch block is within the budget too
        if self.capacity < 1:
            raise ValueError(f"--prefix-cache-bytes: {budget_bytes} bytes hold no block of {BLOCK_TOKENS} tokens "
                             f"beside the pool's scratch block (each takes {self.block_bytes} bytes); 0 turns the "
                             "prefix cache off")
        self.budget_bytes = budget_bytes
        self._config, self._dtype, self._mesh = config, dtype, mesh
        # Allocated at the first store and doubled as blocks are kept, up to `capacity`: a service whose prompts
        # share little holds little.
        self._pool: PagePool | None = None
        self._size = 0  # blocks the pool has room for (once it has grown to it)
        self._blocks: OrderedDict[bytes, int] = OrderedDict()  # key -> pool block, least recently used first
        self._free: list[int] = []
        self._owner: weakref.ref | None = None  # the Weights the cached blocks belong to
        self._lock = threading.Lock()
        self.hit_tokens = 0  # prompt tokens read from the cache instead of prefilled (each distinct prompt once)
        self.miss_tokens = 0  # prompt tokens prefilled by batches that looked the cache up
        self.evicted_blocks = 0  # blocks evicted to make room (flushes and weight changes are not counted)

    def stats(self) -> dict[str, int]:
        """The counters /get_model_info serves; `pool_bytes`: what the pool holds allocated now (within the budget)."""
        with self._lock:
            pool = 0 if self._pool is None else self._pool.k.nbytes + self._pool.v.nbytes
            return {"hit_tokens": self.hit_tokens, "miss_tokens": self.miss_tokens,
                    "evicted_blocks": self.evicted_blocks, "cached_blocks": len(self._blocks),
                    "budget_bytes": self.budget_bytes, "pool_bytes": pool, "block_tokens": BLOCK_TOKENS}

    def flush(self) -> int:
        """Forgets every cached block (the pool's memory stays); returns how many there were."""
        with self._lock:
            return self._clear()

    def _clear(self) -> int:
        dropped = len(self._blocks)
        self._blocks.clear()
        self._free = list(range(self._size))
        return dropped

    def _touch(self, keys: Sequence[bytes]) -> None:
        """Marks a chain used: its leading blocks last, so eviction takes a chain's tail first."""
        for key in reversed(keys):
            self._blocks.move_to_end(key)

    def take(self, weights: Any, prompts: Sequence[tuple[int, ...]], num_prompts: int) -> Prefix:
        """The cached leading blocks of each prompt on `weights` (a batch of `num_prompts` prompt rows), gathered
        into its prompts' cache. Other weights' blocks are dropped first."""
        longest = bucket(max(len(p) for p in prompts))
        with self._lock:
            if self._owner is None or self._owner() is not weights:
                self._clear()
                self._owner = weakref.ref(weights)
            hits = [self._cached_run(p) for p in prompts]
            # The prefilled slots are a bucket of the longest rest, the cached region what is left of the longest
            # prompt's bucket: the prompts' slots and every program's shapes stay those of a batch without the cache.
            prompt_len = bucket(max(len(p) - BLOCK_TOKENS * len(hit) for p, hit in zip(prompts, hits)))
            room = (longest - prompt_len) // BLOCK_TOKENS
            hits = [hit[:room] for hit in hits]
            cached = [BLOCK_TOKENS * len(hit) for hit in hits]
            self.hit_tokens += sum(cached)
            self.miss_tokens += sum(len(p) for p in prompts) - sum(cached)
            cache = None
            if any(hits):
                for prompt, hit in zip(prompts, hits):
                    self._touch(block_hashes(prompt)[:len(hit)])
                assert self._pool is not None  # a hit means a store allocated it
                table = left_padded_table([[self._blocks[k] for k in hit] for hit in hits], num_prompts, room)
                # Dispatched under the lock: a store that reuses these blocks later runs after this read.
                cache = gather_prefix(self._pool, jnp.asarray(table), prompt_slots=prompt_len, mesh=self._mesh)
        return Prefix(list(prompts), cached, cache, room * BLOCK_TOKENS if cache is not None else 0,
                      prompt_len if cache is not None else longest, weights)

    def _cached_run(self, prompt: tuple[int, ...]) -> list[bytes]:
        """The keys of the prompt's leading cached blocks, leaving at least its last token to prefill."""
        run = []
        for key in block_hashes(prompt[:len(prompt) - 1]):
            if key not in self._blocks:
                break
            run.append(key)
        return run

    def keep(self, prefix: Prefix, cache: KVCache, row_of_prompt: Sequence[int]) -> None:
        """Copies the prompts' whole blocks not cached yet from a batch's rows' cache right after its prefill
        (`generate`'s `keep_prompts`); `row_of_prompt[p]`: a row that continues prompt p. Nothing is kept once a
        batch on other weights has looked the cache up."""
        with self._lock:
            if self._owner is None or self._owner() is not prefix.weights:
                return
            entries: list[tuple[int, int, int]] = []  # (row, first slot, pool block)
            for prompt, cached, row in zip(prefix.prompts, prefix.cached, row_of_prompt):
                first_rest = prefix.cached_slots + prefix.prompt_len - (len(prompt) - cached)
                keys = block_hashes(prompt)
                for index, key in enumerate(keys):
                    if key in self._blocks:
                        continue
                    block = self._free_block(keys[:index + 1])
                    if block is None:
                        break
                    self._blocks[key] = block
                    # A prompt's slots: its cached blocks end the cached region, its rest ends the prefilled one
                    # (a block of the cached region is missing here only if another batch evicted it meanwhile).
                    start = index * BLOCK_TOKENS
                    entries.append((row, start + (prefix.cached_slots if start < cached else first_rest) - cached,
                                    block))
                self._touch([k for k in keys if k in self._blocks])
            if entries:
                self._store(cache, entries)

    def _free_block(self, chain: Sequence[bytes]) -> int | None:
        """A pool block for a new key: a free one, else room grown within the budget, else the least recently
        used one outside `chain` (None)."""
        if not self._free and self._size < self.capacity:
            size = min(self.capacity, max(2 * self._size, _FIRST_BLOCKS))
            self._free, self._size = list(range(size - 1, self._size - 1, -1)), size
        if self._free:
            return self._free.pop()
        for key in self._blocks:
            if key not in chain:
                self.evicted_blocks += 1
                return self._blocks.pop(key)
        return None

    def _store(self, cache: KVCache, entries: list[tuple[int, int, int]]) -> None:
        """One store program for the entries, padded to a bucket with writes to the scratch block."""
        if self._pool is None:
            self._pool = init_pool(self._config, self._size, self._dtype, self._mesh)
        elif self._pool.num_blocks < self._size:
            self._pool = grow_pool(self._pool, self._size, self._mesh)
        size = batch_bucket(len(entries))
        padded = entries + [(0, 0, self._size)] * (size - len(entries))  # block `_size`: the scratch one
        rows, slots, blocks = (jnp.asarray(np.array(column, np.int32)) for column in zip(*padded))
        self._pool = store_blocks(self._pool, cache, rows, slots, blocks)
