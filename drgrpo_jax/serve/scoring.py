"""Log-probs of given token sequences under the served weights: OpenAI's `echo` + `logprobs` (the prompt's
tokens, as lm-evaluation-harness's loglikelihood requests ask) and `top_logprobs` (the k likeliest tokens at
each position). One full forward per sequence batch, jitted on bucketed shapes; the logits are made a tile of
positions x vocabulary at a time (a running log-sum-exp and top-k), so a request's scoring memory is bounded by
`--max-scoring-bytes`, not rows x length x vocabulary. Given a deadline, each call takes only as many rows as a
measured scoring rate (`ScoringRate`) says end by it, so a request's scoring stops close to its deadline.

Shape letters (docs/shape_letters.md): B rows (bucketed), S positions of a whole sequence (bucketed),
V vocab, K the top entries asked for (bucketed).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.sampler.batch import batch_bucket, bucket

__all__ = ["ScoredSequence", "ScoringRate", "call_bytes", "call_shape", "rows_in_time", "rows_per_call",
           "score_sequences", "tile_sizes"]

# One entry per `_score` program traced (JAX traces a jitted function once per shape it compiles it for): a call
# that adds one compiled, and its time says nothing about scoring speed. list.append is atomic across threads.
_traced: list[int] = []


@dataclasses.dataclass(frozen=True)
class ScoredSequence:
    """Per position i >= 1 of a sequence: log p(token i | tokens < i) and the top tokens there."""

    token_logprobs: list[float]  # len(sequence) - 1 entries (position 0 has no context)
    top_ids: list[list[int]]  # [len - 1][top]: most likely first
    top_logprobs: list[list[float]]


SCORING_TEMPORARIES = 4  # float32 [B, tile, vocab tile] arrays alive at once in a tile: logits, exp, top-k input


def tile_sizes(rows: int, length: int, vocab: int, top: int, max_bytes: int) -> tuple[int, int]:
    """(positions, vocabulary entries) per tile so that a tile's float32 temporaries stay within `max_bytes`:
    the positions a power of two dividing `length`, the vocabulary tile at least the top entries asked for."""
    positions, entries = length, vocab
    while rows * positions * (entries + top) * 4 * SCORING_TEMPORARIES > max_bytes:
        if entries >= positions and entries // 2 >= max(top, 128):
            entries = (entries + 1) // 2
        elif positions > 1:
            positions //= 2
        else:
            break  # one position against the smallest vocabulary tile: as small as scoring gets
    return positions, entries


def call_shape(rows: int, longest: int) -> tuple[int, int]:
    """(rows, positions) a scoring call of `rows` sequences of up to `longest` tokens runs on: both bucketed."""
    return batch_bucket(rows), bucket(max(longest, 2))


def call_bytes(config: DecoderConfig, rows: int, length: int, top: int, max_bytes: int) -> int:
    """A scoring call's temporaries on its device, shapes bucketed as `_score_rows` buckets them: the larger of
    the full forward's activations, one layer at a time (float32, per token: the MLP's gate, up and product and
    three copies of the residual stream; a mixture of experts' per routed assignment), and its logits tiles. An
    upper bound within 25% of the compiled program's for dense models (tests/serve/test_serve_hostile.py)."""
    (width, length), k = call_shape(rows, length), bucket(max(top, 1), minimum=1)
    mlp = config.experts_per_token * config.moe_intermediate_size if config.num_experts else config.intermediate_size
    positions, entries = tile_sizes(width, length, config.vocab_size, k, max_bytes)
    return max(width * length * (3 * mlp + 3 * config.hidden_size) * 4,
               width * positions * (entries + k) * 4 * SCORING_TEMPORARIES)


def rows_per_call(config: DecoderConfig, longest: int, top: int, max_bytes: int, budget: int, max_rows: int) -> int:
    """`max_rows`, halved until a scoring call of that many sequences of up to `longest` tokens stays within
    `budget` bytes (one row at least: the request's check refused a sequence that alone does not fit)."""
    rows = max_rows
    while rows > 1 and call_bytes(config, rows, longest, top, max_bytes) > budget:
        rows //= 2
    return rows


class ScoringRate:
    """Seconds a scoring call takes per row x position of its bucketed shape, a running estimate over the calls
    that compiled nothing (each moves it a fifth of the way to its own); 0 while none has run. One per served
    model (`Service.scoring_rate`); calls on several threads note it at once."""

    def __init__(self, seconds_per_token: float = 0.0):
        self._lock = threading.Lock()
        self._seconds_per_token = seconds_per_token

    @property
    def seconds_per_token(self) -> float:
        return self._seconds_per_token

    def note(self, tokens: int, seconds: float) -> None:
        """Learns from a call of `tokens` bucketed rows x positions that took `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            old, new = self._seconds_per_token, seconds / tokens
            self._seconds_per_token = new if not old else 0.8 * old + 0.2 * new


def rows_in_time(lengths: Sequence[int], seconds_per_token: float, seconds_left: float | None) -> int:
    """How many of the next sequences (`lengths`, as many as a call may hold) the next scoring call takes: all
    with no deadline (`seconds_left` None); none once the deadline passed; one while the rate is unknown (0), so
    its time teaches the rate; else the most, halving to powers of two (the row buckets), whose call is predicted
    to end in time: none when not even one row is (the caller gives up rather than run past the deadline)."""
    if seconds_left is None:
        return len(lengths)
    if seconds_left <= 0:
        return 0
    if not seconds_per_token:
        return min(1, len(lengths))
    rows = len(lengths)
    while rows and seconds_per_token * _call_tokens(rows, max(lengths[:rows])) > seconds_left:
        rows = 1 << ((rows - 1).bit_length() - 1) if rows > 1 else 0  # the power of two below
    return rows


def _call_tokens(rows: int, longest: int) -> int:
    """Rows x positions of a call's bucketed shape: what its time is counted in."""
    width, length = call_shape(rows, longest)
    return width * length


def _tile_scores(model: Transformer, hidden_BtD: jax.Array, targets_Bt: jax.Array, temperature_B: jax.Array, *,
                 entries: int, top: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probs of `targets_Bt` and the top-`top` entries at each position, the vocabulary read `entries` at a
    time with a running log-sum-exp and a running top-k (never [B, t, V] at once)."""
    unembed_DV = model.unembed_DV()
    vocab, cap = unembed_DV.shape[1], model.config.final_logit_softcap
    rows, positions = targets_Bt.shape
    num_tiles = -(-vocab // entries)

    def one_tile(j: jax.Array, carry: tuple) -> tuple:
        running_max, running_sum, target_logit, top_values, top_ids = carry
        # The last tile is shifted back to end at the vocabulary's end; columns an earlier tile saw are masked.
        start = jnp.minimum(j * entries, vocab - entries)
        columns = start + jnp.arange(entries)
        logits = jnp.einsum("btd,dv->btv", hidden_BtD, jax.lax.dynamic_slice_in_dim(unembed_DV, start, entries, 1),
                            preferred_element_type=jnp.float32)
        logits = logits if cap is None else cap * jnp.tanh(logits / cap)
        logits = jnp.where(columns >= j * entries, logits / temperature_B[:, None, None], -jnp.inf)
        new_max = jnp.maximum(running_max, logits.max(axis=-1))
        running_sum = running_sum * jnp.exp(running_max - new_max) + jnp.exp(logits - new_max[..., None]).sum(-1)
        inside = (targets_Bt >= columns[0]) & (targets_Bt < columns[0] + entries) & (targets_Bt >= j * entries)
        picked = jnp.take_along_axis(logits, jnp.clip(targets_Bt - start, 0, entries - 1)[..., None], -1)[..., 0]
        target_logit = jnp.where(inside, picked, target_logit)
        values, index = jax.lax.top_k(jnp.concatenate([top_values, logits], -1), top)
        ids = jnp.take_along_axis(jnp.concatenate([top_ids, jnp.broadcast_to(columns, logits.shape)], -1), index, -1)
        return new_max, running_sum, target_logit, values, ids

    start = (jnp.full((rows, positions), -jnp.inf), jnp.zeros((rows, positions)), jnp.zeros((rows, positions)),
             jnp.full((rows, positions, top), -jnp.inf), jnp.zeros((rows, positions, top), jnp.int32))
    running_max, running_sum, target_logit, top_values, top_ids = jax.lax.fori_loop(0, num_tiles, one_tile, start)
    log_normalizer = running_max + jnp.log(running_sum)
    return target_logit - log_normalizer, top_values - log_normalizer[..., None], top_ids


@functools.partial(jax.jit, static_argnames=("graphdef", "top", "positions", "entries"))
def _score(graphdef: nnx.GraphDef, state: nnx.State, ids_BS: jax.Array, segments_BS: jax.Array,
           temperature_B: jax.Array, *, top: int, positions: int, entries: int
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log-prob of each next token [B, S], top-k log-probs and ids [B, S, K]) at each row's temperature; the
    last position (no next token) is garbage. Tiles of `positions` x `entries` bound the logits' memory."""
    _traced.append(1)  # runs only while JAX traces (compiles) this program
    model = nnx.merge(graphdef, state)
    positions_BS = jnp.maximum(jnp.cumsum(segments_BS, axis=1, dtype=jnp.int32) - 1, 0)
    hidden_BSD = model.hidden_states(ids_BS, positions_BS, segments_BS)
    rows, length, width = hidden_BSD.shape
    targets_BS = jnp.concatenate([ids_BS[:, 1:], jnp.zeros((rows, 1), ids_BS.dtype)], axis=1)
    tiles = length // positions

    def per_tile(tile: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        return _tile_scores(model, tile[0], tile[1], temperature_B, entries=entries, top=top)

    hidden_nBtD = hidden_BSD.reshape(rows, tiles, positions, width).swapaxes(0, 1)
    targets_nBt = targets_BS.reshape(rows, tiles, positions).swapaxes(0, 1)
    token_nBt, values_nBtK, ids_nBtK = jax.lax.map(per_tile, (hidden_nBtD, targets_nBt))

    def back(x: jax.Array) -> jax.Array:
        return x.swapaxes(0, 1).reshape(rows, length, *x.shape[3:])

    return back(token_nBt), back(values_nBtK), back(ids_nBtK)


def score_sequences(graphdef: nnx.GraphDef, state: nnx.State, sequences: Sequence[Sequence[int]],
                    temperatures: Sequence[float], top: int, vocab_size: int, max_bytes: int = 256 * 2**20, *,
                    rows_per_call: int = 32, stopped: Callable[[], bool] | None = None,
                    deadline: float | None = None, rate: ScoringRate | None = None,
                    clock: Callable[[], float] = time.monotonic) -> list[ScoredSequence] | None:
    """Each sequence's next-token log-probs and top-`top` entries (temperature 0 scores at 1, as the sampler),
    computed in tiles whose float32 temporaries stay within `max_bytes` (`--max-scoring-bytes`).

    The sequences are scored in order, at most `rows_per_call` a call (the memory bound). With a `deadline` (a
    `clock()` time) each call takes only the rows `rate` predicts to end by it (`rows_in_time`): when not even one
    row would, the rest is left unscored and the answer is None, so the scoring ends before its deadline rather
    than a call's length past it. `stopped` is asked before each call: once it answers True (the client left) the
    answer is None as well. Each call that compiled nothing teaches `rate` its speed (a rate of its own when None).
    Rows are independent, so how they are split into calls changes no result beyond float rounding."""
    rate = ScoringRate() if rate is None else rate
    out: list[ScoredSequence] = []
    while len(out) < len(sequences):
        if stopped is not None and stopped():
            return None
        start = len(out)
        lengths = [len(s) for s in sequences[start:start + rows_per_call]]
        rows = rows_in_time(lengths, rate.seconds_per_token, None if deadline is None else deadline - clock())
        if not rows:
            return None
        traced, began = len(_traced), clock()
        out += _score_rows(graphdef, state, sequences[start:start + rows], temperatures[start:start + rows], top,
                           vocab_size, max_bytes)
        if len(_traced) == traced:  # a call that compiled says nothing about how fast scoring runs
            rate.note(_call_tokens(rows, max(lengths[:rows])), clock() - began)
    return out


def _score_rows(graphdef: nnx.GraphDef, state: nnx.State, sequences: Sequence[Sequence[int]],
                temperatures: Sequence[float], top: int, vocab_size: int, max_bytes: int) -> list[ScoredSequence]:
    """score_sequences of one call's rows: one program run on bucketed shapes."""
    rows = len(sequences)
    (width, length), k = call_shape(rows, max(map(len, sequences))), min(bucket(max(top, 1), minimum=1), vocab_size)
    ids = np.zeros((width, length), np.int32)
    segments = np.zeros((width, length), np.int32)
    for b, sequence in enumerate(sequences):
        ids[b, :len(sequence)] = sequence
        segments[b, :len(sequence)] = 1
    temps = np.ones(width, np.float32)
    temps[:rows] = [t if t > 0 else 1.0 for t in temperatures]
    positions, entries = tile_sizes(width, length, vocab_size, k, max_bytes)
    token, top_values, top_ids = jax.device_get(_score(graphdef, state, jnp.asarray(ids), jnp.asarray(segments),
                                                       jnp.asarray(temps), top=k, positions=positions,
                                                       entries=entries))
    out = []
    for b, sequence in enumerate(sequences):
        n = len(sequence) - 1
        out.append(ScoredSequence(token[b, :n].tolist(), top_ids[b, :n, :top].tolist(),
                                  top_values[b, :n, :top].tolist()))
    return out
