"""GSPO, GSPO-token and CISPO against float64 oracles; their window exactness; clip gradients on the bound."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from drgrpo_jax.errors import FieldError
from drgrpo_jax.losses import LossConfig, loss_fn, window_stats

from support import oracles

BUDGET = 256
NEW_LOSSES = ["gspo", "gspo_token", "cispo"]
AGGREGATIONS = ["fixed_budget", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


def window(seed=0, noise=0.3):
    """16 responses of 256/64/16/4 tokens (one fully masked), per-token ratios spread around 1."""
    rng = np.random.default_rng(seed)
    lengths = np.repeat([256, 64, 16, 4], 4)
    lengths[5] = 0
    mask = np.arange(BUDGET)[None, :] < lengths[:, None]
    old = rng.normal(-2.0, 0.5, size=mask.shape).astype(np.float32)
    # A per-row drift moves some sequence ratios out of GSPO's narrow clip range, noise the tokens'.
    drift = rng.normal(0, 0.01, size=(16, 1))
    logprobs = (old + drift + rng.normal(0, noise, size=mask.shape)).astype(np.float32)
    adv = rng.normal(size=16).astype(np.float32)
    return dict(logprobs=logprobs, old=old, adv=adv, mask=mask)


def config_for(policy_loss, aggregation=None, **kw):
    aggregation = aggregation or ("seq_mean_token_mean" if policy_loss.startswith("gspo") else "token_mean")
    gspo = policy_loss.startswith("gspo")
    clips = dict(clip_low=3e-3, clip_high=4e-3) if gspo else dict(clip_low=0.2, clip_high=0.28)
    return LossConfig(aggregation=aggregation, budget=BUDGET, policy_loss=policy_loss, **(clips | kw))


def value_and_grad(w, config, rows=slice(None), **kw):
    def f(logprobs):
        return loss_fn(logprobs, w["old"][rows], w["adv"][rows], w["mask"][rows], config=config, **kw)

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(w["logprobs"][rows])
    return loss, metrics, grad


def token_weights(mask, aggregation, budget):
    """d(window loss) / d(l_it): the aggregation's weight of each token's loss (float64)."""
    mask = np.asarray(mask, bool)
    n, t = mask.shape[0], mask.sum()
    lengths = np.maximum(mask.sum(axis=1, keepdims=True), 1)
    weight = {"fixed_budget": 1 / (n * budget), "token_mean": 1 / t, "seq_mean_token_sum": 1 / n,
              "seq_mean_token_mean": 1 / (lengths * n)}[aggregation]
    return mask * weight


def assert_close(actual, desired, what, rtol=1e-5):
    desired = np.asarray(desired)
    # Terms of size ~1 cancel in these sums: the absolute floor is float32 rounding of such terms.
    np.testing.assert_allclose(actual, desired, rtol=rtol, atol=max(rtol * np.abs(desired).max(), 1e-7), err_msg=what)


@pytest.mark.parametrize("policy_loss", ["ppo_clip", *NEW_LOSSES])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_loss_and_gradient_match_the_oracle(policy_loss, aggregation):
    w = window()
    config = config_for(policy_loss, aggregation)
    loss, metrics, grad = value_and_grad(w, config)
    token_loss, token_grad = oracles.policy_gradient(w["logprobs"], w["old"], w["adv"], w["mask"], config.clip_low,
                                                     config.upper_clip, policy_loss)
    assert_close(loss, oracles.aggregate(token_loss, w["mask"], aggregation, BUDGET), "loss")
    assert_close(grad, token_grad * token_weights(w["mask"], aggregation, BUDGET), "gradient")
    assert 0 < float(metrics["clip_fraction"]) < 1, "the window exercises the clip"


def test_gspo_token_equals_gspo_with_sequence_advantages():
    w = window(1)
    gspo = value_and_grad(w, config_for("gspo"))
    token = value_and_grad(w, config_for("gspo_token"))
    for a, b, what in zip(gspo, token, ("loss", "metrics", "gradient")):
        jax.tree.map(lambda x, y, what=what: assert_close(x, y, what), a, b)


def test_gspo_token_takes_token_advantages():
    # Per-token advantages weight each token's gradient; the sequence ratio still sets the value and the clip.
    w = window(2)
    w["adv"] = np.random.default_rng(0).normal(size=w["mask"].shape).astype(np.float32)
    loss, _, grad = value_and_grad(w, config_for("gspo_token"))
    seq = np.exp([np.mean((w["logprobs"][i] - w["old"][i])[w["mask"][i]]) if w["mask"][i].any() else 0.0
                  for i in range(16)])[:, None]
    flows = ~(((seq > 1.004) & (w["adv"] > 0)) | ((seq < 0.997) & (w["adv"] < 0)))
    expected = -w["adv"] * seq * flows * token_weights(w["mask"], "seq_mean_token_mean", BUDGET)
    assert_close(grad, expected, "gradient")
    assert np.isfinite(float(loss))


def test_cispo_keeps_every_token_in_the_gradient():
    w = window(3, noise=1.0)  # ratios far outside [0.8, 1.28]
    ppo = value_and_grad(w, config_for("ppo_clip"))[2]
    cispo = value_and_grad(w, config_for("cispo"))[2]
    token = w["mask"] & (w["adv"][:, None] != 0)
    assert np.all(np.asarray(cispo)[token] != 0), "no token leaves CISPO's gradient"
    assert np.any(np.asarray(ppo)[token] == 0), "PPO's clip drops some"


@pytest.mark.parametrize("policy_loss", NEW_LOSSES)
@pytest.mark.parametrize("num_slices", [2, 4, 8])
def test_micro_batch_slices_sum_to_the_window(policy_loss, num_slices):
    w = window(4)
    config = config_for(policy_loss)
    loss, metrics, grad = value_and_grad(w, config)
    stats = window_stats(w["mask"])
    order = np.random.default_rng(num_slices).permutation(16)
    total, total_metrics, sliced = 0.0, dict.fromkeys(metrics, 0.0), np.zeros_like(grad)
    for rows in np.split(order, num_slices):
        part, part_metrics, part_grad = value_and_grad(w, config, rows, window=stats)
        total += part
        total_metrics = {k: total_metrics[k] + part_metrics[k] for k in metrics}
        sliced[rows] = part_grad
    assert_close(total, loss, "loss")
    assert_close(sliced, grad, "gradient")
    for k in metrics:
        assert_close(total_metrics[k], metrics[k], k)


@pytest.mark.parametrize("policy_loss", NEW_LOSSES)
@pytest.mark.parametrize("devices", [2, 8])
def test_shard_map_gives_the_global_loss_and_gradient(policy_loss, devices):
    w = window(5)
    config = config_for(policy_loss)
    loss, metrics, grad = value_and_grad(w, config)
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])

    def per_shard(logprobs, old, adv, mask):
        def f(lp):
            return loss_fn(lp, old, adv, mask, config=config, axis_name="data")

        (shard_loss, shard_metrics), shard_grad = jax.value_and_grad(f, has_aux=True)(logprobs)
        return shard_loss, shard_metrics, shard_grad

    sharded = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=(P(), P(), P("data"))))
    args = [jax.device_put(w[k], NamedSharding(mesh, P("data"))) for k in ("logprobs", "old", "adv", "mask")]
    got_loss, got_metrics, got_grad = sharded(*args)
    assert_close(got_loss, loss, "loss")
    assert_close(got_grad, grad, "gradient")
    for k in metrics:
        assert_close(got_metrics[k], metrics[k], k)


@pytest.mark.parametrize("policy_loss", NEW_LOSSES)
def test_empty_window_and_padding_garbage(policy_loss):
    mask = np.zeros((4, 8), bool)
    garbage = np.full((4, 8), np.nan, np.float32)
    config = config_for(policy_loss)
    (loss, metrics), grad = jax.value_and_grad(
        lambda lp: loss_fn(lp, garbage, np.ones(4, np.float32), mask, config=config), has_aux=True)(garbage)
    assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0)
    assert all(np.isfinite(v) for v in metrics.values())
    w = window(6)
    clean = value_and_grad(w, config)
    dirty = dict(w, logprobs=np.where(w["mask"], w["logprobs"], np.nan), old=np.where(w["mask"], w["old"], np.inf))
    got = value_and_grad(dirty, config)
    assert float(got[0]) == float(clean[0])
    np.testing.assert_array_equal(got[2], clean[2])


def exact_ratio_logprob(bound: float) -> np.float32:
    """A float32 log-prob x with exp(x) (XLA's, in float32) exactly float32(bound)."""
    target = np.float32(bound)
    x = np.float32(np.log(bound))
    for step in range(200):
        for candidate in (x + np.float32(step) * np.spacing(x), x - np.float32(step) * np.spacing(x)):
            if np.float32(jnp.exp(jnp.float32(candidate))) == target:
                return np.float32(candidate)
    raise AssertionError(f"no float32 log-prob hits {bound} exactly")


@pytest.mark.parametrize("clip_low, clip_high", [(0.2, 0.28), (0.2, 0.2)])
def test_clip_gradient_on_the_bound_equals_torch(clip_low, clip_high):
    """At ratios exactly 1 - clip_low and 1 + clip_high the gradient flows in full, as torch.clamp's (TRL, verl)."""
    import torch  # the dev extra installs it: a missing torch is a failure, not a skip
    low, high = exact_ratio_logprob(1 - clip_low), exact_ratio_logprob(1 + clip_high)
    logprobs = np.array([[high, low, high, low]], np.float32)
    adv = np.array([[2.0, -3.0, -1.5, 0.5]], np.float32)
    mask = np.ones_like(logprobs, bool)
    config = LossConfig("token_mean", clip_low=clip_low, clip_high=clip_high)
    grad = jax.grad(lambda lp: loss_fn(lp, np.zeros_like(logprobs), adv, mask, config=config)[0])(logprobs)

    ratio_value = np.asarray(jnp.exp(jnp.asarray(logprobs)))  # XLA's ratios: exactly on the bounds
    assert ratio_value[0, 0] == np.float32(1 + clip_high) and ratio_value[0, 1] == np.float32(1 - clip_low)
    ratio = torch.tensor(ratio_value, requires_grad=True)
    a = torch.from_numpy(adv)
    # TRL's and verl's PPO surrogate, token-mean over the 4 tokens.
    torch_loss = -torch.min(ratio * a, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * a).sum() / 4
    torch_loss.backward()
    expected = ratio.grad.numpy() * ratio_value  # d ratio / d logprob = ratio
    np.testing.assert_allclose(grad, expected, rtol=1e-6)
    # By hand: every token's gradient is -A * ratio / 4 (the clip removes none on the bound itself).
    np.testing.assert_allclose(grad, -adv * ratio_value / 4, rtol=1e-6)


def test_clip_gradient_past_the_bound_is_zero():
    # A few float32 steps past the upper bound with A > 0, and below the lower with A < 0, the clip removes it.
    high, low = exact_ratio_logprob(1.28), exact_ratio_logprob(0.8)
    logprobs = np.array([[high + 4 * np.spacing(high), low - 4 * np.spacing(np.abs(low))]], np.float32)
    adv = np.array([[1.0, -1.0]], np.float32)
    config = LossConfig("token_mean", clip_low=0.2, clip_high=0.28)
    grad = jax.grad(lambda lp: loss_fn(lp, jnp.zeros_like(lp), adv, np.ones((1, 2), bool), config=config)[0])(logprobs)
    np.testing.assert_array_equal(grad, 0.0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(policy_loss="reinforce"), "LossConfig.policy_loss"),
        (dict(policy_loss="cispo", dual_clip=3.0), "LossConfig.dual_clip"),
    ],
)
def test_bad_policy_loss_configs_name_the_field(kwargs, field):
    with pytest.raises(FieldError) as info:
        LossConfig("token_mean", **kwargs)
    assert str(info.value).startswith(field) and "\n" not in str(info.value)
