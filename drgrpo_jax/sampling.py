"""KV-cache sampling: left-padded prompt batches, one prefill, a compiled decode loop (pure, jitted).

Shape letters (the README's glossary): B rows (prompt x sample, padded to a bucket), U prompt positions
(bucketed), T new-token budget (bucketed), V vocab, E stop (end) ids per row, J vocab chunks, W vocab ids
per chunk.

One call of `generate` is one XLA program: prefill of the whole padded prompt batch, then a
`lax.while_loop` that decodes one token per row per iteration and stops as soon as every row has
finished. The KV cache is an explicit pytree that never leaves the program: the loop carries it,
so XLA updates it in place every step (what donating it to a per-step jit would buy, without a
host round trip per token). Weights and cache are split per layer once, before the prefill, and
every step's RoPE tables computed before the loop, so the loop body (30 unrolled layers for
SmolLM2) reads weights and cache in place (see `Transformer.decode`). Every per-request knob
(temperature, top-k, top-p, budget, stop ids, seed) is a per-row array, so requests with different
settings share a batch and a program; only (B, U, T) are static and each is rounded up to a power
of two, so a long run compiles a handful of programs.

Log-probabilities are those of the sampled token under softmax(logits / temperature) over the
whole vocabulary (before top-k/top-p truncation): the definition the trainer's
`drgrpo_jax.models.logprobs.token_logprobs` uses. A greedy row (temperature 0) reports
log-probs at temperature 1.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from drgrpo_jax.models import init_cache
from drgrpo_jax.models.transformer import layer_params, rope_for_layers, split_cache

MIN_BUCKET = 16  # smallest prompt / new-token bucket: tiny requests share one program
_CDF_CHUNK = 256  # vocabulary chunk of the two-level inverse-CDF sampler


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


ArrayT = TypeVar("ArrayT")  # what a SamplerBatch holds: np.ndarray from make_batch, jax.Array under jit


@flax.struct.dataclass
class SamplerBatch(Generic[ArrayT]):
    """Device inputs of one `generate` call; every field is per row."""

    prompt_ids_BU: ArrayT  # int32, left-padded
    prompt_positions_BU: ArrayT  # int32, -1 on padding, 0.. on real tokens
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
class SamplerOutput:
    """What `generate` returns; positions past a row's length hold pad id 0 and log-prob 0."""

    tokens_BT: jax.Array  # int32 sampled tokens (the stop token included)
    logprobs_BT: jax.Array  # float32 log-prob of each sampled token
    lengths_B: jax.Array  # int32 number of generated tokens
    stopped_B: jax.Array  # bool: ended on a stop/EOS token (else: ran out of budget)
    num_steps: jax.Array  # int32 decode iterations run (early exit shows here)


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two >= max(n, minimum): the static size that n is padded to."""
    return 1 << (max(int(n), minimum, 1) - 1).bit_length()


def batch_bucket(n: int) -> int:
    """Static batch size for n rows (powers of two, starting at 1)."""
    return bucket(n, minimum=1)


def make_batch(rows: Sequence[RowRequest], eos_token_ids: Sequence[int], *, batch_size: int,
               prompt_len: int) -> SamplerBatch[np.ndarray]:
    """Left-pads `rows` into a `SamplerBatch` of static size [batch_size, prompt_len] (host, numpy)."""
    if not rows:
        raise ValueError("rows: need at least one row")
    if len(rows) > batch_size:
        raise ValueError(f"batch_size: {batch_size} is smaller than the {len(rows)} rows")
    num_stop = max(len(r.params.stop_token_ids) + (0 if r.params.ignore_eos else len(eos_token_ids)) for r in rows)
    ids = np.zeros((batch_size, prompt_len), np.int32)
    # A padding row is one real token at position 0 so its attention is never empty (no NaN).
    pos = np.full((batch_size, prompt_len), -1, np.int32)
    pos[:, -1] = 0
    lengths = np.ones(batch_size, np.int32)
    budget = np.zeros(batch_size, np.int32)
    temperature = np.zeros(batch_size, np.float32)
    top_k = np.zeros(batch_size, np.int32)
    top_p = np.ones(batch_size, np.float32)
    # The stop-id width is bucketed too: a request with one more stop token must not recompile.
    stop = np.full((batch_size, bucket(num_stop, minimum=4)), -1, np.int32)
    seeds = np.zeros(batch_size, np.uint32)
    streams = np.zeros(batch_size, np.int32)
    samples = np.zeros(batch_size, np.int32)
    live = np.zeros(batch_size, bool)
    for b, row in enumerate(rows):
        n = len(row.prompt_ids)
        if not 0 < n <= prompt_len:
            raise ValueError(f"prompt_ids: row {b} has {n} tokens, must be in [1, {prompt_len}]")
        ids[b, prompt_len - n:] = row.prompt_ids
        pos[b, :] = -1
        pos[b, prompt_len - n:] = np.arange(n)
        lengths[b] = n
        p = row.params
        budget[b] = p.max_new_tokens
        temperature[b] = p.temperature
        top_k[b] = max(p.top_k, 0)
        top_p[b] = p.top_p
        stops = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(eos_token_ids))
        stop[b, :len(stops)] = stops
        seeds[b] = np.uint32(row.seed & 0xFFFFFFFF)
        streams[b] = row.stream
        samples[b] = row.sample
        live[b] = True
    return SamplerBatch(ids, pos, lengths, budget, temperature, top_k, top_p, stop, seeds, streams, samples, live)


def _ordered_int32(x: jax.Array) -> jax.Array:
    """Maps float32 to int32 so that integer order equals float order (for exact bisection)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, jnp.int32(-2**31) - bits - 1, bits)


def _largest_threshold(keys_BV: jax.Array, enough: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """Largest int32 t per row with enough(keys_BV >= t) true, by bisection over all int32 values."""
    lo = jnp.full(keys_BV.shape[:1], -2**31, jnp.int32)  # enough() holds here (everything kept)
    hi = jnp.full(keys_BV.shape[:1], 2**31 - 1, jnp.int32)

    def step(_, lo_hi):
        lo, hi = lo_hi
        # Midpoint rounded up, computed without int32 overflow.
        mid = (lo >> 1) + (hi >> 1) + ((lo & 1) | (hi & 1))
        ok = enough(keys_BV >= mid[:, None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, step, (lo, hi))
    return lo


def filter_top_k_top_p(scaled_BV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """Sets logits outside each row's top-k, then outside its top-p nucleus, to -inf (ties kept).

    No sort: on CPU a [32, 49152] sort costs ~20x a decode step's sampling, so the k-th largest
    value and the nucleus threshold are found by bisection over the float bits instead.
    """
    keys_BV = _ordered_int32(scaled_BV)
    num_vocab = scaled_BV.shape[-1]
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, num_vocab), num_vocab)
    kth_B = _largest_threshold(keys_BV, lambda keep_BV: jnp.sum(keep_BV, axis=-1) >= k_B)
    after_k_BV = jnp.where(keys_BV >= kth_B[:, None], scaled_BV, -jnp.inf)
    probs_BV = jax.nn.softmax(after_k_BV, axis=-1)
    # Keep the smallest top set whose mass reaches top_p: the largest threshold that still has it.
    nucleus_B = _largest_threshold(
        keys_BV, lambda keep_BV: jnp.sum(jnp.where(keep_BV, probs_BV, 0.0), axis=-1) >= top_p_B)
    # top_p = 1 keeps everything (float rounding of the mass must not drop the tail), and any
    # threshold above the top token (rounding again) must still keep that token.
    nucleus_B = jnp.where(top_p_B >= 1, jnp.int32(-2**31), jnp.minimum(nucleus_B, jnp.max(keys_BV, axis=-1)))
    return jnp.where(keys_BV >= jnp.maximum(kth_B, nucleus_B)[:, None], scaled_BV, -jnp.inf)


def _inclusive_cumsum(x: jax.Array) -> jax.Array:
    """Cumulative sum over the last axis as a triangular matmul (XLA CPU's cumsum is ~10x slower)."""
    size = x.shape[-1]
    upper_WW = jnp.triu(jnp.ones((size, size), x.dtype))
    return jnp.einsum("...i,ij->...j", x, upper_WW, precision=jax.lax.Precision.HIGHEST)


def sample_inverse_cdf(logits_BV: jax.Array, uniform_B: jax.Array) -> jax.Array:
    """Draws one token per row from softmax(logits_BV) by inverting its CDF at uniform_B in [0, 1).

    Two levels (chunk masses, then the chosen chunk) so the work is one pass over V and the
    randomness is one number per row (a Gumbel draw needs V random numbers: ~40 ms per step at
    [32, 49152] on CPU). Tokens of zero probability are never drawn.
    """
    return _sample_weights(jnp.exp(logits_BV - jnp.max(logits_BV, axis=-1, keepdims=True)), uniform_B)


def _sample_weights(weights_BV: jax.Array, uniform_B: jax.Array) -> jax.Array:
    """`sample_inverse_cdf` from unnormalised probabilities (the exp of max-shifted logits)."""
    num_rows, num_vocab = weights_BV.shape
    num_chunks = -(-num_vocab // _CDF_CHUNK)
    weights_BJW = jnp.pad(weights_BV, ((0, 0), (0, num_chunks * _CDF_CHUNK - num_vocab))).reshape(
        num_rows, num_chunks, _CDF_CHUNK)
    chunk_cdf_BJ = _inclusive_cumsum(jnp.sum(weights_BJW, axis=-1))
    target_B = uniform_B * chunk_cdf_BJ[:, -1]
    # First chunk whose cumulative mass exceeds the target (zero-mass chunks never exceed it).
    chunk_B = jnp.minimum(jnp.sum(chunk_cdf_BJ <= target_B[:, None], axis=-1), num_chunks - 1)
    before_B = jnp.take_along_axis(chunk_cdf_BJ, chunk_B[:, None], axis=-1)[:, 0] - jnp.take_along_axis(
        jnp.sum(weights_BJW, axis=-1), chunk_B[:, None], axis=-1)[:, 0]
    weights_BW = jnp.take_along_axis(weights_BJW, chunk_B[:, None, None], axis=1)[:, 0]
    within_BW = _inclusive_cumsum(weights_BW)
    offset_B = jnp.sum(within_BW <= (target_B - before_B)[:, None], axis=-1)
    # Rounding can put the target at the chunk's end: fall back to its last non-zero token.
    last_nonzero_B = _CDF_CHUNK - 1 - jnp.argmax(weights_BW[:, ::-1] > 0, axis=-1)
    offset_B = jnp.minimum(offset_B, last_nonzero_B)
    return (chunk_B * _CDF_CHUNK + offset_B).astype(jnp.int32)


def row_keys(seeds_B: jax.Array, streams_B: jax.Array, samples_B: jax.Array) -> jax.Array:
    """One key per row from (seed, stream, sample): a row's draws do not depend on its batch-mates."""
    def one(seed, stream, sample):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), sample)
    return jax.vmap(one)(seeds_B, streams_B, samples_B)


def sample_step(logits_BV: jax.Array, keys_B: jax.Array, step: jax.Array, batch: SamplerBatch[jax.Array]
                ) -> tuple[jax.Array, jax.Array]:
    """Picks one token per row and its log-prob under softmax(logits / temperature)."""
    greedy_B = batch.temperature_B <= 0
    temperature_B = jnp.where(greedy_B, 1.0, batch.temperature_B)
    scaled_BV = logits_BV.astype(jnp.float32) / temperature_B[:, None]
    # One exp pass over [B, V] serves the log-probs and, unless a row filters, the draw.
    max_B1 = jnp.max(scaled_BV, axis=-1, keepdims=True)
    weights_BV = jnp.exp(scaled_BV - max_B1)
    logsumexp_B = max_B1[:, 0] + jnp.log(jnp.sum(weights_BV, axis=-1))
    needs_filter = jnp.any(((batch.top_k_B > 0) | (batch.top_p_B < 1)) & ~greedy_B)
    uniform_B = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, step)))(keys_B)
    sampled_B = jax.lax.cond(
        needs_filter,
        lambda: sample_inverse_cdf(filter_top_k_top_p(scaled_BV, batch.top_k_B, batch.top_p_B), uniform_B),
        lambda: _sample_weights(weights_BV, uniform_B))
    tokens_B = jnp.where(greedy_B, jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), sampled_B)
    return tokens_B, jnp.take_along_axis(scaled_BV, tokens_B[:, None], axis=-1)[:, 0] - logsumexp_B


@flax.struct.dataclass
class _LoopState:
    """Carry of the decode loop."""

    step: jax.Array  # int32 index of the token about to be written
    cache: object  # the model's KV cache pytree, updated in place by XLA
    tokens_B: jax.Array  # last sampled token of every row
    out: SamplerOutput
    done_B: jax.Array  # bool: row finished (or a padding row)


def _record(state: _LoopState, tokens_B: jax.Array, logprobs_B: jax.Array, batch: SamplerBatch[jax.Array]
            ) -> _LoopState:
    """Writes the tokens sampled at `state.step` for live rows and updates who is done."""
    active_B = ~state.done_B
    out = state.out
    column = state.step
    tokens_BT = jax.lax.dynamic_update_slice(
        out.tokens_BT, jnp.where(active_B, tokens_B, 0)[:, None], (0, column))
    logprobs_BT = jax.lax.dynamic_update_slice(
        out.logprobs_BT, jnp.where(active_B, logprobs_B, 0.0)[:, None], (0, column))
    lengths_B = out.lengths_B + active_B.astype(jnp.int32)
    hit_stop_B = active_B & jnp.any(tokens_B[:, None] == batch.stop_ids_BE, axis=-1)
    done_B = state.done_B | hit_stop_B | (lengths_B >= batch.max_new_tokens_B)
    out = SamplerOutput(tokens_BT, logprobs_BT, lengths_B, out.stopped_B | hit_stop_B, out.num_steps)
    return _LoopState(state.step + 1, state.cache, tokens_B, out, done_B)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "cache_dtype"))
def generate(graphdef: nnx.GraphDef, state: nnx.State, batch: SamplerBatch[jax.Array], *, max_new_tokens: int,
             cache_dtype: jnp.dtype = jnp.float32) -> SamplerOutput:
    """Samples up to `max_new_tokens` tokens for every row of `batch` (one compiled program)."""
    model = nnx.merge(graphdef, state)
    num_rows, prompt_len = batch.prompt_ids_BU.shape
    # Weights and cache split per layer once: prefill and every step then read and write each layer in place.
    layers = layer_params(model.blocks.arrays(), model.config.num_layers)
    # The last sampled token is never fed back, so U + T - 1 slots hold everything attended to.
    cache = split_cache(init_cache(model.config, num_rows, prompt_len + max_new_tokens - 1, dtype=cache_dtype))
    # Prefill all but the last prompt column (its logits are unused, so XLA drops the unembedding),
    # then feed the last column alone: only [B, 1, V] logits are ever made, not [B, U, V].
    if prompt_len > 1:
        _, cache = model.decode(batch.prompt_ids_BU[:, :-1], batch.prompt_positions_BU[:, :-1], cache, layers)
    logits_B1V, cache = model.decode(batch.prompt_ids_BU[:, -1:], batch.prompt_positions_BU[:, -1:], cache, layers)
    # Every step's RoPE tables up front (position of the token fed at step s: prompt length + s - 1).
    positions_TB1 = batch.prompt_lengths_B[None, :, None] + jnp.arange(max_new_tokens)[:, None, None] - 1
    rope_T = jax.vmap(functools.partial(rope_for_layers, model.config))(positions_TB1)
    keys_B = row_keys(batch.seeds_B, batch.streams_B, batch.samples_B)
    out = SamplerOutput(
        tokens_BT=jnp.zeros((num_rows, max_new_tokens), jnp.int32),
        logprobs_BT=jnp.zeros((num_rows, max_new_tokens), jnp.float32),
        lengths_B=jnp.zeros((num_rows,), jnp.int32),
        stopped_B=jnp.zeros((num_rows,), bool),
        num_steps=jnp.int32(0))
    state0 = _LoopState(jnp.int32(0), cache, jnp.zeros((num_rows,), jnp.int32), out,
                        ~batch.live_B | (batch.max_new_tokens_B <= 0))
    tokens_B, logprobs_B = sample_step(logits_B1V[:, 0], keys_B, state0.step, batch)
    loop0 = _record(state0, tokens_B, logprobs_B, batch)

    def keep_going(s: _LoopState) -> jax.Array:
        return (s.step < max_new_tokens) & ~jnp.all(s.done_B)

    def decode_one(s: _LoopState) -> _LoopState:
        # Position of the token fed now = prompt length + index of that token in the completion.
        positions_B1 = (batch.prompt_lengths_B + s.step - 1)[:, None]
        rope = jax.tree.map(lambda table_TB1H: table_TB1H[s.step], rope_T)
        logits_B1V, cache = model.decode(s.tokens_B[:, None], positions_B1, s.cache, layers, rope)
        tokens_B, logprobs_B = sample_step(logits_B1V[:, 0], keys_B, s.step, batch)
        s = _LoopState(s.step, cache, s.tokens_B, dataclasses.replace(s.out, num_steps=s.out.num_steps + 1), s.done_B)
        return _record(s, tokens_B, logprobs_B, batch)

    final = jax.lax.while_loop(keep_going, decode_one, loop0)
    return final.out
