"""KV-cache sampling: each distinct prompt prefilled once, then decode phases over a growing cache (pure, jitted).

Shape letters (docs/shape_letters.md): P distinct prompts (padded to a bucket), U prompt positions
(bucketed), B rows (prompt x sample, padded to a bucket), T new-token budget (bucketed), S cache slots,
V vocab, E stop (end) ids per row; L layers and k experts per token of a mixture (`record_experts`).

`generate` runs a few compiled programs from the host: `_prefill`, `_decode_phase` (a while_loop over a cache it
carries and updates in place) and between phases `_regrow` (the next span, dropping finished rows). Every
per-request knob is a per-row array and every shape a bucket, so requests with different settings share a batch
and a long run compiles a bounded set of programs. A row's draws depend only on its (seed, stream, sample) and
the step (`draws.row_keys`), never on the phases or on its batch-mates.

Between phases (on the host, outside every compiled program) `generate` asks its caller's `unwanted` hook which
rows nobody waits for any more: those rows are finished where they are, and once every row is, the batch ends
there instead of running its remaining phases. At the same boundaries its `weights_now` hook may hand it newer
weights of the same shapes (an in-flight weight update): the rows go on with them from there, over the KV cache
the earlier weights wrote (as PipelineRL's in-flight updates do), and `SamplerOutput.versions_BT` says which
weights sampled each token.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.kv_cache import (
    VALUE_ORDER,
    KVCache,
    cache_shardings,
    init_cache,
    key_slot_axis,
    split_cache,
)
from drgrpo_jax.models.params import param_specs
from drgrpo_jax.models.transformer import Transformer, layer_params, rope_for_layers
from drgrpo_jax.sampler.draws import row_keys, sample_step
from drgrpo_jax.sharding import ShardingRules, batch_sharding, logical_to_spec, named_sharding, place

__all__ = ["MIN_BUCKET", "RowRequest", "RowSettings", "SamplerBatch", "SamplerOutput", "SamplingParams",
           "batch_bucket", "bucket", "check_mesh", "compiled_programs", "generate", "make_batch", "mesh_rows",
           "place_batch", "span_schedule"]

# Size: one concept, the sampler's programs (prefill, decode phase, regrow) and the host loop that drives them: they
# share the state carried between them and what it records (tokens, log-probs, a mixture's experts), so a field of
# that state changes all of them at once.
MIN_BUCKET = 16  # smallest prompt / new-token bucket: tiny requests share one program
PREFILL_CHUNK = 1024  # prompt columns a prefill program writes: bounds its attention scores (sampler/memory.py)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (SGLang's names)."""

    max_new_tokens: int = 128  # budget of generated tokens, stop token included
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = off
    stop_token_ids: tuple[int, ...] = ()  # extra tokens that end a row (EOS always does, unless ignore_eos)
    ignore_eos: bool = False  # do not stop at the model's EOS tokens

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: must be an int >= 0, got {self.max_new_tokens!r}")
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature: must be finite and >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k: must be an int >= -1 (0 and -1 = off), got {self.top_k!r}")
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: must be non-negative ints, got {self.stop_token_ids!r}")


@dataclasses.dataclass(frozen=True)
class RowRequest:
    """One row to sample: a prompt, its settings, and the random stream it draws from."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int  # root seed of the request (uint32)
    stream: int = 0  # which prompt of the request (folded into the seed's key)
    sample: int = 0  # which of the n samples of that prompt (folded in after `stream`)
    return_routed_experts: bool = False  # a mixture's experts of each token it reads are wanted (`record_experts`)


ArrayT = TypeVar("ArrayT")  # what a batch holds: np.ndarray from make_batch, jax.Array under jit


@flax.struct.dataclass
class RowSettings(Generic[ArrayT]):
    """Per-row inputs of `generate` (what compaction keeps for the live rows)."""

    prompt_index_B: ArrayT  # int32: the row of SamplerBatch.prompt_ids_PU this row continues
    prompt_lengths_B: ArrayT  # int32 number of real prompt tokens
    max_new_tokens_B: ArrayT  # int32 budget (<= the static T)
    temperature_B: ArrayT  # float32, 0 = greedy
    top_k_B: ArrayT  # int32, 0 = off
    top_p_B: ArrayT  # float32, 1 = off
    stop_ids_BE: ArrayT  # int32, -1 = unused slot
    seeds_B: ArrayT  # uint32
    streams_B: ArrayT  # int32
    samples_B: ArrayT  # int32
    live_B: ArrayT  # bool, False = a padding row added for a static batch size


@flax.struct.dataclass
class SamplerBatch(Generic[ArrayT]):
    """Device inputs of one `generate` call: the distinct prompts, and the rows that continue them."""

    prompt_ids_PU: ArrayT  # int32, left-padded
    prompt_positions_PU: ArrayT  # int32, -1 on padding, 0.. on real tokens
    rows: RowSettings[ArrayT]


@flax.struct.dataclass
class SamplerOutput:
    """What `generate` returns; positions past a row's length hold pad id 0 and log-prob 0."""

    tokens_BT: jax.Array  # int32 sampled tokens (the stop token included)
    logprobs_BT: jax.Array  # float32 log-prob of each sampled token
    lengths_B: jax.Array  # int32 number of generated tokens
    stopped_B: jax.Array  # bool: ended on a stop/EOS token (else: ran out of budget)
    num_steps: jax.Array  # int32 decode iterations run (early exit shows here)
    # (rows, cache slots, decode iterations) of each phase run: what the steps cost (host-side, not traced).
    phases: tuple[tuple[int, int, int], ...] = flax.struct.field(pytree_node=False, default=())
    # `record_experts` (a mixture): the experts every layer chose for each token the model read, int32 (router
    # replay). Column t of a row: when its token t was fed back (the last sampled token never is: 0 there, as past
    # its length); each distinct prompt's (row b reads prompt rows.prompt_index_B[b]), left-padded (0) like the prompt.
    experts_BTLk: jax.Array | None = None
    prompt_experts_PULk: jax.Array | None = None
    # `weights_now`: int32, the index of the weights that sampled each token (0 = `generate`'s `state`, then the
    # hook's), -1 past a row's length.
    versions_BT: jax.Array | None = None


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum): the static size that n is padded to."""
    return 1 << (max(int(n), minimum, 1) - 1).bit_length()


def batch_bucket(n: int) -> int:
    """Static batch size for n rows (powers of two, starting at 1)."""
    return bucket(n, minimum=1)


def mesh_rows(n: int, data: int = 1) -> int:
    """Static row count for n rows split over `data` devices: `data` x the bucket of each device's share, so every
    device holds the same bucketed number of rows (`batch_bucket(n)` on one device)."""
    return data * batch_bucket(-(-int(n) // data))


# ---------------------------------------------------------------------------------------------
# A (data, tensor) mesh: the trainer's logical-axis rules (sharding.ShardingRules) place weights and cache
# ---------------------------------------------------------------------------------------------


def check_mesh(config: DecoderConfig, mesh: Mesh | None, field: str = "--mesh") -> None:
    """Refuses, before anything loads or compiles, a mesh whose `tensor` axis does not divide the model's heads,
    MLP or vocabulary (ValueError naming `field` and the array); the rules are the trainer's."""
    if mesh is None:
        return
    kv_axes = ("layers", "batch", None, "kv_heads", "head_dim")
    shapes = {**param_specs(config), "kv_cache": ((config.num_layers, mesh.shape["data"], 1, config.num_kv_heads,
                                                   config.head_dim), kv_axes)}
    try:
        for name, (shape, axes) in shapes.items():
            named_sharding(name, shape, axes, mesh)
    except ValueError as error:
        raise ValueError(f"{field}: {error}") from None


def place_batch(batch: SamplerBatch, mesh: Mesh | None) -> SamplerBatch:
    """The batch on the mesh: prompts and rows split over the rules' batch axes (`data`), the rest replicated."""
    if mesh is None:
        return batch
    return place(batch, batch_sharding(mesh))


def _rows_split(x: jax.Array, mesh: Mesh) -> jax.Array:
    """`x` [B, ...] with its rows on the rules' batch axes."""
    return jax.lax.with_sharding_constraint(x, batch_sharding(mesh))


def _constrain(decoding: _Decoding, mesh: Mesh | None) -> _Decoding:
    """The carried state pinned to the mesh: rows on `data`, the per-layer cache's heads on `tensor` (the trainer's
    rules), so every program keeps the same layout and the decode loop never regathers its cache."""
    if mesh is None:
        return decoding
    heads = NamedSharding(mesh, logical_to_spec(("batch", "kv_heads", None, None), ShardingRules()))
    cache = decoding.cache
    cache = KVCache(k=tuple(jax.lax.with_sharding_constraint(k, heads) for k in cache.k),
                    v=tuple(jax.lax.with_sharding_constraint(v, heads) for v in cache.v),
                    positions_BS=_rows_split(cache.positions_BS, mesh), length=cache.length)
    out = decoding.out
    out = dataclasses.replace(out, tokens_BT=_rows_split(out.tokens_BT, mesh),
                              logprobs_BT=_rows_split(out.logprobs_BT, mesh),
                              lengths_B=_rows_split(out.lengths_B, mesh), stopped_B=_rows_split(out.stopped_B, mesh),
                              experts_BTLk=None if out.experts_BTLk is None else _rows_split(out.experts_BTLk, mesh))
    return dataclasses.replace(decoding, cache=cache, tokens_B=_rows_split(decoding.tokens_B, mesh),
                               done_B=_rows_split(decoding.done_B, mesh), out=out,
                               rows=jax.tree.map(lambda x: _rows_split(x, mesh), decoding.rows),
                               keys_B=_rows_split(decoding.keys_B, mesh))


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


def _left_pad(prompts: Sequence[tuple[int, ...]], num_prompts: int, prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt ids and positions [num_prompts, prompt_len], left-padded (host, numpy)."""
    ids = np.zeros((num_prompts, prompt_len), np.int32)
    # A padding prompt is one real token at position 0 so its attention is never empty (no NaN).
    pos = np.full((num_prompts, prompt_len), -1, np.int32)
    pos[:, -1] = 0
    for p, prompt in enumerate(prompts):
        ids[p, prompt_len - len(prompt):] = prompt
        pos[p, :] = -1
        pos[p, prompt_len - len(prompt):] = np.arange(len(prompt))
    return ids, pos


def make_batch(rows: Sequence[RowRequest], eos_token_ids: Sequence[int], *, batch_size: int, prompt_len: int,
               num_prompts: int | None = None) -> SamplerBatch[np.ndarray]:
    """Left-pads the distinct prompts of `rows` and their per-row settings into a `SamplerBatch` (host, numpy).

    Rows with identical prompt ids share one prompt row (prefilled once). `num_prompts`: the static number of
    prompt rows; None = `batch_bucket` of the distinct prompts (at most batch_size).
    """
    if not rows:
        raise ValueError("rows: need at least one row")
    if len(rows) > batch_size:
        raise ValueError(f"batch_size: {batch_size} is smaller than the {len(rows)} rows")
    for b, row in enumerate(rows):
        if not 0 < len(row.prompt_ids) <= prompt_len:
            raise ValueError(f"prompt_ids: row {b} has {len(row.prompt_ids)} tokens, must be in [1, {prompt_len}]")
    prompts = list(dict.fromkeys(tuple(r.prompt_ids) for r in rows))
    if num_prompts is None:
        num_prompts = min(batch_bucket(len(prompts)), batch_size)
    if len(prompts) > num_prompts:
        raise ValueError(f"num_prompts: {num_prompts} is smaller than the {len(prompts)} distinct prompts")
    prompt_row = {prompt: p for p, prompt in enumerate(prompts)}
    num_stop = max(len(r.params.stop_token_ids) + (0 if r.params.ignore_eos else len(eos_token_ids)) for r in rows)
    settings = RowSettings(
        prompt_index_B=np.zeros(batch_size, np.int32), prompt_lengths_B=np.ones(batch_size, np.int32),
        max_new_tokens_B=np.zeros(batch_size, np.int32), temperature_B=np.zeros(batch_size, np.float32),
        top_k_B=np.zeros(batch_size, np.int32), top_p_B=np.ones(batch_size, np.float32),
        # The stop-id width is bucketed too: a request with one more stop token must not recompile.
        stop_ids_BE=np.full((batch_size, bucket(num_stop, minimum=4)), -1, np.int32),
        seeds_B=np.zeros(batch_size, np.uint32), streams_B=np.zeros(batch_size, np.int32),
        samples_B=np.zeros(batch_size, np.int32), live_B=np.zeros(batch_size, bool))
    padding_prompt_length = len(prompts[0])  # padding rows continue prompt 0 (they are done from the start)
    settings.prompt_lengths_B[:] = padding_prompt_length
    for b, row in enumerate(rows):
        p = row.params
        settings.prompt_index_B[b] = prompt_row[tuple(row.prompt_ids)]
        settings.prompt_lengths_B[b] = len(row.prompt_ids)
        settings.max_new_tokens_B[b] = p.max_new_tokens
        settings.temperature_B[b] = p.temperature
        settings.top_k_B[b] = max(p.top_k, 0)
        settings.top_p_B[b] = p.top_p
        stops = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(eos_token_ids))
        settings.stop_ids_BE[b, :len(stops)] = stops
        settings.seeds_B[b] = np.uint32(row.seed & 0xFFFFFFFF)
        settings.streams_B[b] = row.stream
        settings.samples_B[b] = row.sample
        settings.live_B[b] = True
    ids, pos = _left_pad(prompts, num_prompts, prompt_len)
    return SamplerBatch(ids, pos, settings)


@flax.struct.dataclass
class _Decoding:
    """What the programs carry from one to the next: every per-row field follows the kept rows."""

    step: jax.Array  # int32 index of the token about to be written
    cache: KVCache  # split per layer (`kv_cache.split_cache`), S = the phase's span
    tokens_B: jax.Array  # last sampled token of every row
    done_B: jax.Array  # bool: row finished (or a padding row)
    out: SamplerOutput  # [B, T]
    rows: RowSettings[jax.Array]
    keys_B: jax.Array  # each row's random key (`row_keys`)


def _draw(decoding: _Decoding, logits_BV: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's token at `decoding.step` and its log-prob."""
    rows = decoding.rows
    return sample_step(logits_BV, decoding.keys_B, decoding.step, rows.temperature_B, rows.top_k_B, rows.top_p_B)


def _record(decoding: _Decoding, tokens_B: jax.Array, logprobs_B: jax.Array) -> _Decoding:
    """Writes the tokens sampled at `decoding.step` for live rows and updates who is done."""
    active_B = ~decoding.done_B
    out = decoding.out
    column = decoding.step
    tokens_BT = jax.lax.dynamic_update_slice(out.tokens_BT, jnp.where(active_B, tokens_B, 0)[:, None], (0, column))
    logprobs_BT = jax.lax.dynamic_update_slice(
        out.logprobs_BT, jnp.where(active_B, logprobs_B, 0.0)[:, None], (0, column))
    lengths_B = out.lengths_B + active_B.astype(jnp.int32)
    hit_stop_B = active_B & jnp.any(tokens_B[:, None] == decoding.rows.stop_ids_BE, axis=-1)
    done_B = decoding.done_B | hit_stop_B | (lengths_B >= decoding.rows.max_new_tokens_B)
    out = dataclasses.replace(out, tokens_BT=tokens_BT, logprobs_BT=logprobs_BT, lengths_B=lengths_B,
                              stopped_B=out.stopped_B | hit_stop_B)
    return dataclasses.replace(decoding, step=decoding.step + 1, tokens_B=tokens_B, out=out, done_B=done_B)


def _record_experts(decoding: _Decoding, experts_BLk: jax.Array | None) -> _Decoding:
    """Writes the experts that read each live row's token of step - 1 (fed back at this step) into column step - 1
    (no-op unless the sampler records experts)."""
    out = decoding.out
    if out.experts_BTLk is None or experts_BLk is None:
        return decoding
    column = decoding.step - 1
    old_BLk = jax.lax.dynamic_index_in_dim(out.experts_BTLk, column, axis=1, keepdims=False)
    new_BLk = jnp.where(decoding.done_B[:, None, None], old_BLk, experts_BLk)
    experts_BTLk = jax.lax.dynamic_update_index_in_dim(out.experts_BTLk, new_BLk, column, axis=1)
    return dataclasses.replace(decoding, out=dataclasses.replace(out, experts_BTLk=experts_BTLk))


def _take_and_grow(cache: KVCache, index_B: jax.Array, num_slots: int) -> KVCache:
    """Rows `index_B` of a split cache, its slot axis padded with empty slots to `num_slots`."""
    extra = num_slots - cache.positions_BS.shape[1]

    def grow(x: jax.Array, slot_axis: int) -> jax.Array:
        return jnp.pad(x[index_B], [(0, extra if axis == slot_axis else 0) for axis in range(x.ndim)])

    positions_BS = jnp.pad(cache.positions_BS[index_B], ((0, 0), (0, extra)), constant_values=-1)
    keys = tuple(grow(k, key_slot_axis(k.dtype)) for k in cache.k)
    values = tuple(grow(v, VALUE_ORDER.index(1)) for v in cache.v)
    return KVCache(k=keys, v=values, positions_BS=positions_BS, length=cache.length)


def _prompt_cache(model: Transformer, num_prompts: int, prompt_len: int, cache_dtype: jnp.dtype,
                  mesh: Mesh | None) -> KVCache:
    """The distinct prompts' empty cache, split per layer (prompts on `data`, heads on `tensor`)."""
    cache = init_cache(model.config, num_prompts, prompt_len, dtype=cache_dtype)
    if mesh is not None:
        cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))
    return split_cache(cache)


@functools.partial(jax.jit, static_argnames=("graphdef", "prompt_len", "cache_dtype", "mesh"))
def _prefill_part(graphdef: nnx.GraphDef, state: nnx.State, ids_PC: jax.Array, positions_PC: jax.Array,
                  cache: KVCache | None, *, prompt_len: int, cache_dtype: jnp.dtype, mesh: Mesh | None = None
                  ) -> tuple[KVCache, jax.Array | None]:
    """The prompts' cache (None: a new one of `prompt_len` slots) with the next PREFILL_CHUNK columns written, and a
    mixture's experts of those columns [P, C, L, k] (unused ones XLA drops)."""
    model = nnx.merge(graphdef, state)
    if cache is None:
        cache = _prompt_cache(model, ids_PC.shape[0], prompt_len, cache_dtype, mesh)
    _, cache, experts_PCLk = model.decode_routed(ids_PC, positions_PC, cache,
                                                 layer_params(model.blocks.arrays(), model.config.num_layers))
    return (cache if mesh is None else jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh)),
            experts_PCLk)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "num_slots", "cache_dtype", "mesh",
                                             "done", "record_experts"))
def _prefill(graphdef: nnx.GraphDef, state: nnx.State, batch: SamplerBatch[jax.Array], *, max_new_tokens: int,
             num_slots: int, cache_dtype: jnp.dtype, mesh: Mesh | None = None, cache: KVCache | None = None,
             done: int = 0, record_experts: bool = False) -> _Decoding:
    """Prefills each distinct prompt once, copies its slots to its rows (a cache of `num_slots`), samples token 0.
    `cache`: the prompts' cache with its first `done` columns written already (`_prefill_part`), the rest here.
    `record_experts`: the output carries the experts of prompt columns `done` on and a buffer for the rows'."""
    model = nnx.merge(graphdef, state)
    if record_experts and not model.config.moe:
        raise ValueError(f"record_experts: {model.config.family} has no router (a dense MLP in every layer)")
    num_prompts, prompt_len = batch.prompt_ids_PU.shape
    layers = layer_params(model.blocks.arrays(), model.config.num_layers)
    if cache is None:
        cache = _prompt_cache(model, num_prompts, prompt_len, cache_dtype, mesh)
    # Prefill all but the last prompt column (its logits are unused, so XLA drops the unembedding),
    # then feed the last column alone: only [P, 1, V] logits are ever made, not [P, U, V].
    prompt_experts = []
    if prompt_len - done > 1:
        _, cache, experts_PULk = model.decode_routed(batch.prompt_ids_PU[:, done:-1],
                                                     batch.prompt_positions_PU[:, done:-1], cache, layers)
        prompt_experts.append(experts_PULk)
    logits_P1V, cache, experts_P1Lk = model.decode_routed(batch.prompt_ids_PU[:, -1:],
                                                          batch.prompt_positions_PU[:, -1:], cache, layers)
    prompt_experts.append(experts_P1Lk)
    rows = batch.rows
    num_rows = rows.live_B.shape[0]
    config = model.config
    out = SamplerOutput(tokens_BT=jnp.zeros((num_rows, max_new_tokens), jnp.int32),
                        logprobs_BT=jnp.zeros((num_rows, max_new_tokens), jnp.float32),
                        lengths_B=jnp.zeros((num_rows,), jnp.int32), stopped_B=jnp.zeros((num_rows,), bool),
                        num_steps=jnp.int32(0))
    if record_experts:
        out = dataclasses.replace(
            out, prompt_experts_PULk=jnp.concatenate(prompt_experts, axis=1),
            experts_BTLk=jnp.zeros((num_rows, max_new_tokens, config.num_layers, config.experts_per_token), jnp.int32))
    decoding = _Decoding(step=jnp.int32(0), cache=_take_and_grow(cache, rows.prompt_index_B, num_slots),
                         tokens_B=jnp.zeros((num_rows,), jnp.int32), done_B=~rows.live_B | (rows.max_new_tokens_B <= 0),
                         out=out, rows=rows, keys_B=row_keys(rows.seeds_B, rows.streams_B, rows.samples_B))
    decoding = _constrain(decoding, mesh)
    tokens_B, logprobs_B = _draw(decoding, logits_P1V[rows.prompt_index_B, 0])
    return _constrain(_record(decoding, tokens_B, logprobs_B), mesh)


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh"), donate_argnames=("decoding",))
def _decode_phase(graphdef: nnx.GraphDef, state: nnx.State, decoding: _Decoding, until_step: jax.Array,
                  mesh: Mesh | None = None) -> _Decoding:
    """Decodes until every row is done, the budget is spent, the cache's slots are full or the step count reaches
    `until_step` (traced: pausing a phase to ask the host is the same program; one loop per shape).

    Weights and cache come split per layer and the RoPE tables are made before the loop, so its body reads them
    in place (`Transformer.decode`); the cache is the loop's carry, updated in place and donated.
    """
    model = nnx.merge(graphdef, state)
    layers = layer_params(model.blocks.arrays(), model.config.num_layers)
    num_slots = decoding.cache.positions_BS.shape[1]
    max_new_tokens = decoding.out.tokens_BT.shape[1]
    first = decoding.step
    # RoPE tables of every step this phase can run (fewer than num_slots), before the loop. The position of
    # the token fed at step s is prompt length + s - 1.
    positions_SB1 = decoding.rows.prompt_lengths_B[None, :, None] + (first + jnp.arange(num_slots))[:, None, None] - 1
    rope_S = jax.vmap(functools.partial(rope_for_layers, model.config))(positions_SB1)

    def keep_going(d: _Decoding) -> jax.Array:
        return (d.step < jnp.minimum(max_new_tokens, until_step)) & (d.cache.length < num_slots) & ~jnp.all(d.done_B)

    def decode_one(d: _Decoding) -> _Decoding:
        positions_B1 = (d.rows.prompt_lengths_B + d.step - 1)[:, None]
        rope = jax.tree.map(lambda table_SB1H: table_SB1H[d.step - first], rope_S)
        logits_B1V, cache, experts_B1Lk = model.decode_routed(d.tokens_B[:, None], positions_B1, d.cache, layers, rope)
        d = _record_experts(d, None if experts_B1Lk is None else experts_B1Lk[:, 0])
        d = dataclasses.replace(d, cache=cache, out=dataclasses.replace(d.out, num_steps=d.out.num_steps + 1))
        return _constrain(_record(d, *_draw(d, logits_B1V[:, 0])), mesh)

    return jax.lax.while_loop(keep_going, decode_one, _constrain(decoding, mesh))


@functools.partial(jax.jit, static_argnames=("num_slots", "mesh"))
def _regrow(decoding: _Decoding, index_B: jax.Array, *, num_slots: int, mesh: Mesh | None = None) -> _Decoding:
    """Keeps rows `index_B` (all of them, or the live ones) with the cache grown to `num_slots` slots."""
    def take(x):
        return x[index_B]

    out = decoding.out
    return _constrain(dataclasses.replace(
        decoding, cache=_take_and_grow(decoding.cache, index_B, num_slots), tokens_B=take(decoding.tokens_B),
        done_B=take(decoding.done_B), rows=jax.tree.map(take, decoding.rows), keys_B=take(decoding.keys_B),
        out=dataclasses.replace(out, tokens_BT=take(out.tokens_BT), logprobs_BT=take(out.logprobs_BT),
                                lengths_B=take(out.lengths_B), stopped_B=take(out.stopped_B),
                                experts_BTLk=None if out.experts_BTLk is None else take(out.experts_BTLk))), mesh)


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


def _token_versions(switches: Sequence[tuple[int, int]], lengths_B: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """int32 [B, T]: the weights' index that sampled each token, from the (first column, index) of each swap (every
    row writes the same column at a step), -1 past a row's length."""
    version_T = np.zeros(max_new_tokens, np.int32)
    for first, version in switches:
        version_T[first:] = version
    return np.where(np.arange(max_new_tokens) < lengths_B[:, None], version_T, -1).astype(np.int32)


def generate(graphdef: nnx.GraphDef, state: nnx.State, batch: SamplerBatch, *, max_new_tokens: int,
             cache_dtype: jnp.dtype = jnp.float32, compact: bool = True,
             unwanted: Callable[[], Sequence[bool]] | None = None, check_every: int | None = None,
             mesh: Mesh | None = None, record_experts: bool = False,
             weights_now: Callable[[], tuple[nnx.State, int]] | None = None) -> SamplerOutput:
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
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    if check_every is not None and check_every < 1:
        raise ValueError(f"check_every: must be >= 1 or None, got {check_every}")
    num_rows, prompt_len = batch.rows.live_B.shape[0], batch.prompt_ids_PU.shape[1]
    data = 1 if mesh is None else mesh.shape["data"]
    if num_rows % data or batch.prompt_ids_PU.shape[0] % data:
        raise ValueError(f"batch: {num_rows} rows and {batch.prompt_ids_PU.shape[0]} prompts must both divide over "
                         f"data={data} devices (make_batch with mesh_rows)")
    spans = span_schedule(prompt_len, max_new_tokens)
    placed = place_batch(batch, mesh)
    cache, done = None, 0
    experts_Lk: tuple[int, int] | None = None  # (L, k) when recording
    prompt_parts: list[Any] = []  # the experts [P, C, L, k] of the chunked prompt columns (None unless a mixture)
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
            cache, experts_PCLk = _prefill_part(graphdef, state, placed.prompt_ids_PU[:, columns],
                                  placed.prompt_positions_PU[:, columns], cache, prompt_len=prompt_len,
                                  cache_dtype=cache_dtype, mesh=mesh)
            prompt_parts.append(experts_PCLk)
            done = start + PREFILL_CHUNK
    decoding = _prefill(graphdef, state, placed, max_new_tokens=max_new_tokens,
                        num_slots=(spans or (prompt_len,))[0], cache_dtype=cache_dtype, mesh=mesh, cache=cache,
                        done=done, record_experts=record_experts)
    prompt_experts_PULk = None
    if record_experts:
        prompt_experts_PULk = jnp.concatenate([*prompt_parts, decoding.out.prompt_experts_PULk], axis=1)
        prompt_experts_PULk = jnp.where(placed.prompt_positions_PU[:, :, None, None] >= 0, prompt_experts_PULk, 0)
        decoding = dataclasses.replace(decoding, out=dataclasses.replace(decoding.out, prompt_experts_PULk=None))
    collected, row_ids = _Collected(num_rows, max_new_tokens, experts_Lk), np.arange(num_rows)
    phases: list[tuple[int, int]] = []  # (rows, slots) of each phase run
    first_steps: list[int] = []  # decode iterations run before each phase
    pause = max_new_tokens if (unwanted is None and weights_now is None) or check_every is None else check_every
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

    def drop_unwanted(decoding: _Decoding) -> tuple[_Decoding, np.ndarray, bool]:
        """(decoding with the unwanted rows finished, done_B, whether any row is left)."""
        done_B = jax.device_get(decoding.done_B)
        dropped_B = _unwanted_mask(unwanted, num_rows)[row_ids] & (row_ids >= 0) & ~done_B
        if dropped_B.any():  # finished like a row that hit its budget: the same shapes, so no new program
            done_B = done_B | dropped_B
            # On the device array, so the flag keeps its placement (a new placement would be a new program).
            decoding = dataclasses.replace(decoding, done_B=decoding.done_B | jnp.asarray(dropped_B))
        return decoding, done_B, not done_B.all()

    for index, span in enumerate(spans):
        decoding, done_B, left = drop_unwanted(decoding)
        if not left:
            break
        steps, step = (int(x) for x in jax.device_get((decoding.out.num_steps, decoding.step)))
        take_newer_weights(step)
        if index:
            kept = _kept_rows(done_B, data) if compact else None
            if kept is not None:
                collected.save(decoding.out, row_ids)  # the rows that leave are finished: their outputs are final
                row_ids = np.where(~done_B[kept], row_ids[kept], -1)
            decoding = _regrow(decoding, jnp.arange(len(row_ids)) if kept is None else jnp.asarray(kept),
                               num_slots=span, mesh=mesh)
        phases.append((len(row_ids), span))
        first_steps.append(steps)
        while True:  # one pass unless paused every `check_every` steps; a pass that ends short ends the phase
            until = step + pause
            decoding = _decode_phase(graphdef, state, decoding, np.int32(min(until, max_new_tokens)), mesh=mesh)
            step, slots = (int(x) for x in jax.device_get((decoding.step, decoding.cache.length)))
            if step < until or step >= max_new_tokens or slots >= span:
                break
            decoding, done_B, left = drop_unwanted(decoding)
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
                             _token_versions(switches, collected.lengths_B, max_new_tokens)))


def compiled_programs() -> int:
    """How many sampler programs are compiled so far (prefill, decode phases, regrows): one set per batch shape."""
    return sum(f._cache_size() for f in (_prefill, _prefill_part, _decode_phase, _regrow))  # type: ignore[attr-defined]
