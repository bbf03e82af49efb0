"""Trainers that average micro-batch gradients (optax.MultiSteps, Tunix): the window's loss and gradient, exactly.

A host that averages k micro-batch gradients needs each share scaled by k (`loss_fn(..., averaged_over=k)`), and a
host that cuts the micro-batches itself needs the window's counts carried as columns of the batch
(`window_stats(..., per_row=True)`), computed before the cut. Checked against the float64 one-batch oracle for every
aggregation over unequal micro-batches (3, 8, 5 rows), and the advice without `averaged_over` shown to give 1/k.
The importance correction of the sampler's lag (tis_cap, mis_high) is checked the same way on responses that two
weight versions sampled (an in-flight weight update, issue #56).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from drgrpo_jax.losses import LossConfig, WindowStats, loss_fn, window_stats
from drgrpo_jax.step.config import StepConfig, importance_weights

from support import oracles

AGGREGATIONS = ["fixed_budget", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
BUDGET, FEATURES = 48, 3
SIZES = (3, 8, 5)  # unequal micro-batches: one window of 16 rows


def window_batch(seed=0):
    """16 responses of mixed lengths (one empty, one padding row); log pi = base + features @ w."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, BUDGET + 1, size=16)
    lengths[4] = 0  # a valid response with no token
    mask = np.arange(BUDGET)[None, :] < lengths[:, None]
    row_valid = np.ones(16, bool)
    row_valid[11] = False  # a padding row: counts nowhere
    old = rng.normal(-2.0, 0.5, size=mask.shape)
    base = old + rng.normal(0, 0.3, size=mask.shape)  # some ratios leave the clip range
    return dict(base=base, old=old, features=rng.normal(0, 0.2, size=mask.shape + (FEATURES,)),
                adv=rng.normal(size=16), mask=mask, row_valid=row_valid)


def config_for(aggregation):
    return LossConfig(aggregation=aggregation, budget=BUDGET, clip_low=0.2, clip_high=0.28)


def oracle(batch, config, w):
    """The window's loss and its gradient wrt w, as one batch, in float64 (ppo_clip, no KL or entropy)."""
    logprobs = batch["base"] + batch["features"] @ np.asarray(w, np.float64)
    mask = batch["mask"] & batch["row_valid"][:, None]
    token_loss, token_grad = oracles.policy_gradient(logprobs, batch["old"], batch["adv"], mask, config.clip_low,
                                                     config.upper_clip, config.policy_loss)
    weights = oracles.aggregation_weights(mask[batch["row_valid"]], config.aggregation, config.budget)
    weights_NT = np.zeros(mask.shape)
    weights_NT[batch["row_valid"]] = weights
    loss = oracles.aggregate(token_loss, batch["mask"], config.aggregation, config.budget, batch["row_valid"])
    return loss, np.einsum("nt,ntf->f", weights_NT * token_grad, batch["features"])


def with_window_columns(batch):
    """The host's batch with the window's counts as columns, computed on the whole window before any cut."""
    stats = window_stats(batch["mask"], batch["row_valid"], per_row=True)
    return dict(batch, num_responses=np.asarray(stats.num_responses), num_tokens=np.asarray(stats.num_tokens))


def micro_batches(batch):
    cuts = np.cumsum(SIZES)[:-1]
    return [{k: v[rows] for k, v in batch.items()} for rows in np.split(np.arange(16), cuts)]


def micro_loss(w, micro, config, averaged_over, correction=None):
    """A registered loss as a host sees it: its own micro-batch only, the window's counts among its columns.
    `correction` (a StepConfig): each token's advantage weighted by its importance weight from the micro-batch's
    behaviour log-probs, as the training step does (step/train_step.py)."""
    logprobs = jnp.asarray(micro["base"], jnp.float32) + jnp.asarray(micro["features"], jnp.float32) @ w
    window = WindowStats(jnp.asarray(micro["num_responses"]), jnp.asarray(micro["num_tokens"]))
    advantages = jnp.asarray(micro["adv"], jnp.float32)
    if correction is not None:
        token = micro["mask"] & micro["row_valid"][:, None]
        mismatch = jnp.where(token, jnp.asarray(micro["old"] - micro["behaviour"], jnp.float32), 0.0)
        advantages = advantages[:, None] * importance_weights(mismatch, correction)[0]
    return loss_fn(logprobs, jnp.asarray(micro["old"], jnp.float32), advantages,
                   micro["mask"], config=config, window=window, row_valid=micro["row_valid"],
                   averaged_over=averaged_over)


def multi_steps_update(batch, config, averaged_over, correction=None):
    """optax.MultiSteps(SGD, lr 1) over the micro-batches: the applied update is minus the mean gradient."""
    w0 = jnp.zeros(FEATURES, jnp.float32)
    optimizer = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=len(SIZES))
    state, w, losses = optimizer.init(w0), w0, []
    grad_fn = jax.jit(jax.value_and_grad(micro_loss, has_aux=True),
                      static_argnames=("config", "averaged_over", "correction"))
    for micro in micro_batches(with_window_columns(batch)):
        (loss, _), grad = grad_fn(w, micro, config, averaged_over, correction)
        updates, state = optimizer.update(grad, state, w)
        w = optax.apply_updates(w, updates)
        losses.append(float(loss))
    return np.mean(losses), -(np.asarray(w) - np.asarray(w0))


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_multi_steps_gives_the_window_loss_and_gradient(aggregation):
    batch, config = window_batch(), config_for(aggregation)
    loss, gradient = multi_steps_update(batch, config, averaged_over=len(SIZES))
    want_loss, want_gradient = oracle(batch, config, np.zeros(FEATURES))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(gradient, want_gradient, rtol=1e-4, atol=1e-7)


def two_version_behaviour(batch, seed=3):
    """Behaviour log-probs as an in-flight weight update leaves them: each response's tokens before its switch
    column sampled by version v, the rest by v + 1 over v's KV cache (closer to the trainer's old policy)."""
    rng = np.random.default_rng(seed)
    shape = batch["mask"].shape
    after_switch = np.arange(BUDGET)[None, :] >= rng.integers(0, BUDGET, (shape[0], 1))
    by_v = batch["old"] + rng.normal(0, 0.3, shape)
    by_next = batch["old"] + rng.normal(0, 0.05, shape)
    return np.where(after_switch, by_next, by_v), by_v


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("options", [dict(tis_cap=1.5), dict(mis_high=2.0, mis_low=0.5)])
def test_two_version_responses_are_corrected_token_by_token_and_window_exact(aggregation, level, options):
    """Each token's ratio uses the behaviour log-prob of the version that sampled it: the step's importance weights
    over unequal micro-batches give the float64 oracle's window loss and gradient."""
    batch, config = window_batch(2), config_for(aggregation)
    behaviour, by_v = two_version_behaviour(batch)
    correction = StepConfig(loss=config, tis_level=level, **options)
    loss, gradient = multi_steps_update(dict(batch, behaviour=behaviour), config, len(SIZES), correction)
    mask = batch["mask"] & batch["row_valid"][:, None]
    weight = oracles.importance_oracle(np.where(mask, batch["old"] - behaviour, 0.0), mask, level, **options)
    want_loss, want_gradient = oracle(dict(batch, adv=batch["adv"][:, None] * weight), config, np.zeros(FEATURES))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(gradient, want_gradient, rtol=1e-4, atol=1e-7)
    capped_or_dropped = weight[mask] == options.get("tis_cap", 0.0)
    assert 0 < capped_or_dropped.mean() < 1, "the cap or the mask acts on some tokens, not all"
    # Scored as if version v had sampled the whole response, the correction would be another one.
    one_version, _ = multi_steps_update(dict(batch, behaviour=by_v), config, len(SIZES), correction)
    assert abs(one_version - want_loss) > 1e-3 * abs(want_loss)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_without_averaged_over_the_gradient_is_one_kth(aggregation):
    batch, config = window_batch(1), config_for(aggregation)
    loss, gradient = multi_steps_update(batch, config, averaged_over=1)
    want_loss, want_gradient = oracle(batch, config, np.zeros(FEATURES))
    np.testing.assert_allclose(loss, want_loss / len(SIZES), rtol=1e-5)
    np.testing.assert_allclose(gradient, want_gradient / len(SIZES), rtol=1e-4, atol=1e-7)


def test_per_row_columns_are_the_window_counts_on_every_row():
    batch = window_batch()
    columns = window_stats(batch["mask"], batch["row_valid"], per_row=True)
    scalars = window_stats(batch["mask"], batch["row_valid"])
    for column, scalar in zip(columns, scalars):
        assert column.shape == (16,)
        np.testing.assert_array_equal(column, np.full(16, scalar))


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_per_row_and_scalar_windows_give_the_same_shares(aggregation):
    batch, config = with_window_columns(window_batch(2)), config_for(aggregation)
    scalars = window_stats(batch["mask"], batch["row_valid"])
    for micro in micro_batches(batch):
        per_row, per_row_metrics = micro_loss(jnp.zeros(FEATURES), micro, config, 1)
        logprobs = micro["base"] + micro["features"] @ np.zeros(FEATURES)
        scalar, scalar_metrics = loss_fn(jnp.asarray(logprobs, jnp.float32), jnp.asarray(micro["old"], jnp.float32),
                                         jnp.asarray(micro["adv"], jnp.float32), micro["mask"], config=config,
                                         window=scalars, row_valid=micro["row_valid"])
        np.testing.assert_allclose(per_row, scalar, rtol=1e-6, atol=1e-8)
        for name in scalar_metrics:
            np.testing.assert_allclose(per_row_metrics[name], scalar_metrics[name], rtol=1e-6, atol=1e-8)


def test_averaged_over_scales_metrics_so_their_mean_is_the_window():
    batch, config = with_window_columns(window_batch(3)), config_for("token_mean")
    _, window_metrics = micro_loss(jnp.zeros(FEATURES), dict(batch), config, 1)
    shares = [micro_loss(jnp.zeros(FEATURES), micro, config, len(SIZES))[1] for micro in micro_batches(batch)]
    for name, value in window_metrics.items():
        np.testing.assert_allclose(np.mean([share[name] for share in shares]), value, rtol=1e-5, atol=1e-8)


def test_bad_averaged_over_and_windows_are_refused():
    batch = with_window_columns(window_batch())
    config = config_for("token_mean")
    x = jnp.zeros((16, BUDGET), jnp.float32)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="averaged_over"):
            loss_fn(x, x, jnp.zeros(16), batch["mask"], config=config, averaged_over=bad)
    with pytest.raises(ValueError, match="needs the window"):
        loss_fn(x, x, jnp.zeros(16), batch["mask"], config=config, averaged_over=2)
    wrong_rows = WindowStats(jnp.ones(3), jnp.ones(3))
    with pytest.raises(AssertionError):
        loss_fn(x, x, jnp.zeros(16), batch["mask"], config=config, window=wrong_rows)
