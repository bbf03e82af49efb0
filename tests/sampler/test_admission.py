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
@pytest.mark.parametrize("compact, alone_first", [(True, False), (False, False), (True, True)])
def test_admitted_rows_sample_what_they_would_alone_and_finish_first(model, compact, alone_first):
    """`alone_first`: the batch starts with the long row only (1 row, no place free): it grows to take the two."""
    first = [LONG] if alone_first else [LONG, SHORT]
    before = _alone(model, first, 64)
    asked, handed = [], []

    def admit_rows(free: int, step: int, rows: int):
        asked.append((free, step, rows))
        if handed or free < 2:
            return None
        handed.append(step)
        return make_batch(JOINS, model.config.eos_token_ids, batch_size=2, prompt_len=16)

    finished = []
    batch = make_batch(first, model.config.eos_token_ids, batch_size=1 if alone_first else 4, prompt_len=16)
    out = jax.tree.map(np.asarray, generate(
        *nnx.split(model), batch, max_new_tokens=64, check_every=8, compact=compact, admit_rows=admit_rows,
        finished=lambda ids, rows: finished.append((ids.tolist(), rows.lengths_B.tolist())), max_rows=4))
    # The batch's rows (and padding rows) first; the two admitted rows follow.
    joined = [1, 2] if alone_first else [4, 5]
    assert handed and out.tokens_BT.shape == (joined[-1] + 1, 64)
    assert asked[0] == ((3, 1, 1) if alone_first else (2, 1, 4))  # places: 3 rows to grow by / 2 padding rows
    np.testing.assert_array_equal(out.tokens_BT[:len(first)], before.tokens_BT)
    np.testing.assert_allclose(out.logprobs_BT[:len(first)], before.logprobs_BT, atol=1e-5)
    alone = _alone(model, JOINS, 32)
    np.testing.assert_array_equal(out.lengths_B[joined], [20, 20])
    np.testing.assert_array_equal(out.tokens_BT[joined, :32], alone.tokens_BT)
    np.testing.assert_allclose(out.logprobs_BT[joined, :32], alone.logprobs_BT, atol=1e-5)
    # The admitted rows (and the short one) were handed back at boundaries, the long row only at the end.
    reported = {i for ids, _ in finished for i in ids}
    assert set(joined) <= reported and 0 not in reported
    assert max(out.lengths_B[joined]) < out.lengths_B[0] == 60
