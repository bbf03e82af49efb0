"""What callers hand the sampler and get back: a request's rows and settings, the padded batch they make (host,
numpy) and the output of `generate`, with the bucketed sizes that keep the programs' shapes few.

Shape letters (docs/shape_letters.md): P distinct prompts (padded to a bucket), U prompt positions (bucketed),
B rows (prompt x sample, padded to a bucket), T new-token budget (bucketed), E stop (end) ids per row; L layers
and k experts per token of a mixture (`record_experts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Generic, TypeVar

import flax.struct
import jax
import numpy as np

__all__ = ["MIN_BUCKET", "RowRequest", "RowSettings", "SamplerBatch", "SamplerOutput", "SamplingParams",
           "batch_bucket", "bucket", "distinct_prompts", "make_batch", "mesh_rows"]

MIN_BUCKET = 16  # smallest prompt / new-token bucket: tiny requests share one program


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



def _left_pad(prompts: Sequence[tuple[int, ...]], num_prompts: int, prompt_len: int,
              skipped: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Prompt ids and positions [num_prompts, prompt_len] of each prompt past its first `skipped` tokens (which keep
    their positions), left-padded (host, numpy)."""
    ids = np.zeros((num_prompts, prompt_len), np.int32)
    # A padding prompt is one real token at position 0 so its attention is never empty (no NaN).
    pos = np.full((num_prompts, prompt_len), -1, np.int32)
    pos[:, -1] = 0
    for p, (prompt, skip) in enumerate(zip(prompts, skipped)):
        rest = prompt[skip:]
        ids[p, prompt_len - len(rest):] = rest
        pos[p, :] = -1
        pos[p, prompt_len - len(rest):] = np.arange(skip, len(prompt))
    return ids, pos


def distinct_prompts(rows: Sequence[RowRequest]) -> list[tuple[int, ...]]:
    """The rows' distinct prompts in first-seen order: the prompt rows of their batch (`make_batch`)."""
    return list(dict.fromkeys(tuple(r.prompt_ids) for r in rows))


def make_batch(rows: Sequence[RowRequest], eos_token_ids: Sequence[int], *, batch_size: int, prompt_len: int,
               num_prompts: int | None = None, cached: Sequence[int] | None = None) -> SamplerBatch[np.ndarray]:
    """Left-pads the distinct prompts of `rows` and their per-row settings into a `SamplerBatch` (host, numpy).

    Rows with identical prompt ids share one prompt row (prefilled once). `num_prompts`: the static number of
    prompt rows; None = `batch_bucket` of the distinct prompts (at most batch_size). `cached`: per distinct prompt
    (`distinct_prompts` order), its leading tokens already in a prefix cache (`generate`'s `prefix`): the batch
    holds only the rest of each prompt (at least one token, within `prompt_len`), at its own positions, and each
    row's `prompt_lengths_B` stays its whole prompt's.
    """
    if not rows:
        raise ValueError("rows: need at least one row")
    if len(rows) > batch_size:
        raise ValueError(f"batch_size: {batch_size} is smaller than the {len(rows)} rows")
    prompts = distinct_prompts(rows)
    skipped = [0] * len(prompts) if cached is None else list(cached)
    if cached is not None and (len(skipped) != len(prompts) or any(
            not 0 <= skip < len(p) for p, skip in zip(prompts, skipped))):
        raise ValueError(f"cached: need one count in [0, prompt length) for each of the {len(prompts)} prompts, "
                         f"got {cached}")
    for index, (prompt, skip) in enumerate(zip(prompts, skipped)):
        if not 0 < len(prompt) - skip <= prompt_len:
            raise ValueError(f"prompt_ids: prompt {index} has {len(prompt) - skip} tokens to prefill, must be in "
                             f"[1, {prompt_len}]")
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
    ids, pos = _left_pad(prompts, num_prompts, prompt_len, skipped)
    return SamplerBatch(ids, pos, settings)
