"""GDPO end to end: a float64 oracle, the known cases (a)-(d), config rules and the trainer's window whitening."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from drgrpo_jax import advantages
from drgrpo_jax.algorithms import ALGORITHMS, group_signal
from drgrpo_jax.config.load import load_config
from drgrpo_jax.errors import ConfigError

from support.gdpo_batches import GDPO_WEIGHTS as WEIGHTS
from support.gdpo_batches import eight_group_batch, mixed_batch
from support.trainer_runs import start_trainer, trainer_overrides


def oracle_combined(components, weights, valid, eps=1e-4):
    """GDPO before whitening in float64: per-component group z-score (ddof=1, + eps), weighted sum."""
    components, valid = np.asarray(components, np.float64), np.asarray(valid, bool)
    combined = np.zeros(valid.shape)
    for p in range(valid.shape[0]):
        idx = np.flatnonzero(valid[p])
        for k in range(components.shape[2]):
            c = components[p, idx, k]
            if len(idx) >= 2 and c.max() > c.min():
                combined[p, idx] += weights[k] * (c - c.mean()) / (c.std(ddof=1) + eps)
    return combined


def oracle(components, weights, valid, eps=1e-4):
    """GDPO in float64: the combined advantage whitened over the batch's valid slots; zero-signal groups stay 0."""
    combined = oracle_combined(components, weights, valid, eps)
    flat = combined[valid]
    out = np.zeros(valid.shape)
    signal = np.array([np.ptp(combined[p, valid[p]]) > 1e-9 if valid[p].any() else False for p in range(len(valid))])
    whitened = (combined - flat.mean()) / (flat.std(ddof=1) + eps)
    out[valid & signal[:, None]] = whitened[valid & signal[:, None]]
    return out


@pytest.mark.parametrize("use_jit", [False, True])
def test_gdpo_matches_float64_oracle(use_jit):
    components, valid = mixed_batch()
    fn = jax.jit(advantages.gdpo) if use_jit else advantages.gdpo
    got = np.asarray(fn(components, jnp.asarray(WEIGHTS), valid))
    np.testing.assert_allclose(got, oracle(components, WEIGHTS, valid), rtol=1e-5, atol=1e-5)
    assert np.all(got[~valid] == 0) and np.all(got[1] == 0) and np.all(got[3] == 0)
    combined = np.asarray(advantages.gdpo_combined(components, WEIGHTS, valid))
    np.testing.assert_allclose(combined, oracle_combined(components, WEIGHTS, valid), rtol=1e-5, atol=1e-5)


def test_a_components_with_constant_sum_cancel_exactly_like_grpo():
    # correctness-like and its complement, on non-dyadic values so float32 rounding is real.
    rng = np.random.default_rng(1)
    first = (rng.integers(0, 7, (16, 5)) * np.float32(0.3)).astype(np.float32)
    second = (np.float32(10.0) - first).astype(np.float32)
    components = np.stack([first, second], -1)
    np.testing.assert_array_equal(advantages.gdpo_combined(components, [1.0, 1.0]), 0.0)
    np.testing.assert_array_equal(advantages.gdpo(components, [1.0, 1.0]), 0.0)  # whitening does not blow up a residue
    np.testing.assert_array_equal(advantages.grpo(first + second), 0.0)
    # Beside a group with signal, the cancelled groups still get exactly 0.
    mixed = np.concatenate([components, np.array([[[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])])
    got = np.asarray(advantages.gdpo(mixed.astype(np.float32), [1.0, 1.0]))
    np.testing.assert_array_equal(got[:16], 0.0)
    assert np.all(got[16] != 0)
    signal = np.asarray(group_signal("gdpo", mixed.astype(np.float32), weights=[1.0, 1.0]))
    np.testing.assert_array_equal(signal, [False] * 16 + [True])
    # Unequal weights do not cancel: (w1 - w2) * z remains.
    unequal = np.asarray(advantages.gdpo_combined(components, [1.0, 0.5]))
    varies = np.ptp(first, axis=1) > 0
    assert varies.sum() >= 10 and np.all(unequal[varies] != 0) and np.all(unequal[~varies] == 0)


def test_b_length_does_not_drown_correctness():
    correct = np.array([[1.0, 1.0, 0.0, 0.0]], np.float32)
    length = np.array([[0.0, 100.0, 200.0, 300.0]], np.float32)
    summed = np.asarray(advantages.grpo(correct + length))[0]
    assert np.argmax(summed) == 3  # GRPO on the sum: the longest wrong answer is the best
    got = np.asarray(advantages.gdpo_combined(np.stack([correct, length], -1), [1.0, 1.0]))[0]
    assert np.argmax(got) in (0, 1)  # GDPO: the highest advantage goes to a right answer
    assert got[:2].mean() > 0 > got[2:].mean()  # both components count on one scale (z-scores)
    want = oracle_combined(np.stack([correct, length], -1), [1.0, 1.0], np.ones((1, 4), bool))[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_c_two_varying_components_weigh_twice_one():
    one = np.array([[1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]], np.float32)
    other = np.array([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 1.0, 0.0]], np.float32)  # varies in group 1 only
    np.testing.assert_allclose(advantages.grpo(one + other)[0], advantages.grpo(one + other)[1], rtol=1e-6)
    got = np.asarray(advantages.gdpo_combined(np.stack([one, other], -1), [1.0, 1.0]))
    np.testing.assert_allclose(got[1], 2 * got[0], rtol=1e-6)


def test_d_each_window_is_whitened_on_its_own():
    rng = np.random.default_rng(2)
    combined = rng.normal(size=16).astype(np.float32)
    combined[8:] = combined[8:] * 5 + 3  # the second window has other statistics
    valid, signal = np.ones(16, bool), np.ones(16, bool)
    def window_advantages(combined, valid, signal):  # the table's window step, as the trainer calls it
        whitened, report = ALGORITHMS["gdpo"].window_advantages(combined, valid, signal)
        return np.asarray(whitened), float(report["whiten_mean"]), float(report["whiten_std"])

    together, _, _ = window_advantages(combined, valid, signal)
    first, mean1, std1 = window_advantages(combined[:8], valid[:8], signal[:8])
    second, mean2, std2 = window_advantages(combined[8:], valid[8:], signal[8:])
    separate = np.concatenate([first, second])
    assert np.abs(together - separate).max() > 0.1
    np.testing.assert_allclose(first, (combined[:8] - combined[:8].mean()) / (combined[:8].std(ddof=1) + 1e-4),
                               rtol=1e-5)
    np.testing.assert_allclose([mean2, std2], [combined[8:].mean(), combined[8:].std(ddof=1)], rtol=1e-5)
    # Padding and zero-signal rows stay 0; padding rows do not enter the statistics.
    valid[3] = False
    signal[5] = False
    padded, mean, _ = window_advantages(combined[:8], valid[:8], signal[:8])
    assert padded[3] == 0 and padded[5] == 0
    np.testing.assert_allclose(mean, combined[:8][valid[:8]].mean(), rtol=1e-5)


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_sharded_batch_gives_the_same_advantages(devices):
    components, valid = eight_group_batch()
    whole = advantages.gdpo(components, WEIGHTS, valid)
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    sharded = jax.jit(jax.shard_map(lambda c, v: advantages.gdpo(c, jnp.asarray(WEIGHTS), v, axis_name="data"),
                                    mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data")))(
        *(jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (components, valid)))
    np.testing.assert_allclose(sharded, whole, rtol=1e-6, atol=1e-6)


@pytest.mark.subprocess  # two jax.distributed processes
def test_two_processes_each_feeding_half_give_the_same_advantages(tmp_path):
    """jax.distributed on loopback: each process holds 4 of the 8 groups; the whitening spans both."""
    from support.two_processes import run_two_processes

    components, valid = eight_group_batch()
    two_processes = run_two_processes("gdpo_two_process_worker.py", tmp_path / "out.npz")["advantages"]
    np.testing.assert_allclose(two_processes, advantages.gdpo(components, WEIGHTS, valid), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(two_processes, oracle(components, WEIGHTS, valid), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Config rules for algorithm.name=gdpo
# ---------------------------------------------------------------------------------------------

BASE = ["model.path=x", "algorithm.name=gdpo", "reward.functions=[math_verify,format]"]


@pytest.mark.parametrize(
    "overrides, key, reason",
    [
        (["reward.weights=[1.0,1e39]"], "reward.weights[1]", "overflows float32"),
        (["reward.weights=[1.0,1.00000001]"], "reward.weights[1]", "collapse to one float32 value"),
        (["reward.weights=[0.0,0.0]"], "reward.weights", "are all 0"),
        (["reward.weights=[1.0,1e-50]"], "reward.weights[1]", "underflows"),
        (["reward.weights=[1.0,.nan]"], "reward.weights[1]", "finite"),
        (["reward.weights=[1.0]"], "reward.weights", "1 entries for 2"),
        (["rollout.group_size=1"], "rollout.group_size", "at least 2"),
        (["algorithm.scale_rewards=true"], "algorithm.scale_rewards", "gdpo forbids"),
        (["algorithm.whiten_advantages=true"], "algorithm.whiten_advantages", "gdpo forbids"),
        (["reward.functions=[]"], "reward.functions", "at least one"),
        (["rollout.max_resample_rounds=-1"], "rollout.max_resample_rounds", ">= 0"),
    ],
)
def test_bad_gdpo_configs_fail_naming_the_key(overrides, key, reason):
    with pytest.raises(ConfigError) as info:
        load_config(None, BASE + overrides)
    assert info.value.key == key and reason in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_equal_weights_are_fine_and_other_algorithms_may_repeat_a_float32_value():
    assert load_config(None, BASE + ["reward.weights=[1.0,1.0]"]).reward.weights == (1.0, 1.0)
    other = ["model.path=x", "reward.functions=[math_verify,format]", "reward.weights=[1.0,1.00000001]"]
    assert load_config(None, other).algorithm.name == "dr_grpo"
    with pytest.raises(ConfigError, match="reward.weights\\[0\\]: 1e\\+39 overflows"):
        load_config(None, other[:2] + ["reward.weights=[1e39,1.0]"])


# ---------------------------------------------------------------------------------------------
# The trainer end to end with gdpo and dynamic sampling (tiny random model, real service child)
# ---------------------------------------------------------------------------------------------


@pytest.mark.subprocess  # the trainer CLI and its generation service
@pytest.mark.slow  # a trainer run with its service child process: 47 s measured on 2 busy cores
def test_gdpo_trains_end_to_end_with_dynamic_sampling(tmp_path, tiny_model, prompts_file):
    import json
    import os

    output_dir = tmp_path / "gdpo"
    overrides = trainer_overrides(tiny_model, prompts_file, output_dir, steps=2) + [
        "algorithm.name=gdpo", "reward.functions=[support.reward_functions:letters,format]",
        "reward.components=[has_letter_a,count_b,format]", "reward.weights=[1.0,0.25,0.5]", "train.eval_every=0",
        "rollout.dynamic_sampling=true", "rollout.max_resample_rounds=2"]
    process = start_trainer(overrides)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        keys = ["loss", "grad_norm", "whiten_mean", "whiten_std", "zero_signal_fraction", "reward/has_letter_a",
                "reward/count_b", "reward/format", "reward/letters_errors"]
        assert all(np.isfinite(row[k]) for k in keys), row
        assert 1 <= row["sampling_rounds"] <= 3 and row["groups_drawn"] == 4 * row["sampling_rounds"]
        assert row["groups_padded"] == max(0, 4 - (row["groups_drawn"] - row["groups_dropped"]))
        assert row["zero_signal_fraction"] == row["groups_dropped"] / row["groups_drawn"]
        assert abs(row["whiten_mean"]) < 1e-5  # every group's z-scores sum to 0, so the batch mean is 0
    assert sum(r["groups_dropped"] for r in rows) > 0 and max(r["sampling_rounds"] for r in rows) > 1  # it resampled


def test_group_signal_asks_each_algorithm_its_own_question():
    rewards = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [0.5, 0.5, 0.5]], np.float32)
    valid = np.array([[True, True, True], [False, True, True], [True, True, False]])
    for name in ("dr_grpo", "grpo", "dapo", "rloo"):  # the scalar reward varies among the valid slots
        np.testing.assert_array_equal(group_signal(name, rewards, valid), [False, False, False])
        np.testing.assert_array_equal(group_signal(name, rewards), [False, True, False])
    # gdpo: two components that each vary but cancel give no signal; the combined advantage decides.
    components = np.stack([rewards, 1.0 - rewards], -1)
    np.testing.assert_array_equal(group_signal("gdpo", components, weights=[1.0, 1.0]), [False, False, False])
    np.testing.assert_array_equal(group_signal("gdpo", components, weights=[1.0, 0.5]), [False, True, False])
