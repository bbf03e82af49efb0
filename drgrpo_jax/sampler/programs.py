"""The sampler's compiled programs, pure and jitted: `prefill_part` (a long prompt's next columns), `prefill` (each
distinct prompt once, its slots copied to its rows, token 0 drawn), `decode_phase` (a while_loop over a cache it
carries and updates in place) and `regrow` (the next span, dropping finished rows); the state they carry
(`Decoding`), its layout on a (data, tensor) mesh, and the count of programs compiled.

Shape letters (docs/shape_letters.md): P distinct prompts, U prompt positions, W the prompt columns of one
prefill program (PREFILL_CHUNK at most), B rows, T new-token budget, S cache slots, V vocab; L layers and k
experts per token of a mixture (`record_experts`).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.kv_cache import (
    VALUE_ORDER,
    KVCache,
    bits,
    cache_shardings,
    init_cache,
    key_slot_axis,
    split_cache,
    unbits,
)
from drgrpo_jax.models.params import param_specs
from drgrpo_jax.models.transformer import Transformer, layer_params, rope_for_layers
from drgrpo_jax.sampler.batch import RowSettings, SamplerBatch, SamplerOutput
from drgrpo_jax.sampler.draws import row_keys, sample_step
from drgrpo_jax.sharding import ShardingRules, batch_sharding, logical_to_spec, named_sharding, place

__all__ = ["PREFILL_CHUNK", "Decoding", "admit", "check_mesh", "compiled_programs", "decode_phase",
           "drop_compiled_programs", "place_batch", "prefill", "prefill_part", "regrow"]

PREFILL_CHUNK = 1024  # prompt columns a prefill program writes: bounds its attention scores (sampler/memory.py)
# The sampler's own count of its compiled programs: one name per program traced since the last drop (JAX traces a
# jitted function once per shape it compiles it for). list.append is atomic, so the worker threads may share it.
_traced: list[str] = []


@flax.struct.dataclass
class Decoding:
    """What the programs carry from one to the next: every per-row field follows the kept rows."""

    step: jax.Array  # int32 index of the token about to be written
    cache: KVCache  # split per layer (`kv_cache.split_cache`), S = the phase's span
    tokens_B: jax.Array  # last sampled token of every row
    done_B: jax.Array  # bool: row finished (or a padding row)
    out: SamplerOutput  # [B, T]
    rows: RowSettings[jax.Array]
    keys_B: jax.Array  # each row's random key (`row_keys`)
    # int32: the batch step at which each row's token 0 counts as drawn (0, or where `admit` brought it in): its own
    # step, token column and position are the batch's less this, so a row's draws never depend on when it joined
    offsets_B: jax.Array


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


def _constrain(decoding: Decoding, mesh: Mesh | None) -> Decoding:
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
                               keys_B=_rows_split(decoding.keys_B, mesh),
                               offsets_B=_rows_split(decoding.offsets_B, mesh))


def _draw(decoding: Decoding, logits_BV: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's token at its own step and its log-prob."""
    rows = decoding.rows
    return sample_step(logits_BV, decoding.keys_B, decoding.step - decoding.offsets_B, rows.temperature_B,
                       rows.top_k_B, rows.top_p_B)


def _record(decoding: Decoding, tokens_B: jax.Array, logprobs_B: jax.Array) -> Decoding:
    """Writes the tokens sampled at each row's own step for live rows and updates who is done."""
    active_B = ~decoding.done_B
    out = decoding.out
    # Each row's own column (a finished row's lies past its length, or past T: dropped), as one scatter.
    rows_B, column_B = jnp.arange(active_B.shape[0]), decoding.step - decoding.offsets_B
    tokens_BT = out.tokens_BT.at[rows_B, column_B].set(jnp.where(active_B, tokens_B, 0), mode="drop")
    logprobs_BT = out.logprobs_BT.at[rows_B, column_B].set(jnp.where(active_B, logprobs_B, 0.0), mode="drop")
    lengths_B = out.lengths_B + active_B.astype(jnp.int32)
    hit_stop_B = active_B & jnp.any(tokens_B[:, None] == decoding.rows.stop_ids_BE, axis=-1)
    done_B = decoding.done_B | hit_stop_B | (lengths_B >= decoding.rows.max_new_tokens_B)
    out = dataclasses.replace(out, tokens_BT=tokens_BT, logprobs_BT=logprobs_BT, lengths_B=lengths_B,
                              stopped_B=out.stopped_B | hit_stop_B)
    return dataclasses.replace(decoding, step=decoding.step + 1, tokens_B=tokens_B, out=out, done_B=done_B)


def _record_experts(decoding: Decoding, experts_BLk: jax.Array | None) -> Decoding:
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
def prefill_part(graphdef: nnx.GraphDef, state: nnx.State, ids_PW: jax.Array, positions_PW: jax.Array,
                 cache: KVCache | None, *, prompt_len: int, cache_dtype: jnp.dtype, mesh: Mesh | None = None
                 ) -> tuple[KVCache, jax.Array | None]:
    """The prompts' cache (None: a new one of `prompt_len` slots) with the next PREFILL_CHUNK columns written, and a
    mixture's experts of those columns [P, W, L, k] (unused ones XLA drops)."""
    _count_trace("prefill_part")
    model = nnx.merge(graphdef, state)
    if cache is None:
        cache = _prompt_cache(model, ids_PW.shape[0], prompt_len, cache_dtype, mesh)
    _, cache, experts_PWLk = model.decode_routed(ids_PW, positions_PW, cache,
                                                 layer_params(model.blocks.arrays(), model.config.num_layers))
    return (cache if mesh is None else jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh)),
            experts_PWLk)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "num_slots", "cache_dtype", "mesh",
                                             "done", "record_experts"))
def prefill(graphdef: nnx.GraphDef, state: nnx.State, batch: SamplerBatch[jax.Array], *, max_new_tokens: int,
            num_slots: int, cache_dtype: jnp.dtype, mesh: Mesh | None = None, cache: KVCache | None = None,
            done: int = 0, record_experts: bool = False) -> Decoding:
    """Prefills each distinct prompt once, copies its slots to its rows (a cache of `num_slots`), samples token 0.
    `cache`: the prompts' cache with its first `done` columns written already (`prefill_part`), the rest here.
    `record_experts`: the output carries the experts of prompt columns `done` on and a buffer for the rows'."""
    _count_trace("prefill")
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
    decoding = Decoding(step=jnp.int32(0), cache=_take_and_grow(cache, rows.prompt_index_B, num_slots),
                        tokens_B=jnp.zeros((num_rows,), jnp.int32), done_B=~rows.live_B | (rows.max_new_tokens_B <= 0),
                        out=out, rows=rows, keys_B=row_keys(rows.seeds_B, rows.streams_B, rows.samples_B),
                        offsets_B=jnp.zeros((num_rows,), jnp.int32))
    decoding = _constrain(decoding, mesh)
    tokens_B, logprobs_B = _draw(decoding, logits_P1V[rows.prompt_index_B, 0])
    return _constrain(_record(decoding, tokens_B, logprobs_B), mesh)


@functools.partial(jax.jit, static_argnames=("graphdef", "mesh"), donate_argnames=("decoding",))
def decode_phase(graphdef: nnx.GraphDef, state: nnx.State, decoding: Decoding, until_step: jax.Array,
                 mesh: Mesh | None = None) -> Decoding:
    """Decodes until every row is done, the budget is spent, the cache's slots are full or the step count reaches
    `until_step` (traced: pausing a phase to ask the host is the same program; one loop per shape).

    Weights and cache come split per layer and the RoPE tables are made before the loop, so its body reads them
    in place (`Transformer.decode`); the cache is the loop's carry, updated in place and donated.
    """
    _count_trace("decode_phase")
    model = nnx.merge(graphdef, state)
    layers = layer_params(model.blocks.arrays(), model.config.num_layers)
    num_slots = decoding.cache.positions_BS.shape[1]
    max_new_tokens = decoding.out.tokens_BT.shape[1]
    first = decoding.step
    # RoPE tables of every step this phase can run (fewer than num_slots), before the loop. The position of
    # the token a row is fed at its own step s is its prompt length + s - 1.
    base_B = decoding.rows.prompt_lengths_B - decoding.offsets_B
    positions_SB1 = base_B[None, :, None] + (first + jnp.arange(num_slots))[:, None, None] - 1
    rope_S = jax.vmap(functools.partial(rope_for_layers, model.config))(positions_SB1)
    # Rows brought in by `admit` run past the batch's T steps; every row stops itself at its budget.
    last_step = max_new_tokens + jnp.max(decoding.offsets_B)

    def keep_going(d: Decoding) -> jax.Array:
        return (d.step < jnp.minimum(last_step, until_step)) & (d.cache.length < num_slots) & ~jnp.all(d.done_B)

    def decode_one(d: Decoding) -> Decoding:
        positions_B1 = (base_B + d.step - 1)[:, None]
        rope = jax.tree.map(lambda table_SB1H: table_SB1H[d.step - first], rope_S)
        logits_B1V, cache, experts_B1Lk = model.decode_routed(d.tokens_B[:, None], positions_B1, d.cache, layers, rope)
        d = _record_experts(d, None if experts_B1Lk is None else experts_B1Lk[:, 0])
        d = dataclasses.replace(d, cache=cache, out=dataclasses.replace(d.out, num_steps=d.out.num_steps + 1))
        return _constrain(_record(d, *_draw(d, logits_B1V[:, 0])), mesh)

    return jax.lax.while_loop(keep_going, decode_one, _constrain(decoding, mesh))


@functools.partial(jax.jit, static_argnames=("num_slots", "mesh"))
def regrow(decoding: Decoding, index_B: jax.Array, *, num_slots: int, mesh: Mesh | None = None) -> Decoding:
    """Keeps rows `index_B` (all of them, or the live ones) with the cache grown to `num_slots` slots."""
    _count_trace("regrow")
    def take(x):
        return x[index_B]

    out = decoding.out
    return _constrain(dataclasses.replace(
        decoding, cache=_take_and_grow(decoding.cache, index_B, num_slots), tokens_B=take(decoding.tokens_B),
        done_B=take(decoding.done_B), rows=jax.tree.map(take, decoding.rows), keys_B=take(decoding.keys_B),
        offsets_B=take(decoding.offsets_B),
        out=dataclasses.replace(out, tokens_BT=take(out.tokens_BT), logprobs_BT=take(out.logprobs_BT),
                                lengths_B=take(out.lengths_B), stopped_B=take(out.stopped_B),
                                experts_BTLk=None if out.experts_BTLk is None else take(out.experts_BTLk))), mesh)


def _put_rows(buffer: jax.Array, into_J: jax.Array, fresh: jax.Array, axis: int | None = None) -> jax.Array:
    """`buffer` with rows `into_J` (past the end: dropped) set to `fresh`; along `axis`, only its first entries."""
    index: list = [into_J] + [slice(None)] * (buffer.ndim - 1)
    if axis is not None:
        index[axis] = slice(0, fresh.shape[axis])
    return buffer.at[tuple(index)].set(fresh, mode="drop")


def _put_slots(buffer: jax.Array, into_J: jax.Array, fresh: jax.Array, axis: int) -> jax.Array:
    """`_put_rows` for a cache buffer: its first slots along `axis`, in place (`bits`)."""
    return unbits(_put_rows(bits(buffer), into_J, bits(fresh.astype(buffer.dtype)), axis), buffer.dtype)


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_dtype", "mesh"), donate_argnames=("decoding",))
def admit(graphdef: nnx.GraphDef, state: nnx.State, decoding: Decoding, batch: SamplerBatch[jax.Array],
          into_J: jax.Array, *, cache_dtype: jnp.dtype, mesh: Mesh | None = None) -> Decoding:
    """Prefills `batch`'s rows (its prompts as wide as the running batch's prompt slots, its budgets within its T),
    draws their token 0 and puts them in the running batch's rows `into_J` (finished ones; past the end for
    `batch`'s padding rows): their prompts' slots, no other slot, and their settings, keys and outputs; their own
    step counts from 0 (`offsets_B`), so each draws what it would alone."""
    _count_trace("admit")
    num_slots = batch.prompt_ids_PU.shape[1]
    fresh = prefill(graphdef, state, batch, max_new_tokens=decoding.out.tokens_BT.shape[1], num_slots=num_slots,
                    cache_dtype=cache_dtype, mesh=mesh)
    cache = decoding.cache
    spare = cache.positions_BS.shape[1] - num_slots
    positions_JS = jnp.pad(fresh.cache.positions_BS, ((0, 0), (0, spare)), constant_values=-1)
    key_axis = key_slot_axis(cache.k[0].dtype)
    cache = KVCache(k=tuple(_put_slots(k, into_J, f, key_axis) for k, f in zip(cache.k, fresh.cache.k)),
                    v=tuple(_put_slots(v, into_J, f, VALUE_ORDER.index(1)) for v, f in zip(cache.v, fresh.cache.v)),
                    positions_BS=_put_rows(cache.positions_BS, into_J, positions_JS), length=cache.length)
    out, new = decoding.out, fresh.out
    out = dataclasses.replace(out, tokens_BT=_put_rows(out.tokens_BT, into_J, new.tokens_BT),
                              logprobs_BT=_put_rows(out.logprobs_BT, into_J, new.logprobs_BT),
                              lengths_B=_put_rows(out.lengths_B, into_J, new.lengths_B),
                              stopped_B=_put_rows(out.stopped_B, into_J, new.stopped_B))
    joined = dataclasses.replace(
        decoding, cache=cache, out=out, tokens_B=_put_rows(decoding.tokens_B, into_J, fresh.tokens_B),
        done_B=_put_rows(decoding.done_B, into_J, fresh.done_B),
        rows=jax.tree.map(lambda x, f: _put_rows(x, into_J, f), decoding.rows, fresh.rows),
        keys_B=_put_rows(decoding.keys_B, into_J, fresh.keys_B),
        offsets_B=_put_rows(decoding.offsets_B, into_J, jnp.broadcast_to(decoding.step - 1, into_J.shape)))
    return _constrain(joined, mesh)


def _count_trace(program: str) -> None:
    """Counts one compiled program: called in a program's body, which runs only while JAX traces it."""
    _traced.append(program)


def compiled_programs() -> int:
    """How many sampler programs are compiled and kept (prefill, decode phases, regrows): one set per batch shape.
    Only `drop_compiled_programs` resets it: a `jax.clear_caches` called elsewhere leaves it as it was."""
    return len(_traced)


def drop_compiled_programs() -> int:
    """Drops every program JAX has compiled (`jax.clear_caches`: the sampler's and every other module's) and
    returns how many were the sampler's. The caller makes sure no program runs meanwhile."""
    dropped = len(_traced)
    jax.clear_caches()
    _traced.clear()
    return dropped
