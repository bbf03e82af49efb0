"""The typed rollout record: groups taken and joined keep every row field together; the batch it builds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from drgrpo_jax.algorithms import ALGORITHMS
from drgrpo_jax.data.examples import Example
from drgrpo_jax.environments.trajectory import TrajectoryRows
from drgrpo_jax.rollout.client import Completions
from drgrpo_jax.rollout.record import ScoredRollout, merge_host_rows


def _rollout(offset: int, prompts: int = 2, group: int = 2, budget: int = 3) -> ScoredRollout:
    """Row values say which round and row they came from (offset + row)."""
    rows = prompts * group
    index = np.arange(rows) + offset
    examples = tuple(Example(f"p{offset + p}", f"q{p}", "1") for p in range(prompts))
    return ScoredRollout.from_prompts(
        examples, [[offset + p] * (p + 1) for p in range(prompts)],
        response_ids=np.repeat(index[:, None], budget, axis=1).astype(np.int32),
        behaviour_logprobs=-np.repeat(index[:, None], budget, axis=1).astype(np.float32),
        response_mask=np.ones((rows, budget), bool), lengths=index.astype(np.int32), truncated=index % 2 == 0,
        weight_versions=np.full(rows, offset, np.int64), components=index[:, None].astype(np.float32))


def test_take_and_concat_keep_each_groups_rows_together():
    joined = ScoredRollout.concat([_rollout(0), _rollout(10)])
    assert joined.group_size == 2 and len(joined.examples) == 4
    picked = joined.take([2, 1])  # round 2's first group, then round 1's second
    assert [e.prompt_id for e in picked.examples] == ["p10", "p1"]
    assert picked.prompt_ids == ((10,), (1, 1))
    np.testing.assert_array_equal(picked.lengths, [10, 11, 2, 3])
    np.testing.assert_array_equal(picked.response_ids[:, 0], [10, 11, 2, 3])
    np.testing.assert_array_equal(picked.components[:, 0], [10, 11, 2, 3])
    np.testing.assert_array_equal(picked.weight_versions, [10, 10, 0, 0])


def test_to_batch_left_pads_prompts_and_marks_padding_groups():
    rollout = dataclasses.replace(_rollout(0), group_valid=np.array([True, False]))
    batch = rollout.to_batch(np.arange(4, dtype=np.float32), prompt_length=3)
    np.testing.assert_array_equal(batch.prompt_ids, [[0, 0, 0], [0, 0, 0], [0, 1, 1], [0, 1, 1]])
    np.testing.assert_array_equal(batch.prompt_mask[:, -1], True)
    np.testing.assert_array_equal(batch.row_valid, [True, True, False, False])
    np.testing.assert_array_equal(batch.behaviour_logprobs, rollout.behaviour_logprobs)
    np.testing.assert_array_equal(batch.old_logprobs, 0.0)
    assert batch.advantages.dtype == np.float32


def test_a_record_whose_fields_disagree_is_refused():
    good = _rollout(0)
    with pytest.raises(ValueError, match="lengths: 3 rows, expected 4"):
        dataclasses.replace(good, lengths=good.lengths[:3])
    with pytest.raises(ValueError, match="group_valid"):
        dataclasses.replace(good, group_valid=np.ones(3, bool))


def test_advantages_are_per_group_and_zero_on_padding_groups():
    dr_grpo, weights = ALGORITHMS["dr_grpo"], [1.0]  # r - mean(group)
    rollout = dataclasses.replace(_rollout(0, prompts=3), group_valid=np.array([True, True, False]))
    np.testing.assert_allclose(rollout.advantages_N(dr_grpo, weights), [-0.5, 0.5, -0.5, 0.5, 0.0, 0.0])
    np.testing.assert_array_equal(rollout.signal_P(dr_grpo, weights), [True, True, False])
    same = dataclasses.replace(rollout, components=np.ones_like(rollout.components))
    np.testing.assert_array_equal(same.signal_P(dr_grpo, weights), [False, False, False])


def test_each_array_has_one_name_from_the_client_to_the_record():
    """What the client and the episode driver return is named as the record's per-row fields, nothing renamed."""
    per_row = {f.name for f in dataclasses.fields(ScoredRollout) if f.metadata.get("per_row")}
    assert {f.name for f in dataclasses.fields(Completions)} - {"group_size"} <= per_row
    assert {f.name for f in dataclasses.fields(TrajectoryRows)} <= per_row


def test_row_arrays_through_a_two_host_gather_give_the_whole_rollout_back():
    whole = _rollout(0, prompts=4)
    shares = [whole.take(range(a, b)) for a, b in ((0, 2), (2, 4))]  # each host's contiguous share
    stacked = {name: np.stack([share.row_arrays()[name] for share in shares]) for name in whole.row_arrays()}
    gathered = ScoredRollout.from_prompts(whole.examples, whole.prompt_ids, **merge_host_rows(stacked))
    for name, value in whole.row_arrays().items():
        np.testing.assert_array_equal(gathered.row_arrays()[name], value)
