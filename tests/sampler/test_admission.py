"""Continuous admission (issue #65): rows handed in at a running batch's boundaries take finished rows' places and
sample exactly what they would alone; the batch's own rows sample what they would without them; a row that
finishes is handed back at the next boundary, before the batch ends."""

import jax
import numpy as np
import pytest
from flax import nnx

from drgrpo_jax.sampler.batch import RowRequest, SamplingParams, make_batch
from drgrpo_jax.sampler.generate import generate

from support.tiny_models import tiny_sampler_model

LONG = RowRequest((40, 2, 9, 11), SamplingParams(max_new_tokens=60, temperature=1.0, ignore_eos=True), seed=1)
SHORT = RowRequest((5, 17, 3), SamplingParams(max_new_tokens=3, temperature=1.0, ignore_eos=True), seed=2)
JOINS = [RowRequest((1, 2, 3, 4, 5, 6), SamplingParams(max_new_tokens=20, temperature=0.8, top_k=7,
                                                     ignore_eos=True), seed=3, sample=k) for k in range(2)]


@pytest.fixture(scope="module")
def model():
    return tiny_sampler_model()


def _alone(model, rows, max_new_tokens):
    batch = make_batch(rows, model.config.eos_token_ids, batch_size=len(rows), prompt_len=16)
    return jax.tree.map(np.asarray, generate(*nnx.split(model), batch, max_new_tokens=max_new_tokens))


@pytest.mark.heavy
@pytest.mark.parametrize("compact", [True, False])
def test_admitted_rows_sample_what_they_would_alone_and_finish_first(model, compact):
    before = _alone(model, [LONG, SHORT], 64)
    asked, handed = [], []

    def admit_rows(free: int, step: int):
        asked.append((free, step))
        if handed or free < 2:
            return None
        handed.append(step)
        return make_batch(JOINS, model.config.eos_token_ids, batch_size=2, prompt_len=16)

    finished = []
    batch = make_batch([LONG, SHORT], model.config.eos_token_ids, batch_size=4, prompt_len=16)
    out = jax.tree.map(np.asarray, generate(
        *nnx.split(model), batch, max_new_tokens=64, check_every=8, compact=compact, admit_rows=admit_rows,
        finished=lambda ids, rows: finished.append((ids.tolist(), rows.lengths_B.tolist()))))
    # Rows 0, 1 (and the padding rows 2, 3) first; the two admitted rows are ids 4 and 5.
    assert handed and out.tokens_BT.shape == (6, 64)
    np.testing.assert_array_equal(out.tokens_BT[:2], before.tokens_BT)
    np.testing.assert_allclose(out.logprobs_BT[:2], before.logprobs_BT, atol=1e-5)
    alone = _alone(model, JOINS, 32)
    np.testing.assert_array_equal(out.lengths_B[4:], [20, 20])
    np.testing.assert_array_equal(out.tokens_BT[4:, :32], alone.tokens_BT)
    np.testing.assert_allclose(out.logprobs_BT[4:, :32], alone.logprobs_BT, atol=1e-5)
    # The short row and both admitted rows were handed back at boundaries, the long row only at the end.
    reported = [i for ids, _ in finished for i in ids]
    assert {1, 4, 5} <= set(reported) and 0 not in reported
    assert max(out.lengths_B[[1, 4, 5]]) < out.lengths_B[0] == 60
