"""metrics.jsonl's row: the optimizer windows' typed metrics averaged field by field."""

import numpy as np

from drgrpo_jax.train.metrics import windows_mean

from support.step_metrics import host_step_metrics


def test_the_windows_mean_is_the_mean_of_each_key_of_their_rows():
    """Averaging by field gives what averaging the rows key by key gives (a mixture's per-layer loads included)."""
    history = [host_step_metrics(scale) for scale in (1.0, 2.0, 4.5)]
    rows = [metrics.row() for metrics in history]
    mean = windows_mean(history).row()
    assert list(mean) == list(rows[0])
    for key in rows[0]:
        assert mean[key] == float(np.mean([row[key] for row in rows])), key
    assert mean["expert_max_share/1"] == 0.75 * 7.5 / 3 and mean["loss"] == -0.5 * 7.5 / 3


def test_absent_parts_stay_absent_and_one_window_is_itself():
    history = [host_step_metrics(router=False, packed=False)]
    mean = windows_mean(history)
    assert mean.router is None and mean.pack_overflow is None
    assert mean.row() == history[0].row()
