"""Log-probs of given token sequences under the served weights: OpenAI's `echo` + `logprobs` (the prompt's
tokens, as lm-evaluation-harness's loglikelihood requests ask) and `top_logprobs` (the k likeliest tokens at
each position). One full forward per sequence batch, jitted on bucketed shapes.

Shape letters (docs/shape_letters.md): B rows (bucketed), S positions of a whole sequence (bucketed),
V vocab, K the top entries asked for (bucketed).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from drgrpo_jax.sampler.generate import batch_bucket, bucket

__all__ = ["ScoredSequence", "score_sequences"]


@dataclasses.dataclass(frozen=True)
class ScoredSequence:
    """Per position i >= 1 of a sequence: log p(token i | tokens < i) and the top tokens there."""

    token_logprobs: list[float]  # len(sequence) - 1 entries (position 0 has no context)
    top_ids: list[list[int]]  # [len - 1][top]: most likely first
    top_logprobs: list[list[float]]


@functools.partial(jax.jit, static_argnames=("graphdef", "top"))
def _score(graphdef: nnx.GraphDef, state: nnx.State, ids_BS: jax.Array, segments_BS: jax.Array,
           temperature_B: jax.Array, *, top: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log-prob of each next token [B, S-1], top-k log-probs and ids [B, S-1, K]) at each row's temperature."""
    model = nnx.merge(graphdef, state)
    positions_BS = jnp.maximum(jnp.cumsum(segments_BS, axis=1, dtype=jnp.int32) - 1, 0)
    logits_BSV = model(ids_BS, positions_BS, segments_BS)[:, :-1]
    logprobs_BSV = jax.nn.log_softmax(logits_BSV / temperature_B[:, None, None], axis=-1)
    token_BS = jnp.take_along_axis(logprobs_BSV, ids_BS[:, 1:, None], axis=-1)[..., 0]
    top_values_BSK, top_ids_BSK = jax.lax.top_k(logprobs_BSV, top)
    return token_BS, top_values_BSK, top_ids_BSK


def score_sequences(graphdef: nnx.GraphDef, state: nnx.State, sequences: Sequence[Sequence[int]],
                    temperatures: Sequence[float], top: int, vocab_size: int) -> list[ScoredSequence]:
    """Each sequence's next-token log-probs and top-`top` entries (temperature 0 scores at 1, as the sampler)."""
    rows, longest = len(sequences), max(len(s) for s in sequences)
    width, length, k = batch_bucket(rows), bucket(max(longest, 2)), min(bucket(max(top, 1), minimum=1), vocab_size)
    ids = np.zeros((width, length), np.int32)
    segments = np.zeros((width, length), np.int32)
    for b, sequence in enumerate(sequences):
        ids[b, :len(sequence)] = sequence
        segments[b, :len(sequence)] = 1
    temps = np.ones(width, np.float32)
    temps[:rows] = [t if t > 0 else 1.0 for t in temperatures]
    token, top_values, top_ids = jax.device_get(_score(graphdef, state, jnp.asarray(ids), jnp.asarray(segments),
                                                       jnp.asarray(temps), top=k))
    out = []
    for b, sequence in enumerate(sequences):
        n = len(sequence) - 1
        out.append(ScoredSequence(token[b, :n].tolist(), top_ids[b, :n, :top].tolist(),
                                  top_values[b, :n, :top].tolist()))
    return out
