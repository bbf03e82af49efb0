"""GDPO's reward components: a batch of very different scales, collapsed, ragged and padded groups, and its
8-group version (tests/math/test_gdpo.py, support/gdpo_two_process_worker.py)."""

from __future__ import annotations

import numpy as np

GDPO_WEIGHTS = [1.0, 0.5, 2.0]


def mixed_batch():
    """Components of very different scales, a collapsed component, ragged groups and padding slots."""
    rng = np.random.default_rng(0)
    shape = (7, 6)
    components = np.stack([rng.integers(0, 2, shape), rng.normal(300.0, 150.0, shape), rng.normal(0, 0.01, shape)], -1)
    components = components.astype(np.float32)
    components[0, :, 0] = 1.0  # correctness collapsed in group 0: contributes exactly 0
    components[1, :, :] = [0.0, 250.0, 0.005]  # every component collapsed: zero-signal group
    valid = np.ones(shape, bool)
    valid[2, 4:] = False  # ragged group of 4
    valid[3, 1:] = False  # a group of one
    valid[4, :] = False  # all padding
    components[~valid] = 1e6  # garbage in padding slots must not leak into any statistic
    return components, valid


def eight_group_batch():
    """The mixed batch with one more group, so 8 devices (or 2 processes x 4) hold whole groups each."""
    components, valid = mixed_batch()
    return np.concatenate([components, components[:1]]), np.concatenate([valid, valid[:1]])
