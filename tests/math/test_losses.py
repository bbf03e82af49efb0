"""loss_fn against a float64 oracle, and its invariance to micro-batch splits and mesh shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from drgrpo_jax.errors import FieldError
from drgrpo_jax.losses import LossConfig, loss_fn, window_stats

from support import oracles

AGGREGATIONS = ["fixed_budget", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
BUDGET = 1024


def mixed_window(seed=0):
    """The Relax Dr.GRPO review's window: 16 responses of 1024/256/64/16 tokens, one fully masked."""
    rng = np.random.default_rng(seed)
    lengths = np.repeat([1024, 256, 64, 16], 4)
    lengths[5] = 0  # a valid response with no token left (e.g. everything filtered)
    mask = np.arange(BUDGET)[None, :] < lengths[:, None]
    old = rng.normal(-2.0, 0.5, size=mask.shape).astype(np.float32)
    logprobs = (old + rng.normal(0, 0.3, size=mask.shape)).astype(np.float32)  # some ratios leave the clip range
    ref = (old + rng.normal(0, 0.1, size=mask.shape)).astype(np.float32)
    entropy = rng.uniform(0, 3, size=mask.shape).astype(np.float32)
    adv = rng.normal(size=16).astype(np.float32)
    return dict(logprobs=logprobs, old=old, ref=ref, entropy=entropy, adv=adv, mask=mask)


def config_for(aggregation, **kw):
    return LossConfig(aggregation=aggregation, budget=BUDGET, clip_low=0.2, clip_high=0.28, kl_coef=0.05,
                      entropy_coef=0.01, **kw)


def call(w, config, rows=slice(None), **kw):
    return loss_fn(w["logprobs"][rows], w["old"][rows], w["adv"][rows], w["mask"][rows], config=config,
                   ref_logprobs=w["ref"][rows], entropy=w["entropy"][rows], **kw)


def oracle_loss(w, config, row_valid=None):
    tokens = oracles.token_losses(w["logprobs"], w["old"], w["adv"], w["mask"], config.clip_low, config.upper_clip,
                                  config.kl_coef, w["ref"], config.kl_estimator, config.entropy_coef, w["entropy"],
                                  config.dual_clip)
    return oracles.aggregate(tokens, w["mask"], config.aggregation, config.budget, row_valid)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3"])
def test_matches_oracle_on_mixed_window(aggregation, kl_estimator):
    w = mixed_window()
    config = config_for(aggregation, kl_estimator=kl_estimator)
    loss, metrics = call(w, config)
    np.testing.assert_allclose(loss, oracle_loss(w, config), rtol=1e-5)
    assert loss.dtype == jnp.float32 and all(np.isfinite(v) for v in metrics.values())


def test_aggregation_values_by_hand():
    # Two rows, per-token loss -A at ratio 1: A = [1, 2], lengths [2, 1], budget 4.
    logprobs = np.zeros((2, 4), np.float32)
    mask = np.array([[1, 1, 0, 0], [1, 0, 0, 0]], bool)
    adv = np.array([1.0, 2.0], np.float32)
    expected = {"fixed_budget": -4 / (2 * 4), "token_mean": -4 / 3, "seq_mean_token_mean": -(1 + 2) / 2,
                "seq_mean_token_sum": -4 / 2}
    for aggregation, value in expected.items():
        loss, _ = loss_fn(logprobs, logprobs, adv, mask, config=LossConfig(aggregation=aggregation, budget=4))
        np.testing.assert_allclose(loss, value, rtol=1e-6, err_msg=aggregation)


def test_dual_clip_matches_oracle():
    w = mixed_window(1)
    w["logprobs"] = w["logprobs"] + 2.0  # large ratios, so the dual clip bounds negative advantages
    config = config_for("token_mean", dual_clip=3.0)
    np.testing.assert_allclose(call(w, config)[0], oracle_loss(w, config), rtol=1e-5)
    assert not np.isclose(call(w, config)[0], call(w, config_for("token_mean"))[0])


def test_padding_rows_do_not_count():
    w = mixed_window(2)
    row_valid = np.ones(16, bool)
    row_valid[[1, 9]] = False
    for aggregation in AGGREGATIONS:
        config = config_for(aggregation)
        loss, _ = call(w, config, row_valid=row_valid)
        np.testing.assert_allclose(loss, oracle_loss(w, config, row_valid), rtol=1e-5, err_msg=aggregation)
    stats = window_stats(w["mask"], row_valid)
    assert float(stats.num_responses) == 14
    assert float(stats.num_tokens) == w["mask"][row_valid].sum()


def grad_logprobs(w, config, rows=slice(None), **kw):
    def f(logprobs):
        return loss_fn(logprobs, w["old"][rows], w["adv"][rows], w["mask"][rows], config=config,
                       ref_logprobs=w["ref"][rows], entropy=w["entropy"][rows], **kw)

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(w["logprobs"][rows])
    return loss, metrics, grad


def assert_close(actual, desired, what):
    desired = np.asarray(desired)
    np.testing.assert_allclose(actual, desired, rtol=1e-5, atol=1e-5 * np.abs(desired).max(), err_msg=what)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("num_slices", [2, 4, 8])
def test_micro_batch_slices_sum_to_the_window(aggregation, num_slices):
    w = mixed_window()
    config = config_for(aggregation)
    loss, metrics, grad = grad_logprobs(w, config)
    window = window_stats(w["mask"])
    order = np.random.default_rng(num_slices).permutation(16)  # shuffled slices
    total, total_metrics, sliced_grad = 0.0, dict.fromkeys(metrics, 0.0), np.zeros_like(grad)
    for rows in np.split(order, num_slices):
        part, part_metrics, part_grad = grad_logprobs(w, config, rows, window=window)
        total += part
        total_metrics = {k: total_metrics[k] + part_metrics[k] for k in metrics}
        sliced_grad[rows] = part_grad
    assert_close(total, loss, "loss")
    assert_close(sliced_grad, grad, "gradient")
    for k in metrics:
        assert_close(total_metrics[k], metrics[k], k)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_shard_map_gives_the_global_loss_and_gradient(aggregation, devices):
    w = mixed_window()
    config = config_for(aggregation)
    loss, metrics, grad = grad_logprobs(w, config)
    mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])

    def per_shard(logprobs, old, adv, mask, ref, entropy):
        def f(lp):
            return loss_fn(lp, old, adv, mask, config=config, ref_logprobs=ref, entropy=entropy, axis_name="data")

        (shard_loss, shard_metrics), shard_grad = jax.value_and_grad(f, has_aux=True)(logprobs)
        return shard_loss, shard_metrics, shard_grad

    sharded = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=(P(), P(), P("data"))))
    args = [w[k] for k in ("logprobs", "old", "adv", "mask", "ref", "entropy")]
    args = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in args]
    got_loss, got_metrics, got_grad = sharded(*args)
    assert_close(got_loss, loss, "loss")
    assert_close(got_grad, grad, "gradient")
    for k in metrics:
        assert_close(got_metrics[k], metrics[k], k)


def test_shard_map_gradient_of_shared_parameters():
    # Gradient wrt a replicated parameter (as in a trainer): psum of per-shard parts.
    w = mixed_window(3)
    config = LossConfig(budget=BUDGET, clip_high=0.28)
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])

    def loss_of_shift(shift, logprobs, axis_name=None):
        return loss_fn(logprobs + shift, w_old, w_adv, w_mask, config=config, axis_name=axis_name)[0]

    w_old, w_adv, w_mask = w["old"], w["adv"], w["mask"]
    expected = jax.grad(loss_of_shift)(jnp.float32(0.1), w["logprobs"])

    def per_shard(shift, logprobs, old, adv, mask):
        f = lambda s: loss_fn(logprobs + s, old, adv, mask, config=config, axis_name="data")[0]  # noqa: E731
        return jax.grad(f)(shift)

    args = [jax.device_put(w[k], NamedSharding(mesh, P("data"))) for k in ("logprobs", "old", "adv", "mask")]
    got = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), *[P("data")] * 4), out_specs=P()))(
        jnp.float32(0.1), *args)
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_dr_grpo_removes_the_length_bias_of_grpo():
    # Same advantage, lengths 10 and 100, ratio 1: per-token gradient weight is -A * w_i.
    mask = np.zeros((2, 100), bool)
    mask[0, :10] = True
    mask[1, :] = True
    logprobs = np.full((2, 100), -1.0, np.float32)
    adv = np.array([1.0, 1.0], np.float32)

    def token_weight(aggregation):
        config = LossConfig(aggregation=aggregation, budget=100)
        grad = jax.grad(lambda lp: loss_fn(lp, logprobs, adv, mask, config=config)[0])(logprobs)
        return -np.asarray(grad[0, 0]), -np.asarray(grad[1, 0])

    short, long = token_weight("seq_mean_token_mean")
    np.testing.assert_allclose([short, long], [1 / (2 * 10), 1 / (2 * 100)], rtol=1e-6)
    assert short > long, "GRPO weighs a short response's tokens more"
    short, long = token_weight("fixed_budget")
    np.testing.assert_allclose([short, long], [1 / (2 * 100)] * 2, rtol=1e-6)
    # A negative advantage: GRPO penalises each token of the long wrong answer less.
    grad = jax.grad(lambda lp: loss_fn(lp, logprobs, -adv, mask, config=LossConfig("seq_mean_token_mean"))[0])(logprobs)
    assert grad[1, 0] < grad[0, 0]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_empty_window_is_exactly_zero(aggregation):
    mask = np.zeros((4, 8), bool)
    garbage = np.full((4, 8), np.nan, np.float32)
    garbage[1] = -np.inf
    config = dataclasses.replace(config_for(aggregation), kl_coef=0.1)

    def f(lp):
        return loss_fn(lp, garbage, np.ones(4, np.float32), mask, config=config, ref_logprobs=garbage,
                       entropy=garbage)

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(garbage)
    assert float(loss) == 0.0
    assert np.all(np.asarray(grad) == 0)
    assert all(np.isfinite(v) and v == 0 for v in metrics.values())
    # Every row padding too: N_w = 0 as well.
    loss, _ = loss_fn(garbage, garbage, np.ones(4, np.float32), mask, config=config, ref_logprobs=garbage,
                      entropy=garbage, row_valid=np.zeros(4, bool))
    assert float(loss) == 0.0


def test_garbage_in_masked_slots_does_not_leak():
    w = mixed_window(4)
    config = config_for("fixed_budget")
    clean_loss, _, clean_grad = grad_logprobs(w, config)
    dirty = {k: (np.where(w["mask"], v, np.nan) if k in ("logprobs", "old", "ref", "entropy") else v)
             for k, v in w.items()}
    loss, _, grad = grad_logprobs(dirty, config)
    assert float(loss) == float(clean_loss)
    np.testing.assert_array_equal(grad, clean_grad)


def test_metrics_share_one_definition_across_aggregations():
    w = mixed_window(5)
    reference = call(w, config_for("fixed_budget"))[1]
    assert set(reference) >= {"pg_loss", "kl", "entropy", "clip_fraction", "approx_kl"}
    for aggregation in AGGREGATIONS[1:]:
        for k, v in call(w, config_for(aggregation))[1].items():
            np.testing.assert_allclose(v, reference[k], rtol=1e-6, err_msg=k)
    # token means: entropy metric equals the masked mean of the entropy input
    np.testing.assert_allclose(reference["entropy"], w["entropy"][w["mask"]].mean(), rtol=1e-5)
    assert 0 < float(reference["clip_fraction"]) < 1


def test_token_level_advantages_and_jit_agree():
    w = mixed_window(6)
    config = config_for("seq_mean_token_mean")
    per_row = call(w, config)
    w_tok = dict(w, adv=np.repeat(w["adv"][:, None], BUDGET, axis=1))
    np.testing.assert_allclose(call(w_tok, config)[0], per_row[0], rtol=1e-6)
    jitted = jax.jit(lambda w: call(w, config))(w)
    for got, want in zip(jax.tree.leaves(jitted), jax.tree.leaves(per_row)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_bfloat16_inputs_compute_in_float32():
    w = mixed_window(7)
    config = LossConfig("token_mean")
    loss, _ = loss_fn(w["logprobs"].astype(jnp.bfloat16), w["old"].astype(jnp.bfloat16), w["adv"], w["mask"],
                      config=config)
    assert loss.dtype == jnp.float32


@pytest.mark.parametrize(
    "kwargs, error, field",
    [
        (dict(aggregation="mean"), ValueError, "LossConfig.aggregation"),
        (dict(kl_estimator="k4", budget=4), ValueError, "LossConfig.kl_estimator"),
        (dict(budget=True), TypeError, "LossConfig.budget"),
        (dict(budget=4.0), TypeError, "LossConfig.budget"),
        (dict(budget=0), ValueError, "LossConfig.budget"),
        (dict(budget=None), ValueError, "LossConfig.budget"),
        (dict(budget=4, clip_low=-0.1), ValueError, "LossConfig.clip_low"),
        (dict(budget=4, clip_high=-0.1), ValueError, "LossConfig.clip_high"),
        (dict(budget=4, kl_coef=float("nan")), ValueError, "LossConfig.kl_coef"),
        (dict(budget=4, entropy_coef="0.1"), TypeError, "LossConfig.entropy_coef"),
        (dict(budget=4, dual_clip=0.5), ValueError, "LossConfig.dual_clip"),
        # what a foreign trainer's config may hand over: numpy and JAX values that are not numbers of the field
        (dict(budget=np.bool_(True)), TypeError, "LossConfig.budget"),
        (dict(budget=np.float64(8.0)), TypeError, "LossConfig.budget"),
        (dict(budget=jnp.float32(8)), TypeError, "LossConfig.budget"),
        (dict(budget=np.array([8])), TypeError, "LossConfig.budget"),
        (dict(budget=np.int64(0)), ValueError, "LossConfig.budget"),
        (dict(budget=4, clip_low=np.array([0.2, 0.3])), TypeError, "LossConfig.clip_low"),
        (dict(budget=4, clip_high=jnp.array(True)), TypeError, "LossConfig.clip_high"),
        (dict(budget=4, kl_coef=np.float32("nan")), ValueError, "LossConfig.kl_coef"),
        (dict(budget=4, entropy_coef=jnp.float32(float("inf"))), ValueError, "LossConfig.entropy_coef"),
        (dict(budget=4, dual_clip=np.complex64(2)), TypeError, "LossConfig.dual_clip"),
    ],
)
def test_bad_configs_name_the_field(kwargs, error, field):
    with pytest.raises(error) as info:
        LossConfig(**kwargs)
    message = str(info.value)
    assert message.startswith(field) and "\n" not in message
    assert isinstance(info.value, FieldError) and f"{info.value.owner}.{info.value.field}" == field


def test_missing_inputs_and_bad_shapes_are_errors():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="ref_logprobs"):
        loss_fn(x, x, np.zeros(2), x, config=LossConfig(budget=3, kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        loss_fn(x, x, np.zeros(2), x, config=LossConfig(budget=3, entropy_coef=0.1))
    with pytest.raises(AssertionError):
        loss_fn(x, x, np.zeros(3), x, config=LossConfig(budget=3))
    with pytest.raises(AssertionError):
        loss_fn(x, np.zeros((2, 4), np.float32), np.zeros(2), x, config=LossConfig(budget=3))


def test_numpy_and_jax_scalars_are_taken_as_python_numbers():
    config = LossConfig(budget=np.int64(8), clip_low=np.float32(0.25), clip_high=jnp.float32(0.5),
                        kl_coef=jnp.float32(0), entropy_coef=np.array(0.01), dual_clip=np.int32(3))
    assert config == LossConfig(budget=8, clip_low=0.25, clip_high=0.5, kl_coef=0.0, entropy_coef=0.01, dual_clip=3)
    for name in ("budget", "clip_low", "clip_high", "kl_coef", "entropy_coef", "dual_clip"):
        assert type(getattr(config, name)) in (int, float), name
    assert type(config.budget) is int
    hash(config)  # a static jit argument


def test_a_traced_value_is_refused_naming_the_field():
    def build(kl_coef):
        return LossConfig(budget=4, kl_coef=kl_coef)

    with pytest.raises(TypeError, match=r"^LossConfig.kl_coef: .*traced"):
        jax.jit(build)(0.1)
