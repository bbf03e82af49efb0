"""The step's typed metrics: the loss's dict fills them field for field, and their row keeps metrics.jsonl's keys."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from drgrpo_jax.losses import LossConfig, loss_fn
from drgrpo_jax.step.metrics import StepMetrics, TokenMeans

from support.step_metrics import host_step_metrics

SAMPLER_FIELDS = {"behaviour_kl": 0.25, "tis_weight": 0.5, "is_truncated": 0.125, "is_dropped": 0.0625}


def _loss_metrics() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    mask = np.arange(6)[None, :] < np.array([[6], [3], [0], [5]])
    old = rng.normal(-2.0, 0.5, mask.shape).astype(np.float32)
    logprobs = (old + rng.normal(0, 0.3, mask.shape)).astype(np.float32)
    _, metrics = loss_fn(logprobs, old, rng.normal(size=4).astype(np.float32), mask,
                         config=LossConfig(budget=6, kl_coef=0.1, entropy_coef=0.01),
                         ref_logprobs=old, entropy=np.ones_like(old))
    return metrics


def test_the_loss_metrics_fill_the_token_means_field_for_field():
    loss_metrics = _loss_metrics()
    fields = {field.name for field in dataclasses.fields(TokenMeans)}
    assert set(loss_metrics) == fields - set(SAMPLER_FIELDS), "a loss metric without a field (or a field without it)"
    means = TokenMeans.of_loss(loss_metrics, **SAMPLER_FIELDS)
    for name, value in {**loss_metrics, **SAMPLER_FIELDS}.items():
        assert getattr(means, name) == value, name


def test_a_renamed_or_new_loss_metric_fails_instead_of_vanishing():
    loss_metrics = _loss_metrics()
    renamed = {("clipfrac" if k == "clip_fraction" else k): v for k, v in loss_metrics.items()}
    with pytest.raises(TypeError):
        TokenMeans.of_loss(renamed, **SAMPLER_FIELDS)
    with pytest.raises(TypeError):
        TokenMeans.of_loss({**loss_metrics, "new_metric": jnp.float32(1)}, **SAMPLER_FIELDS)


def test_the_row_has_metrics_jsonl_keys_in_their_order():
    """These keys are public (dashboards read them): a renamed field must not rename a key."""
    step_keys = ["loss", "grad_norm", "learning_rate", "num_responses", "num_tokens", "skipped"]
    token_keys = ["pg_loss", "kl", "entropy", "clip_fraction", "approx_kl", "behaviour_kl", "tis_weight",
                  "is_truncated", "is_dropped"]
    router_keys = ["router_aux_loss", "router_z_loss", "expert_max_share/0", "expert_entropy/0",
                   "expert_max_share/1", "expert_entropy/1"]
    assert list(host_step_metrics(router=False, packed=False).row()) == token_keys + step_keys
    row = host_step_metrics(router=True, packed=True).row()
    assert list(row) == token_keys + router_keys + ["pack_overflow"] + step_keys
    assert all(type(value) is float for value in row.values())
    assert row["expert_max_share/1"] == 0.75 and row["expert_entropy/0"] == 0.25 and row["router_z_loss"] == 2.5
    assert row["pg_loss"] == 1.0 and row["is_dropped"] == 9.0 and row["num_tokens"] == 14.0


def test_the_metrics_cross_jit_and_device_get_whole():
    metrics = host_step_metrics(router=True, packed=False)
    host = jax.device_get(jax.jit(lambda m: jax.tree.map(lambda x: 2 * x, m))(metrics))
    assert isinstance(host, StepMetrics) and host.pack_overflow is None
    assert host.row() == {key: 2 * value for key, value in metrics.row().items()}
