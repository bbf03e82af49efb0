"""KV-cache sampling from the host: each distinct prompt prefilled once, then decode phases over a growing cache.

Shape letters (docs/shape_letters.md): P distinct prompts (padded to a bucket), U prompt positions
(bucketed), B rows (prompt x sample, padded to a bucket), T new-token budget (bucketed), S cache slots,
L layers and k experts per token of a mixture (`record_experts`).

`generate` runs the compiled programs of `programs.py` from the host: `prefill`, `decode_phase` (a while_loop over a
cache it carries and updates in place) and between phases `regrow` (the next span, dropping finished rows). Every
per-request knob is a per-row array and every shape a bucket (`batch.py`), so requests with different settings
share a batch and a long run compiles a bounded set of programs. A row's draws depend only on its (seed, stream,
sample) and the step (`draws.row_keys`), never on the phases or on its batch-mates.

Between phases (on the host, outside every compiled program) `generate` asks its caller's `unwanted` hook which
rows nobody waits for any more: those rows are finished where they are, and once every row is, the batch ends
there instead of running its remaining phases. At the same boundaries its `weights_now` hook may hand it newer
weights of the same shapes (an in-flight weight update): the rows go on with them from there, over the KV cache
the earlier weights wrote (as PipelineRL's in-flight updates do), and `SamplerOutput.versions_BT` says which
weights sampled each token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from drgrpo_jax.models.kv_cache import KVCache
from drgrpo_jax.sampler.batch import SamplerBatch, SamplerOutput, mesh_rows
from drgrpo_jax.sampler.programs import (
    PREFILL_CHUNK,
    Decoding,
    admit,
    decode_phase,
    place_batch,
    prefill,
    prefill_part,
    regrow,
)

__all__ = ["generate", "span_schedule"]


def span_schedule(prompt_len: int, max_new_tokens: int) -> tuple[int, ...]:
    """Cache slots of each decode phase: the powers of two above prompt_len, then U + T - 1, so a step attends
    over at most twice the slots in use instead of the whole budget.

    The last sampled token is never fed back, so U + T - 1 slots hold everything attended to; no phase
    is needed when the prefill's token is the whole budget. A power of two that U + T - 1 exceeds by less
    than half is skipped: growing it would copy the cache (old and new copies live at once) for few slots.
    """
    total = prompt_len + max_new_tokens - 1
    spans, span = [], 1 << int(prompt_len).bit_length()
    while span < total:
        spans.append(span)
        span *= 2
    if spans and 2 * total < 3 * spans[-1]:
        spans.pop()
    return (*spans, total) if total > prompt_len else ()


def _kept_rows(done_B: np.ndarray, data: int = 1) -> np.ndarray | None:
    """Indices of the live rows padded to their bucket (`mesh_rows` over `data` devices) with finished rows, or
    None when that would not halve B."""
    live = np.flatnonzero(~done_B)
    size = mesh_rows(len(live), data)
    if size > len(done_B) // 2:
        return None
    return np.concatenate([live, np.full(size - len(live), np.flatnonzero(done_B)[0])]).astype(np.int32)


class _Collected:
    """Host copies of every row's output, filled as rows leave the device batch."""

    def __init__(self, num_rows: int, max_new_tokens: int, experts: tuple[int, int] | None = None):
        self.tokens_BT = np.zeros((num_rows, max_new_tokens), np.int32)
        self.logprobs_BT = np.zeros((num_rows, max_new_tokens), np.float32)
        self.lengths_B = np.zeros(num_rows, np.int32)
        self.stopped_B = np.zeros(num_rows, bool)
        # (L, k) when the sampler records experts
        self.experts_BTLk = None if experts is None else np.zeros((num_rows, max_new_tokens, *experts), np.int32)

    def extend(self, count: int) -> None:
        """Room for `count` more rows (rows admitted into the running batch)."""
        def grown(x: np.ndarray) -> np.ndarray:
            return np.concatenate([x, np.zeros((count, *x.shape[1:]), x.dtype)])

        self.tokens_BT, self.logprobs_BT = grown(self.tokens_BT), grown(self.logprobs_BT)
        self.lengths_B, self.stopped_B = grown(self.lengths_B), grown(self.stopped_B)

    def save(self, out: SamplerOutput, row_ids: np.ndarray) -> None:
        """Stores the device rows whose original index is `row_ids` (-1 = a padding row, skipped)."""
        mine = [self.tokens_BT, self.logprobs_BT, self.lengths_B, self.stopped_B]
        theirs: list[jax.Array | None] = [out.tokens_BT, out.logprobs_BT, out.lengths_B, out.stopped_B]
        if self.experts_BTLk is not None:
            mine.append(self.experts_BTLk)
            theirs.append(out.experts_BTLk)
        real = row_ids >= 0
        for into, got in zip(mine, jax.device_get(theirs)):
            into[row_ids[real]] = got[real]


def _unwanted_mask(unwanted: Callable[[], Sequence[bool]] | None, num_rows: int) -> np.ndarray:
    """The hook's answer as a bool mask over the batch's rows (rows it does not name are wanted)."""
    mask = np.zeros(num_rows, bool)
    if unwanted is not None:
        answer = np.asarray(unwanted(), bool).reshape(-1)
        if len(answer) > num_rows:
            raise ValueError(f"unwanted: named {len(answer)} rows, the batch has {num_rows}")
        mask[:len(answer)] = answer
    return mask


def _nothing_sampled(num_rows: int, max_new_tokens: int, experts: tuple[int, int, int, int] | None) -> SamplerOutput:
    """What a batch returns when its prefill stopped because no row was wanted any more (`experts`: (P, U, L, k)
    when recording; the prompts' experts are then left 0 too)."""
    out = SamplerOutput(jnp.zeros((num_rows, max_new_tokens), jnp.int32),
                        jnp.zeros((num_rows, max_new_tokens), jnp.float32), jnp.zeros((num_rows,), jnp.int32),
                        jnp.zeros((num_rows,), bool), jnp.int32(0))
    if experts is None:
        return out
    P, U, L, k = experts
    return dataclasses.replace(out, experts_BTLk=jnp.zeros((num_rows, max_new_tokens, L, k), jnp.int32),
                               prompt_experts_PULk=jnp.zeros((P, U, L, k), jnp.int32))


def _check_same_layout(old: nnx.State, new: nnx.State) -> None:
    """ValueError unless `new` has `old`'s tree, shapes and dtypes: the running batch's programs take it as it is."""
    old_leaves = jax.tree_util.tree_leaves_with_path(old)
    new_leaves = jax.tree_util.tree_leaves_with_path(new)
    if [path for path, _ in old_leaves] != [path for path, _ in new_leaves]:
        raise ValueError("weights_now: the new weights' tree differs from the running batch's")
    for (_, a), (_, b) in zip(old_leaves, new_leaves):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"weights_now: a weight of shape/dtype {b.shape} {b.dtype} replaces {a.shape} {a.dtype}; "
                             "only weights of the running batch's shapes may swap in")


def _token_versions(switches: Sequence[tuple[int, int]], lengths_B: np.ndarray, max_new_tokens: int,
                    offsets_B: np.ndarray) -> np.ndarray:
    """int32 [B, T]: the weights' index that sampled each token, from the (first batch step, index) of each swap
    (row b's column t is batch step offsets_B[b] + t), -1 past a row's length."""
    steps_BT = offsets_B[:, None] + np.arange(max_new_tokens)[None, :]
    version_BT = np.zeros(steps_BT.shape, np.int32)
    for first, version in switches:
        version_BT[steps_BT >= first] = version
    return np.where(np.arange(max_new_tokens)[None, :] < lengths_B[:, None], version_BT, -1).astype(np.int32)


def _longer_spans(span: int, total: int) -> list[int]:
    """The phases after one of `span` slots when the cache must reach `total`: doubling, then `total`."""
    spans = []
    while 2 * span < total:
        span *= 2
        spans.append(span)
    return [*spans, total]


def generate(graphdef: nnx.GraphDef, state: nnx.State, batch: SamplerBatch, *, max_new_tokens: int,
             cache_dtype: jnp.dtype = jnp.float32, compact: bool = True,
             unwanted: Callable[[], Sequence[bool]] | None = None, check_every: int | None = None,
             mesh: Mesh | None = None, record_experts: bool = False,
             weights_now: Callable[[], tuple[nnx.State, int]] | None = None, prefix: KVCache | None = None,
             keep_prompts: Callable[[KVCache], None] | None = None,
             admit_rows: Callable[[int, int, int], SamplerBatch | None] | None = None,
             finished: Callable[[np.ndarray, SamplerOutput], None] | None = None,
             max_rows: int | None = None) -> SamplerOutput:
    """Samples up to `max_new_tokens` tokens for every row of `batch` (`compact`: drop finished rows between phases).

    `unwanted`: called on the host between the prefill's programs of a prompt longer than PREFILL_CHUNK, before
    each decode phase and, with `check_every`, after every `check_every` decode steps within one, it names (True,
    in the batch's row order) the rows whose tokens nobody waits for any more. They are finished where they are
    (their output so far is returned, `stopped_B` False), which changes no other row's tokens; when no row is left
    the rest of the batch (or of the prefill) is skipped. The pauses run the same programs
    (the step to pause at is traced), so they cost a host round trip each and no compile.
    `mesh`: a (data, fsdp=1, tensor) mesh that `state` is placed on (`sharding.param_shardings`): the batch's
    prompts and rows are split over `data` (their counts must divide by it: `mesh_rows`), heads, MLP and
    vocabulary over `tensor`. A row's draws are its own (`row_keys`); the mesh changes only the order of float sums.
    `record_experts` (a mixture of experts only): the output also holds the experts every layer's router chose for
    every prompt and generated token the model read (`SamplerOutput.experts_BTLk`, `prompt_experts_PULk`), what
    router replay gives the trainer; the tokens and log-probs are the same either way.
    `weights_now` (in-flight weight updates): asked at the same boundaries as `unwanted` (before each decode phase
    and, with `check_every`, every `check_every` decode steps; not within the prefill), it answers (state, index):
    the weights to sample with from there and the caller's index for them (`state` is index 0). A new index swaps
    them in: every row goes on with them over its KV cache as the earlier weights wrote it (the prompt and the
    tokens sampled so far are not recomputed, as in PipelineRL), and `SamplerOutput.versions_BT` records the index
    that sampled each token. The new state must have `state`'s tree, shapes and dtypes (ValueError otherwise); it is
    an argument of the same programs, so a swap compiles nothing.
    `prefix` (a prefix cache's hit): the distinct prompts' split cache whose first `length` slots hold each prompt's
    cached leading tokens (`prefix_pool.gather_prefix`); `batch` then holds only the rest of each prompt
    (`make_batch`'s `cached`), prefilled after them. Positions, masks and draws are those of the whole prompt, so the
    tokens are what a prefill of the whole prompt gives (up to the order of float sums). Not with `record_experts`:
    the cached tokens' experts are not kept (the caller prefills such rows whole).
    `keep_prompts`: called once with the rows' split cache right after the prefill, before any decode program takes
    it (its first prompt slots are the prompts' KV, laid out as `prefix` + `batch` give them): a prefix cache copies
    the prompts' blocks from there.
    `admit_rows` (continuous admission): asked at the same boundaries as `unwanted` with (the places for new rows:
    finished rows, and rows the batch may grow by up to `max_rows`; the batch's step; its rows now), it may answer a
    batch of new rows (`make_batch`, placed on the host: at most that many live rows, prompts as wide as `batch`'s,
    budgets within `max_new_tokens`): the batch grows by finished rows if it must (a regrow to a larger bucket of
    rows), and they are prefilled and take finished rows' places (`programs.admit`), their ids following the rows so
    far (the output grows by them, and `unwanted` answers for them too), and each draws what it would alone (its own
    step counts from its token 0). The cache grows by the phases their budgets need. Not with `record_experts`.
    `finished`: called at those boundaries with the ids of rows that finished since, and their output so far
    (host arrays, that many rows; `versions_BT` with `weights_now`), so a caller can answer them before the batch
    ends.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    if check_every is not None and check_every < 1:
        raise ValueError(f"check_every: must be >= 1 or None, got {check_every}")
    if prefix is not None and record_experts:
        raise ValueError("prefix: a cached prefix keeps no routed experts; record_experts needs the prompts whole")
    if admit_rows is not None and record_experts:
        raise ValueError("admit_rows: admitted rows record no routed experts; record_experts batches take none")
    num_rows, prompt_len = batch.rows.live_B.shape[0], batch.prompt_ids_PU.shape[1]
    data = 1 if mesh is None else mesh.shape["data"]
    if num_rows % data or batch.prompt_ids_PU.shape[0] % data:
        raise ValueError(f"batch: {num_rows} rows and {batch.prompt_ids_PU.shape[0]} prompts must both divide over "
                         f"data={data} devices (make_batch with mesh_rows)")
    cached_slots = 0 if prefix is None else prefix.positions_BS.shape[1] - prompt_len
    spans = list(span_schedule(cached_slots + prompt_len, max_new_tokens))
    placed = place_batch(batch, mesh)
    cache, done = prefix, 0
    experts_Lk: tuple[int, int] | None = None  # (L, k) when recording
    prompt_parts: list[Any] = []  # the experts [P, W, L, k] of the chunked prompt columns (None unless a mixture)
    if record_experts:
        config = nnx.merge(graphdef, state).config
        if not config.moe:
            raise ValueError(f"record_experts: {config.family} has no router (a dense MLP in every layer)")
        experts_Lk = (config.num_layers, config.experts_per_token)
    if prompt_len > PREFILL_CHUNK:
        # A long prompt is prefilled PREFILL_CHUNK columns a program: its attention scores grow linearly with the
        # prompt, not with its square (sampler/memory.py), and `unwanted` is asked between the programs, so a
        # prefill nobody waits for any more stops there, as a decode phase does.
        live_B = jax.device_get(batch.rows.live_B)
        for start in range(0, prompt_len - PREFILL_CHUNK, PREFILL_CHUNK):
            if unwanted is not None and (_unwanted_mask(unwanted, num_rows) | ~live_B).all():
                shape = None if experts_Lk is None else (batch.prompt_ids_PU.shape[0], prompt_len, *experts_Lk)
                nothing = _nothing_sampled(num_rows, max_new_tokens, shape)
                return nothing if weights_now is None else dataclasses.replace(
                    nothing, versions_BT=jnp.full((num_rows, max_new_tokens), -1, jnp.int32))
            columns = slice(start, start + PREFILL_CHUNK)
            cache, experts_PWLk = prefill_part(graphdef, state, placed.prompt_ids_PU[:, columns],
                                               placed.prompt_positions_PU[:, columns], cache, prompt_len=prompt_len,
                                               cache_dtype=cache_dtype, mesh=mesh)
            prompt_parts.append(experts_PWLk)
            done = start + PREFILL_CHUNK
    decoding = prefill(graphdef, state, placed, max_new_tokens=max_new_tokens,
                       num_slots=(spans or (cached_slots + prompt_len,))[0], cache_dtype=cache_dtype, mesh=mesh,
                       cache=cache, done=done, record_experts=record_experts)
    if keep_prompts is not None:
        keep_prompts(decoding.cache)
    prompt_experts_PULk = None
    if record_experts:
        prompt_experts_PULk = jnp.concatenate([*prompt_parts, decoding.out.prompt_experts_PULk], axis=1)
        prompt_experts_PULk = jnp.where(placed.prompt_positions_PU[:, :, None, None] >= 0, prompt_experts_PULk, 0)
        decoding = dataclasses.replace(decoding, out=dataclasses.replace(decoding.out, prompt_experts_PULk=None))
    collected, row_ids = _Collected(num_rows, max_new_tokens, experts_Lk), np.arange(num_rows)
    offsets = np.zeros(num_rows, np.int32)  # each row's offsets_B, by id
    reported = np.zeros(num_rows, bool)  # rows handed to `finished`
    last_step = max_new_tokens  # the batch steps its rows may need
    phases: list[tuple[int, int]] = []  # (rows, slots) of each phase run
    first_steps: list[int] = []  # decode iterations run before each phase
    hooks = (unwanted, weights_now, admit_rows, finished)
    pause = max_new_tokens if all(hook is None for hook in hooks) or check_every is None else check_every
    version = 0  # the index of the weights sampling now
    switches: list[tuple[int, int]] = []  # (first column, index) of each swap

    def take_newer_weights(step: int) -> None:
        """Swaps in the hook's weights when they are new; the token of column `step` is the first they sample."""
        nonlocal state, version
        if weights_now is None:
            return
        new_state, new_version = weights_now()
        if new_version != version:
            _check_same_layout(state, new_state)
            state, version = new_state, new_version
            switches.append((step, version))

    def drop_unwanted(decoding: Decoding) -> tuple[Decoding, np.ndarray, bool]:
        """(decoding with the unwanted rows finished, done_B, whether any row is left)."""
        done_B = jax.device_get(decoding.done_B)
        dropped_B = _unwanted_mask(unwanted, len(offsets))[row_ids] & (row_ids >= 0) & ~done_B
        if dropped_B.any():  # finished like a row that hit its budget: the same shapes, so no new program
            done_B = done_B | dropped_B
            # On the device array, so the flag keeps its placement (a new placement would be a new program).
            decoding = dataclasses.replace(decoding, done_B=decoding.done_B | jnp.asarray(dropped_B))
        return decoding, done_B, not done_B.all()

    def report(decoding: Decoding, done_B: np.ndarray) -> None:
        """Hands the rows finished since the last call to `finished`."""
        ids = row_ids[(row_ids >= 0) & done_B]
        ids = ids[~reported[ids]]
        if finished is None or not len(ids):
            return
        collected.save(decoding.out, row_ids)
        reported[ids] = True
        versions = None if weights_now is None else _token_versions(switches, collected.lengths_B[ids],
                                                                    max_new_tokens, offsets[ids])
        finished(ids, SamplerOutput(
            tokens_BT=jnp.asarray(collected.tokens_BT[ids]), logprobs_BT=jnp.asarray(collected.logprobs_BT[ids]),
            lengths_B=jnp.asarray(collected.lengths_B[ids]), stopped_B=jnp.asarray(collected.stopped_B[ids]),
            num_steps=jnp.int32(0), versions_BT=None if versions is None else jnp.asarray(versions)))

    def take_new_rows(decoding: Decoding, done_B: np.ndarray, step: int, index: int) -> tuple[Decoding, bool]:
        """(decoding with the rows `admit_rows` hands in put in finished rows' places, whether any came)."""
        nonlocal row_ids, offsets, reported, last_step
        free = np.flatnonzero(done_B)
        room = len(free) + max(0, (max_rows or 0) - len(row_ids))
        new = None if admit_rows is None or not room else admit_rows(room, step, len(row_ids))
        if new is None:
            return decoding, False
        count = int(np.sum(new.rows.live_B))
        if count > len(free) and count <= room:  # more rows than finished ones: the batch grows by finished rows
            size = min(max_rows or 0, mesh_rows(len(row_ids) + count - len(free), data))
            grown = np.arange(size) >= len(row_ids)
            decoding = regrow(decoding, jnp.asarray(np.where(grown, 0, np.arange(size)).astype(np.int32)),
                              num_slots=int(decoding.cache.positions_BS.shape[1]), mesh=mesh)
            decoding = dataclasses.replace(decoding, done_B=decoding.done_B | jnp.asarray(grown))
            free = np.concatenate([free, np.arange(len(row_ids), size)])
            row_ids = np.concatenate([row_ids, np.full(size - len(row_ids), -1)])
        if not 0 < count <= len(free) or new.prompt_ids_PU.shape[1] > cached_slots + prompt_len or (
                new.rows.max_new_tokens_B > max_new_tokens).any():
            raise ValueError(f"admit_rows: {count} rows for {len(free)} places, prompts within "
                             f"{cached_slots + prompt_len} slots and budgets within {max_new_tokens}")
        collected.save(decoding.out, row_ids)  # the rows whose places are taken are finished: their outputs final
        into = np.full(len(new.rows.live_B), len(row_ids), np.int32)  # padding rows: past the end, dropped
        into[:count] = free[:count]
        first = len(offsets)
        collected.extend(count)
        offsets = np.concatenate([offsets, np.full(count, step - 1, np.int32)])
        reported = np.concatenate([reported, np.zeros(count, bool)])
        row_ids = row_ids.copy()
        row_ids[free[:count]] = np.arange(first, first + count)
        decoding = admit(graphdef, state, decoding, place_batch(new, mesh), jnp.asarray(into),
                         cache_dtype=cache_dtype, mesh=mesh)
        # Their tokens 1..T-1 feed T - 1 more slots from here: later phases grow the cache that far.
        last_step = max(last_step, step - 1 + max_new_tokens)
        needed = int(jax.device_get(decoding.cache.length)) + max_new_tokens - 1
        if needed > spans[-1]:
            spans[index + 1:] = _longer_spans(spans[index], needed)
        return decoding, True

    for index, span in enumerate(spans):
        decoding, done_B, left = drop_unwanted(decoding)
        steps, step = (int(x) for x in jax.device_get((decoding.out.num_steps, decoding.step)))
        report(decoding, done_B)
        decoding, joined = take_new_rows(decoding, done_B, step, index)
        if not (left or joined):
            break
        take_newer_weights(step)
        if index:
            kept = _kept_rows(done_B, data) if compact and not joined else None
            if kept is not None:
                collected.save(decoding.out, row_ids)  # the rows that leave are finished: their outputs are final
                row_ids = np.where(~done_B[kept], row_ids[kept], -1)
            decoding = regrow(decoding, jnp.arange(len(row_ids)) if kept is None else jnp.asarray(kept),
                               num_slots=span, mesh=mesh)
        phases.append((len(row_ids), span))
        first_steps.append(steps)
        while True:  # one pass unless paused every `check_every` steps; a pass that ends short ends the phase
            until = step + pause
            decoding = decode_phase(graphdef, state, decoding, np.int32(min(until, last_step)), mesh=mesh)
            step, slots = (int(x) for x in jax.device_get((decoding.step, decoding.cache.length)))
            if step < until or step >= last_step or slots >= span:
                break
            decoding, done_B, left = drop_unwanted(decoding)
            report(decoding, done_B)
            decoding, joined = take_new_rows(decoding, done_B, step, index)
            left = left or joined
            if not left:
                break
            take_newer_weights(step)
        if not left:
            break
    num_steps = int(jax.device_get(decoding.out.num_steps))
    collected.save(decoding.out, row_ids)
    steps_run = np.diff([*first_steps, num_steps]).tolist()
    return SamplerOutput(jnp.asarray(collected.tokens_BT), jnp.asarray(collected.logprobs_BT),
                         jnp.asarray(collected.lengths_B), jnp.asarray(collected.stopped_B), jnp.int32(num_steps),
                         tuple((rows, span, steps) for (rows, span), steps in zip(phases, steps_run)),
                         None if collected.experts_BTLk is None else jnp.asarray(collected.experts_BTLk),
                         prompt_experts_PULk, None if weights_now is None else jnp.asarray(
                             _token_versions(switches, collected.lengths_B, max_new_tokens, offsets)))
