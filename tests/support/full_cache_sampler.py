"""The full-cache sampler the KV-cache sampler replaced, kept as the oracle `generate` is checked against
(tests/sampler/)."""

from __future__ import annotations

import numpy as np


def full_cache_sample(model, batch, max_new_tokens: int, switch: tuple[int, object] | None = None
                      ) -> dict[str, np.ndarray]:
    """The sampler as it was before issue 14, as an oracle: every row prefilled on its own (its prompt repeated
    per sample), every step attending over all U + T - 1 slots, one step per Python iteration. Same draws
    (`sample_step` with each row's key and the step), so its tokens are what `generate` must give.

    `switch` (first step, new model): an in-flight weight update; the steps from `first` on run the new model over
    the cache the old one wrote (`generate`'s `weights_now`)."""
    import jax
    import jax.numpy as jnp

    from drgrpo_jax.models.kv_cache import init_cache
    from drgrpo_jax.sampler.draws import row_keys, sample_step

    rows = batch.rows
    ids_BU = np.asarray(batch.prompt_ids_PU)[rows.prompt_index_B]
    positions_BU = np.asarray(batch.prompt_positions_PU)[rows.prompt_index_B]
    num_rows, prompt_len = ids_BU.shape
    decode = jax.jit(lambda m, ids, positions, cache: m.decode(ids, positions, cache))
    draw = jax.jit(sample_step)
    logits_BTV, cache = decode(model, ids_BU, positions_BU, init_cache(model.config, num_rows,
                                                                       prompt_len + max_new_tokens - 1))
    keys_B = row_keys(rows.seeds_B, rows.streams_B, rows.samples_B)
    out = {"tokens": np.zeros((num_rows, max_new_tokens), np.int32), "lengths": np.zeros(num_rows, np.int32),
           "logprobs": np.zeros((num_rows, max_new_tokens), np.float32), "stopped": np.zeros(num_rows, bool)}
    done_B = ~rows.live_B | (rows.max_new_tokens_B <= 0)
    tokens_B = np.zeros(num_rows, np.int32)  # the token fed at the next step
    for step in range(max_new_tokens):
        if switch is not None and step == switch[0]:
            model = switch[1]
        if step:
            positions_B1 = (rows.prompt_lengths_B + step - 1)[:, None]
            logits_BTV, cache = decode(model, jnp.asarray(tokens_B[:, None]), positions_B1, cache)
        tokens_B, logprobs_B = (np.asarray(x) for x in draw(logits_BTV[:, -1], keys_B, step, rows.temperature_B,
                                                             rows.top_k_B, rows.top_p_B))
        active_B = ~done_B
        out["tokens"][active_B, step] = tokens_B[active_B]
        out["logprobs"][active_B, step] = logprobs_B[active_B]
        out["lengths"] += active_B
        stop_B = active_B & (tokens_B[:, None] == rows.stop_ids_BE).any(-1)
        out["stopped"] |= stop_B
        done_B = done_B | stop_B | (out["lengths"] >= rows.max_new_tokens_B)
        if done_B.all():
            break
    return out
