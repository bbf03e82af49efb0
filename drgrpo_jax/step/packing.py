"""Packed training rows: a micro-batch's responses, each with its prompt, in fixed [B, S] token rows.

Shape letters (docs/shape_letters.md): N responses, U prompt positions (left-padded), T response positions
(right-padded), B packed rows and S tokens per packed row (the rows and length of the model call), D model dim,
O data-parallel shards (each packs its own responses, so the gathers back stay on its device).

Unlike the padded [N, U + T - 1] layout, no padding is computed: a greedy first-fit (`first_fit`) puts each
response into the first row with room as its own segment, and the hidden states come back to [N, T], so log-probs,
the loss and its gradient are the padded layout's. Shapes are static (`PackSpec`); a window a shard overflows is
refused before the jitted step runs (`rows_needed`, `errors.PackingError`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["PackSpec", "PackedRows", "first_fit", "pack_cell", "pack_responses", "packed_hidden_states",
           "rows_needed", "sequence_lengths", "unpack_responses", "window_rows_needed"]

_I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """The packed layout's static shape: each of `shards` data shards packs its responses into rows x length."""

    rows: int  # packed rows per data shard per micro-batch
    length: int  # tokens per packed row
    shards: int = 1  # data-parallel shards the micro-batch's responses are split over (contiguous, equal shares)


def sequence_lengths(prompt_mask_NU: jax.Array, response_mask_NT: jax.Array, row_valid_N: jax.Array) -> jax.Array:
    """int32 [N]: model inputs each response needs (prompt, response but its last token); 0 for an empty response
    or a padding row, whose log-probs nothing reads."""
    prompt_N = prompt_mask_NU.sum(axis=1, dtype=_I32)
    response_N = response_mask_NT.sum(axis=1, dtype=_I32)
    return jnp.where(row_valid_N & (response_N > 0), prompt_N + response_N - 1, 0)


def first_fit(lengths_N: jax.Array, rows: int, length: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(row [N], start [N], fill [B]): each sequence, in order, goes to the first row with room for it.

    A sequence no row has room for gets row = `rows` (overflow) and is not placed. A scan over responses, not tokens.
    """

    def place(fill_B, n):
        fits_B = fill_B + n <= length
        row = jnp.where(fits_B.any(), jnp.argmax(fits_B), rows).astype(_I32)
        start = jnp.where(row < rows, fill_B[jnp.minimum(row, rows - 1)], 0)
        return jnp.where(jnp.arange(rows) == row, fill_B + n, fill_B), (row, start)

    fill_B, (row_N, start_N) = jax.lax.scan(place, jnp.zeros(rows, _I32), lengths_N.astype(_I32))
    return row_N, start_N, fill_B


def rows_needed(lengths_N: jax.Array, length: int) -> tuple[jax.Array, jax.Array]:
    """(rows first-fit fills, longest sequence) of one shard's responses: a cap of R rows overflows iff the first
    exceeds R (first-fit places the first R rows the same with or without the cap) or the second exceeds `length`."""
    _, _, fill = first_fit(lengths_N, lengths_N.shape[0], length)
    return (fill > 0).sum(dtype=_I32), lengths_N.max(initial=0)


def pack_cell(ids_NS: jax.Array, prompt_len_N: jax.Array, lengths_N: jax.Array, prompt_width: int,
              rows: int, length: int) -> tuple[jax.Array, ...]:
    """One shard's packed (tokens, positions, segment ids) [B, S] and each response's (row, start) [N].

    `ids_NS` is the padded layout's input (prompt left-padded to `prompt_width`, then the response): response n's
    inputs are the `lengths_N[n]` columns from prompt_width - prompt_len_N[n] on. Trailing axes of `ids_NS` (a
    token's routed experts beside its id) are packed with it. Segment n + 1 marks response n,
    its positions counting from 0 as in the padded layout; 0 is padding (seen by nobody).
    """
    N, S_padded = ids_NS.shape[:2]
    row_N, start_N, _ = first_fit(lengths_N, rows, length)
    offset_NS = jnp.arange(S_padded, dtype=_I32)[None, :] - (prompt_width - prompt_len_N)[:, None]
    keep_NS = (offset_NS >= 0) & (offset_NS < lengths_N[:, None]) & (row_N < rows)[:, None]
    target_NS = jnp.where(keep_NS, row_N[:, None] * length + start_N[:, None] + offset_NS, rows * length)

    def scatter(values_NS):  # [N, S, ...] -> [rows, length, ...]
        rest = values_NS.shape[2:]
        flat = jnp.zeros((rows * length, *rest), _I32).at[target_NS.reshape(-1)].set(
            values_NS.reshape(N * S_padded, *rest), mode="drop")
        return flat.reshape(rows, length, *rest)

    segment_NS = jnp.broadcast_to(jnp.arange(1, N + 1, dtype=_I32)[:, None], (N, S_padded))
    return scatter(ids_NS.astype(_I32)), scatter(offset_NS), scatter(segment_NS), row_N, start_N


def _unpack_cell(hidden_BSD: jax.Array, row_N: jax.Array, start_N: jax.Array, prompt_len_N: jax.Array,
                 response_width: int) -> jax.Array:
    """[N, T, D]: the hidden state before each response token (masked slots read some in-range state)."""
    rows, length = hidden_BSD.shape[:2]
    column_NT = start_N[:, None] + prompt_len_N[:, None] - 1 + jnp.arange(response_width, dtype=_I32)[None, :]
    row_N = jnp.clip(row_N, 0, rows - 1)
    return hidden_BSD[row_N[:, None], jnp.clip(column_NT, 0, length - 1)]


class PackedRows(NamedTuple):
    """A micro-batch's responses packed into the model call's [B, S] rows, and where each response went."""

    tokens: jax.Array  # int32 [B, S]
    positions: jax.Array  # int32 [B, S]: counting from 0 in each response, as the padded layout's
    segments: jax.Array  # int32 [B, S]: response n is segment n + 1 of its shard's rows; 0 is padding
    targets: jax.Array  # int32 [B, S]: the token after each input (the one it predicts)
    routed: jax.Array | None  # int32 [B, S, L, k]: router replay's experts of each input, or None
    row_ON: jax.Array  # int32 [O, N / O]: each response's row in its shard's rows
    start_ON: jax.Array  # int32 [O, N / O]: its first column there
    prompt_len_ON: jax.Array  # int32 [O, N / O]


def pack_responses(prompt_ids_NU: jax.Array, prompt_mask_NU: jax.Array, response_ids_NT: jax.Array,
                   response_mask_NT: jax.Array, row_valid_N: jax.Array, spec: PackSpec,
                   routed_NSLk: jax.Array | None = None) -> PackedRows:
    """The N responses cut into `spec.shards` contiguous equal shares (a micro-batch's split over the data-parallel
    devices), each packed into its own spec.rows x spec.length rows, so packing and gathering stay per device;
    `routed_NSLk` (router replay: the experts of each token of the padded layout's input) packed with the tokens."""
    N, U = prompt_ids_NU.shape
    O = spec.shards
    if N % O:
        raise ValueError(f"packing: {N} responses per micro-batch do not split over {O} data-parallel shards")
    full_NS = jnp.concatenate([prompt_ids_NU, response_ids_NT], axis=1)
    ids_NS = jnp.stack([full_NS[:, :-1], full_NS[:, 1:]], axis=-1)  # [N, S, 2]: each input and its target
    if routed_NSLk is not None:  # packed beside them: [N, S, 2 + L * k]
        ids_NS = jnp.concatenate([ids_NS, routed_NSLk.reshape(*ids_NS.shape[:2], -1)], axis=-1)
    prompt_len_N = prompt_mask_NU.sum(axis=1, dtype=_I32)
    lengths_N = sequence_lengths(prompt_mask_NU, response_mask_NT, row_valid_N)

    def per_shard(x):
        return x.reshape(O, N // O, *x.shape[1:])

    pack = functools.partial(pack_cell, prompt_width=U, rows=spec.rows, length=spec.length)
    channels, positions, segments, row_ON, start_ON = jax.vmap(pack)(per_shard(ids_NS), per_shard(prompt_len_N),
                                                                     per_shard(lengths_N))

    def rows_of_call(x_OBS):
        return x_OBS.reshape(O * spec.rows, spec.length, *x_OBS.shape[3:])

    channels = rows_of_call(channels)
    routed_BSLk = None
    if routed_NSLk is not None:
        routed_BSLk = channels[..., 2:].reshape(*channels.shape[:2], *routed_NSLk.shape[2:])
    return PackedRows(channels[..., 0], rows_of_call(positions), rows_of_call(segments), channels[..., 1],
                      routed_BSLk, row_ON, start_ON, per_shard(prompt_len_N))


def unpack_responses(values_BS: jax.Array, packed: PackedRows, response_width: int) -> jax.Array:
    """[N, T, ...]: per-position values of the packed rows [B, S, ...] at the inputs before each response token."""
    O = packed.row_ON.shape[0]
    values_OBS = values_BS.reshape(O, values_BS.shape[0] // O, *values_BS.shape[1:])
    unpack = functools.partial(_unpack_cell, response_width=response_width)
    values_ONT = jax.vmap(unpack)(values_OBS, packed.row_ON, packed.start_ON, packed.prompt_len_ON)
    return values_ONT.reshape(-1, *values_ONT.shape[2:])


def packed_hidden_states(model: Any, prompt_ids_NU: jax.Array, prompt_mask_NU: jax.Array, response_ids_NT: jax.Array,
                         response_mask_NT: jax.Array, row_valid_N: jax.Array, spec: PackSpec,
                         lora_key: jax.Array | None = None, grad_sums: dict[str, jax.Array] | None = None,
                         routed_NSLk: jax.Array | None = None, with_stats: bool = False) -> tuple[jax.Array, Any]:
    """([N, T, D] final hidden states before each response token, a mixture's `RouterStats` or None), from one
    model call on the rows `pack_responses` packs.

    `lora_key`, `grad_sums` and `with_stats` go to `model.hidden_states_and_router`.
    """
    packed = pack_responses(prompt_ids_NU, prompt_mask_NU, response_ids_NT, response_mask_NT, row_valid_N, spec,
                            routed_NSLk)
    hidden_BSD, stats = model.hidden_states_and_router(packed.tokens, packed.positions, packed.segments, lora_key,
                                                       grad_sums, packed.routed, with_stats)
    return unpack_responses(hidden_BSD, packed, response_ids_NT.shape[1]), stats


def window_rows_needed(prompt_mask_MNU: jax.Array, response_mask_MNT: jax.Array, row_valid_MN: jax.Array,
                       spec: PackSpec) -> tuple[jax.Array, jax.Array]:
    """(most rows any shard of any micro-batch fills, longest sequence) of a window split [micro-batches, N, ...]."""
    lengths_MN = jax.vmap(sequence_lengths)(prompt_mask_MNU, response_mask_MNT, row_valid_MN)
    micro, N = lengths_MN.shape
    if N % spec.shards:
        raise ValueError(f"packing: {N} responses per micro-batch do not split over {spec.shards} data-parallel shards")
    lengths_ON = lengths_MN.reshape(micro * spec.shards, N // spec.shards)
    rows_O, longest_O = jax.vmap(functools.partial(rows_needed, length=spec.length))(lengths_ON)
    return rows_O.max(), longest_O.max()
