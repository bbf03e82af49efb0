"""Host `StepMetrics` with distinct values in every field, for the tests of the step's metrics and the row."""

import dataclasses

import numpy as np

from drgrpo_jax.step.metrics import RouterMetrics, StepMetrics, TokenMeans


def host_step_metrics(scale: float = 1.0, *, router: bool = True, packed: bool = True) -> StepMetrics:
    """Metrics as `jax.device_get` hands them over (float32 numpy), each value times `scale`; a two-layer router
    with `router`, `pack_overflow` with `packed`."""

    def f32(value):
        return np.asarray(np.multiply(value, scale), np.float32)

    return StepMetrics(
        tokens=TokenMeans(**{field.name: f32(k + 1) for k, field in enumerate(dataclasses.fields(TokenMeans))}),
        router=RouterMetrics(aux_loss=f32(1.5), z_loss=f32(2.5), expert_max_share_L=f32([0.5, 0.75]),
                             expert_entropy_L=f32([0.25, 0.125])) if router else None,
        pack_overflow=f32(0) if packed else None,
        loss=f32(-0.5), grad_norm=f32(3), learning_rate=f32(1e-3), num_responses=f32(4), num_tokens=f32(14),
        skipped=f32(0))
