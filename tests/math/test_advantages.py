"""Advantage estimators against float64 oracles, on ragged, collapsed, singleton and padded groups."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from drgrpo_jax import advantages
from drgrpo_jax.algorithms import compute_advantages

from support import oracles


def _cases():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(6, 5)).astype(np.float32) * 3
    rewards[1] = 0.7  # collapsed group (all equal, 0.7 is not exact in binary)
    rewards[2] = [1, 0, 1, 0, 1]  # binary rewards
    valid = np.ones((6, 5), bool)
    valid[3, 3:] = False  # ragged group of 3
    valid[4, 1:] = False  # group of one
    valid[5, :] = False  # all padding
    return rewards, valid


ESTIMATORS = {
    "dr_grpo": (advantages.dr_grpo, oracles.dr_grpo),
    "grpo": (advantages.grpo, oracles.grpo),
    "rloo": (advantages.rloo, oracles.rloo),
}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("use_jit", [False, True])
def test_scalar_estimators_match_oracle(name, use_jit):
    fn, oracle = ESTIMATORS[name]
    rewards, valid = _cases()
    got = (jax.jit(fn) if use_jit else fn)(rewards, valid)
    assert got.dtype == jnp.float32 and got.shape == rewards.shape
    np.testing.assert_allclose(got, oracle(rewards, valid), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got)[~valid] == 0)
    assert np.all(np.asarray(got)[1] == 0), "a collapsed group must get exactly 0"
    assert np.all(np.asarray(got)[4] == 0), "a group of one must get 0"


def test_without_valid_means_all_valid():
    rewards = np.array([[1.0, 2.0, 4.0]], np.float32)
    np.testing.assert_allclose(advantages.dr_grpo(rewards), [[-4 / 3, -1 / 3, 5 / 3]], rtol=1e-6)
    np.testing.assert_allclose(advantages.rloo(rewards), [[1 - 3, 2 - 2.5, 4 - 1.5]], rtol=1e-6)


def test_grpo_hand_computed():
    # mean 0.5, sample std sqrt(1/3) for [1, 0, 1, 0]
    got = advantages.grpo(np.array([[1.0, 0.0, 1.0, 0.0]]))
    expected = 0.5 / (np.sqrt(1 / 3) + 1e-6)
    np.testing.assert_allclose(got, [[expected, -expected, expected, -expected]], rtol=1e-6)


def test_gdpo_matches_oracle_on_mixed_scales():
    rng = np.random.default_rng(1)
    rewards, valid = _cases()
    components = np.stack([rewards, rng.normal(size=rewards.shape) * 300, rng.integers(0, 2, rewards.shape)], -1)
    components[0, :, 2] = 1.0  # a collapsed component in one group
    weights = [1.0, 0.5, 2.0]
    got = advantages.gdpo(components.astype(np.float32), weights, valid)
    np.testing.assert_allclose(got, oracles.gdpo(components.astype(np.float32), weights, valid), rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(got)[~valid] == 0)


def test_gdpo_does_not_let_a_large_scale_component_drown_correctness():
    # correctness [1,1,0,0], length [0,100,200,300]: GRPO on the summed reward favours the
    # longest wrong answer over the shortest right one; GDPO keeps right answers ahead.
    correct = np.array([[1.0, 1.0, 0.0, 0.0]])
    length = np.array([[0.0, 100.0, 200.0, 300.0]]) / 100
    summed = advantages.grpo(correct + length)
    assert summed[0, 3] > summed[0, 0]
    per_component = advantages.gdpo(np.stack([correct, length], -1), [1.0, 0.1])
    assert per_component[0, 0] > per_component[0, 3]


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_gdpo_whitening_is_mesh_invariant(devices):
    rng = np.random.default_rng(2)
    components = rng.normal(size=(8, 4, 2)).astype(np.float32) * [1.0, 50.0]
    valid = rng.random((8, 4)) > 0.2
    whole = advantages.gdpo(components, [1.0, 0.5], valid)
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    sharded = jax.jit(
        jax.shard_map(
            lambda c, v: advantages.gdpo(c, jnp.array([1.0, 0.5]), v, axis_name="data"),
            mesh=mesh,
            in_specs=(P("data"), P("data")),
            out_specs=P("data"),
        )
    )(*(jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (components, valid)))
    np.testing.assert_allclose(sharded, whole, rtol=1e-6, atol=1e-6)


def test_whiten_and_group_std():
    x = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    valid = np.array([[True, True], [True, False]])
    flat = np.array([1.0, 2.0, 3.0])
    expected = np.zeros((2, 2))
    expected[valid] = (flat - flat.mean()) / (flat.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(advantages.whiten(x, valid), expected, rtol=1e-6)
    np.testing.assert_allclose(advantages.group_std(x, valid)[:, 0], [np.std([1, 2], ddof=1), 0.0], rtol=1e-6)


def test_compute_advantages_follows_the_table():
    rewards, valid = _cases()
    np.testing.assert_allclose(compute_advantages("dr_grpo", rewards, valid), oracles.dr_grpo(rewards, valid),
                               atol=1e-6)
    np.testing.assert_allclose(compute_advantages("dapo", rewards, valid), oracles.grpo(rewards, valid), atol=1e-5)
    scaled = compute_advantages("rloo", rewards, valid, scale_rewards=True)
    assert np.all(np.isfinite(scaled))
    with pytest.raises(ValueError, match="algorithm.scale_rewards"):
        compute_advantages("dr_grpo", rewards, valid, scale_rewards=True)
    with pytest.raises(ValueError, match="reward.weights"):
        compute_advantages("gdpo", rewards[..., None], valid)


def test_shape_errors_are_raised():
    with pytest.raises(AssertionError):
        advantages.dr_grpo(np.zeros((2, 3, 4)))
    with pytest.raises(AssertionError):
        advantages.grpo(np.zeros((2, 3)), np.ones((2, 4), bool))
