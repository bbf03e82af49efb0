"""The page pool (sampler/prefix_pool.py): prompt blocks copied out of a batch after its prefill and gathered into
a later batch's prompt cache give the tokens and log-probs of prefilling the whole prompt."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from drgrpo_jax.sampler.batch import RowRequest, SamplingParams, bucket, make_batch
from drgrpo_jax.sampler.generate import generate
from drgrpo_jax.sampler.prefix_pool import (
    BLOCK_TOKENS,
    gather_prefix,
    init_pool,
    left_padded_table,
    store_blocks,
)

from support.tiny_models import tiny_sampler_model

SHARED = tuple((7 * i + 3) % 90 + 1 for i in range(2 * BLOCK_TOKENS + 5))  # 37 tokens: 2 whole blocks
TAILS = ((4, 8, 15), (16, 23, 42, 5, 9, 11, 30, 31, 2, 6, 70, 71, 72, 73, 74, 75, 76, 77))


@pytest.fixture(scope="module")
def model():
    return tiny_sampler_model()


def _rows(prompts, seed=5):
    params = SamplingParams(max_new_tokens=24, temperature=1.0, ignore_eos=True)
    return [RowRequest(p, params, seed=seed, stream=s, sample=k) for s, p in enumerate(prompts) for k in range(2)]


def _sample(model, rows, **kwargs):
    batch = make_batch(rows, model.config.eos_token_ids, batch_size=len(rows), num_prompts=len(rows) // 2,
                       prompt_len=kwargs.pop("prompt_len", bucket(max(len(r.prompt_ids) for r in rows))),
                       cached=kwargs.pop("cached", None))
    return jax.tree.map(np.asarray, generate(*nnx.split(model), batch, max_new_tokens=32, **kwargs))


@pytest.mark.heavy
def test_cached_blocks_give_the_whole_prompts_tokens(model):
    prompts = [SHARED + tail for tail in TAILS]
    whole = _sample(model, _rows(prompts))
    # The first batch's blocks 0 and 1 of prompt 0 (left-padded into 64 slots: the prompt starts at slot 64 - 40).
    pool = init_pool(model.config, 4, jnp.float32)
    kept = []

    def keep(cache):
        start = bucket(len(prompts[0])) - len(prompts[0])
        rows, slots, blocks = (jnp.asarray(x, jnp.int32) for x in ([0, 0], [start, start + BLOCK_TOKENS], [2, 0]))
        kept.append(store_blocks(pool, cache, rows, slots, blocks))

    first = _sample(model, _rows(prompts[:1] * 2), keep_prompts=keep)
    np.testing.assert_array_equal(first.tokens_BT[:2], whole.tokens_BT[:2])
    # Both prompts start with those two blocks: 32 tokens come from the pool, the rest (5 + the tail) is prefilled
    # into the 64 - 32 slots after them.
    cached = 2 * BLOCK_TOKENS
    table = left_padded_table([[2, 0], [2, 0]], 2, 2)
    prefix = gather_prefix(kept[0], jnp.asarray(table), prompt_slots=64 - cached)
    hit = _sample(model, _rows(prompts), prefix=prefix, prompt_len=64 - cached, cached=[cached, cached])
    np.testing.assert_array_equal(hit.lengths_B, whole.lengths_B)
    np.testing.assert_array_equal(hit.tokens_BT, whole.tokens_BT)
    np.testing.assert_allclose(hit.logprobs_BT, whole.logprobs_BT, atol=1e-5)
    # A prompt with no block in the table (all -1) is prefilled whole after empty slots: the same tokens again.
    mixed = left_padded_table([[2, 0], []], 2, 2)
    prefix = gather_prefix(kept[0], jnp.asarray(mixed), prompt_slots=64)
    part = _sample(model, _rows(prompts), prefix=prefix, prompt_len=64, cached=[cached, 0])
    np.testing.assert_array_equal(part.tokens_BT, whole.tokens_BT)


def test_a_cached_prefix_needs_a_token_to_prefill_and_no_experts(model):
    rows = _rows([SHARED])
    with pytest.raises(ValueError, match="cached"):
        make_batch(rows, (), batch_size=2, prompt_len=16, cached=[len(SHARED)])
    with pytest.raises(ValueError, match="prompt_ids: prompt 0 has 21 tokens to prefill"):
        make_batch(rows, (), batch_size=2, prompt_len=16, cached=[16])
    batch = make_batch(rows, (), batch_size=2, prompt_len=8, cached=[32])
    assert batch.prompt_ids_PU[0, -5:].tolist() == list(SHARED[32:])
    assert batch.prompt_positions_PU[0].tolist() == [-1, -1, -1, 32, 33, 34, 35, 36]
    assert batch.rows.prompt_lengths_B.tolist() == [37, 37]
    with pytest.raises(ValueError, match="record_experts"):
        generate(*nnx.split(model), batch, max_new_tokens=4, record_experts=True,
                 prefix=gather_prefix(init_pool(model.config, 2, jnp.float32), jnp.full((1, 2), -1, jnp.int32),
                                      prompt_slots=8))
