"""Packed training rows: the layout by hand, and the packed step equal to the padded one on every mesh and split."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from drgrpo_jax.errors import PackingError
from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.sharding import MeshShape, batch_sharding, make_mesh, param_shardings, place, shard_model
from drgrpo_jax.step.config import StepConfig
from drgrpo_jax.step.packing import first_fit, pack_cell, sequence_lengths
from drgrpo_jax.step.train_step import init_state, jit_policy_logprobs, train_step

from support.tiny_models import tiny_decoder_config
from support.tiny_step import STEP_PROMPT, STEP_RESPONSE, assert_same, initial_old_logprobs, make_step_batch, run_step

AGGREGATIONS = ["fixed_budget", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
PACK_LENGTH = STEP_PROMPT + STEP_RESPONSE + 2  # room for the longest sequence (prompt + response - 1) and more


def oracle_rows_needed(batch, micro_batches: int, shards: int, length: int) -> int:
    """Most rows a greedy first-fit fills in any (micro-batch, shard) cell, in plain Python: micro-batch m takes
    rows m, m + micro_batches, ...; each shard a contiguous equal share of it; a response needs its prompt and its
    response but the last token, nothing when empty or a padding row."""
    prompt, response = batch.prompt_mask.sum(axis=1), batch.response_mask.sum(axis=1)
    need = np.where(batch.row_valid & (response > 0), prompt + response - 1, 0)
    most = 0
    for m in range(micro_batches):
        for cell in np.split(need[m::micro_batches], shards):
            fill: list[int] = []
            for n in (int(n) for n in cell if n):
                index = next((i for i, f in enumerate(fill) if f + n <= length), None)
                if index is None:
                    fill.append(n)
                else:
                    fill[index] += n
            most = max(most, len(fill))
    return most


def packed(mesh_shape, micro_batches: int, spare: int = 0) -> dict[str, int]:
    """StepConfig packing options with exactly the rows the window needs on this mesh and split (plus `spare`)."""
    rows = oracle_rows_needed(make_step_batch(), micro_batches, mesh_shape[0] * mesh_shape[1], PACK_LENGTH)
    return {"pack_rows": rows + spare, "pack_length": PACK_LENGTH}


def test_first_fit_and_the_packed_layout_by_hand():
    row, start, fill = first_fit(jnp.asarray([3, 4, 2, 0, 1]), rows=2, length=5)
    np.testing.assert_array_equal(row, [0, 1, 0, 0, 1])  # 4 does not fit beside 3; 2 does; 1 goes beside 4
    np.testing.assert_array_equal(start, [0, 0, 3, 5, 4])
    np.testing.assert_array_equal(fill, [5, 5])
    assert int(first_fit(jnp.asarray([3, 3, 3]), rows=2, length=5)[0][2]) == 2  # no row has room: overflow

    # Two responses: prompt (left-padded to 3) + response (right-padded to 3), the last response token never an input.
    prompt_ids = jnp.asarray([[0, 7, 8], [9, 10, 11]])
    prompt_mask = prompt_ids > 0
    response_ids = jnp.asarray([[20, 21, 0], [30, 31, 32]])
    response_mask = response_ids > 0
    lengths = sequence_lengths(prompt_mask, response_mask, jnp.asarray([True, True]))
    np.testing.assert_array_equal(lengths, [3, 5])  # 7 8 20 | 9 10 11 30 31
    ids = jnp.concatenate([prompt_ids, response_ids], axis=1)[:, :-1]
    tokens, positions, segments, row, start = pack_cell(ids, prompt_mask.sum(axis=1), lengths, prompt_width=3,
                                                        rows=2, length=6)
    np.testing.assert_array_equal(tokens, [[7, 8, 20, 0, 0, 0], [9, 10, 11, 30, 31, 0]])
    np.testing.assert_array_equal(positions, [[0, 1, 2, 0, 0, 0], [0, 1, 2, 3, 4, 0]])
    np.testing.assert_array_equal(segments, [[1, 1, 1, 0, 0, 0], [2, 2, 2, 2, 2, 0]])
    np.testing.assert_array_equal(row, [0, 1])
    np.testing.assert_array_equal(start, [0, 0])
    assert int(sequence_lengths(prompt_mask, response_mask, jnp.asarray([False, True]))[0]) == 0  # padding row


@pytest.fixture(scope="module")
def reference():
    return {agg: run_step((1, 1, 1), 1, agg) for agg in AGGREGATIONS}


@pytest.mark.heavy  # the sharded step compiled per mesh
@pytest.mark.parametrize("aggregation, mesh_shape, micro_batches", [
    *[(aggregation, (1, 1, 1), 1) for aggregation in AGGREGATIONS],  # 16 responses in a few shared rows
    ("fixed_budget", (2, 2, 2), 2), ("token_mean", (8, 1, 1), 2), ("seq_mean_token_mean", (1, 8, 1), 1),
    ("fixed_budget", (1, 1, 1), 4),
])
def test_packed_update_equals_the_padded_one(reference, aggregation, mesh_shape, micro_batches):
    """Loss, metrics and the updated parameters (so the gradient) of the packed step equal the padded step's,
    whatever the mesh and the micro-batch split: the Dr.GRPO normaliser stays the window's."""
    options = packed(mesh_shape, micro_batches)
    state, history, _ = run_step(mesh_shape, micro_batches, aggregation, **options)
    ref_state, ref_history, _ = reference[aggregation]
    assert_same(state.params, ref_state.params, "params")
    for k in ref_history[0].keys() - {"compiles_so_far"}:
        np.testing.assert_allclose(history[0][k], ref_history[0][k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert history[0]["pack_overflow"] == 0 and ref_history[0]["grad_norm"] > 0
    if mesh_shape == (1, 1, 1) and micro_batches == 1:
        assert options["pack_rows"] < 8, "16 responses packed into fewer rows: the test must share rows"


@pytest.mark.heavy
def test_packed_full_remat_step_sums_in_place_to_the_padded_update(reference):
    """Packed rows through the layer scan whose backward adds into the gradient sum (models/grad_sums.py)."""
    state, _, _ = run_step((2, 2, 2), 2, remat="full", **packed((2, 2, 2), 2))
    assert_same(state.params, reference["fixed_budget"][0].params, "params")


@pytest.mark.heavy
def test_packed_old_logprobs_equal_the_padded_ones():
    mesh = make_mesh(MeshShape(data=2, fsdp=2, tensor=2), jax.devices()[:8])
    model = shard_model(Transformer(tiny_decoder_config(), rngs=nnx.Rngs(0)), mesh)
    graphdef, state = init_state(model, optax.sgd(0.1), jax.random.key(0))
    shardings = param_shardings(state.params, mesh)
    batch = place(make_step_batch(), batch_sharding(mesh))
    plain = StepConfig(loss=LossConfig(budget=STEP_RESPONSE), micro_batches=2, logprob_chunk=5)
    padded = jit_policy_logprobs(graphdef, plain, shardings, mesh)(state.params, batch)
    config = dataclasses.replace(plain, **packed((2, 2, 1), 2))
    got = jit_policy_logprobs(graphdef, config, shardings, mesh)(state.params, batch)
    host = make_step_batch()
    token = host.response_mask & host.row_valid[:, None]
    np.testing.assert_allclose(np.asarray(got)[token], np.asarray(padded)[token], rtol=1e-5, atol=1e-6)


@pytest.mark.heavy
def test_a_window_that_does_not_fit_is_refused_naming_the_field():
    with pytest.raises(PackingError, match=r"^train\.pack_rows: .* need \d+ packed rows"):
        run_step((1, 1, 1), 1, **packed((1, 1, 1), 1, spare=-1))
    with pytest.raises(PackingError, match=r"^train\.pack_length: .* needs \d+ tokens, more than one packed row of 10"):
        run_step((1, 1, 1), 1, pack_rows=16, pack_length=10)  # responses of 12 tokens exist

    # The pure step, called without the jitted wrapper's check, skips the window and counts it.
    graphdef, state = init_state(Transformer(tiny_decoder_config(), rngs=nnx.Rngs(0)), optax.sgd(0.5),
                                 jax.random.key(0))
    config = StepConfig(loss=LossConfig(budget=STEP_RESPONSE), logprob_chunk=5, **packed((1, 1, 1), 1, spare=-1))
    old = initial_old_logprobs(None)
    batch = dataclasses.replace(make_step_batch(), old_logprobs=old, behaviour_logprobs=old)
    step = jax.jit(functools.partial(train_step, graphdef, optax.sgd(0.5), optax.constant_schedule(0.5), config))
    new_state, metrics = step(state, batch)
    assert metrics.pack_overflow == 1 and metrics.skipped == 1
    assert_same(new_state.params, state.params, "an overflowing window changes nothing")


def test_bad_packing_options_name_the_field():
    from drgrpo_jax.errors import FieldError

    loss = LossConfig(budget=STEP_RESPONSE)
    with pytest.raises(FieldError, match="StepConfig.pack_rows"):
        StepConfig(loss=loss, pack_rows=-1)
    with pytest.raises(FieldError, match="StepConfig.pack_length"):
        StepConfig(loss=loss, pack_rows=2)
