"""Multi-turn rows: environment and tool tokens are read by the model but left out of the loss, the KL and T_w;
the update stays invariant to meshes of 1/2/4/8 devices and micro-batch splits, and matches the float64 oracle."""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.sharding import MeshShape, batch_sharding, make_mesh, param_shardings, place, shard_model
from drgrpo_jax.step.config import StepConfig
from drgrpo_jax.step.policy import policy_logprobs
from drgrpo_jax.step.train_step import init_state, jit_train_step, state_shardings

from support.oracles import aggregate, token_losses
from support.tiny_models import tiny_decoder_config
from support.tiny_step import STEP_RESPONSE, assert_same, make_step_batch

pytestmark = pytest.mark.heavy  # the sharded training step compiled on several meshes

LENGTHS = np.array([12, 12, 11, 12, 10, 12, 9, 12, 7, 8, 0, 3, 6, 1, 12, 0])


def multi_turn_batch():
    """The step's window with a tool turn inside every long response: positions 3-5 are the environment's."""
    batch = make_step_batch(lengths=LENGTHS)
    environment = np.zeros_like(batch.response_mask)
    environment[:, 3:6] = True
    return dataclasses.replace(batch, loss_mask=batch.response_mask & ~environment)


@functools.cache
def _old_logprobs(graphdef_params_key=0):
    graphdef, params = nnx.split(Transformer(tiny_decoder_config(), rngs=nnx.Rngs(0)), nnx.Param)
    config = StepConfig(loss=LossConfig(budget=STEP_RESPONSE), logprob_chunk=5)
    return np.asarray(jax.jit(functools.partial(policy_logprobs, graphdef, config))(params, multi_turn_batch()))


def run(mesh_shape, micro_batches, batch, aggregation="fixed_budget", kl_coef=0.0):
    data, fsdp, tensor = mesh_shape
    mesh = make_mesh(MeshShape(data=data, fsdp=fsdp, tensor=tensor), jax.devices()[:data * fsdp * tensor])
    model = shard_model(Transformer(tiny_decoder_config(), rngs=nnx.Rngs(0)), mesh)
    optimizer = optax.sgd(0.5)
    graphdef, state = init_state(model, optimizer, jax.random.key(0), with_reference=kl_coef > 0)
    config = StepConfig(loss=LossConfig(aggregation=aggregation, budget=STEP_RESPONSE, kl_coef=kl_coef),
                        micro_batches=micro_batches, logprob_chunk=5)
    shardings = state_shardings(state, param_shardings(state.params, mesh), mesh)
    step = jit_train_step(graphdef, optimizer, optax.constant_schedule(0.5), config, shardings, mesh)
    placed = place(batch, batch_sharding(mesh))
    new_state, metrics = step(jax.device_put(state, shardings), placed)
    return jax.device_get(new_state.params), jax.device_get(metrics)


def _with_old(batch, shift=0.1):
    old = _old_logprobs()
    rng = np.random.default_rng(3)
    shifted = old + rng.uniform(-shift, shift, old.shape).astype(np.float32)  # ratios off 1: the clip acts
    return dataclasses.replace(batch, old_logprobs=shifted, behaviour_logprobs=shifted)


@pytest.fixture(scope="module")
def single():
    return run((1, 1, 1), 1, _with_old(multi_turn_batch()))


@pytest.mark.parametrize("mesh_shape, micro_batches", [((2, 1, 1), 2), ((2, 2, 1), 4), ((8, 1, 1), 2),
                                                       ((2, 2, 2), 1)])
def test_multi_turn_update_is_invariant_to_mesh_and_micro_batches(single, mesh_shape, micro_batches):
    params, metrics = run(mesh_shape, micro_batches, _with_old(multi_turn_batch()))
    assert_same(params, single[0], f"params on {mesh_shape} x {micro_batches}")
    np.testing.assert_allclose(metrics.loss, single[1].loss, rtol=1e-5, atol=1e-7)


def test_the_loss_and_token_count_match_the_float64_oracle(single):
    batch = _with_old(multi_turn_batch())
    mask = batch.loss_mask & batch.row_valid[:, None]
    assert single[1].num_tokens == mask.sum() < (batch.response_mask & batch.row_valid[:, None]).sum()
    # The policy before the update is the one old_logprobs were shifted from: its log-probs are _old_logprobs().
    per_token = token_losses(_old_logprobs(), batch.old_logprobs, batch.advantages, mask, 0.2, 0.2)
    expected = aggregate(per_token, mask, "fixed_budget", budget=STEP_RESPONSE, row_valid=batch.row_valid)
    np.testing.assert_allclose(single[1].loss, expected, rtol=1e-5, atol=1e-7)


def test_environment_tokens_change_nothing_through_the_loss(single):
    """Garbage log-probs and advantages on the environment's tokens reach neither the loss nor the update."""
    batch = _with_old(multi_turn_batch())
    environment = batch.response_mask & ~batch.loss_mask
    poisoned = dataclasses.replace(batch, old_logprobs=np.where(environment, np.nan, batch.old_logprobs),
                                   behaviour_logprobs=np.where(environment, 1e9, batch.behaviour_logprobs))
    params, metrics = run((2, 1, 1), 2, poisoned)
    assert_same(params, single[0], "poisoned environment tokens")
    assert np.isfinite(metrics.loss) and metrics.tokens.behaviour_kl == pytest.approx(single[1].tokens.behaviour_kl)


def test_a_full_loss_mask_is_the_same_as_none():
    batch = _with_old(multi_turn_batch())
    full = dataclasses.replace(batch, loss_mask=batch.response_mask)
    none = dataclasses.replace(batch, loss_mask=None)
    a, b = run((2, 1, 1), 1, full), run((2, 1, 1), 1, none)
    assert_same(a[0], b[0], "full loss mask vs none")
    assert a[1].num_tokens == b[1].num_tokens == (batch.response_mask & batch.row_valid[:, None]).sum()


def test_environment_tokens_are_context_not_dropped(single):
    """Cutting the environment's tokens out of the rows (instead of masking them) changes the update: they are
    read as context."""
    batch = _with_old(multi_turn_batch())
    cut = dataclasses.replace(batch, response_mask=batch.loss_mask, loss_mask=None)
    params, _ = run((1, 1, 1), 1, cut)
    differences = [np.abs(np.asarray(a) - np.asarray(b)).max()
                   for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(single[0]))]
    assert max(differences) > 1e-4
