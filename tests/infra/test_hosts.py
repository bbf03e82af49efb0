"""Failing together: what every process raises when one of them failed (decided by type, one process here)."""

import numpy as np
import pytest

from drgrpo_jax.errors import ConfigError, HostFailure, RewardError, RolloutError, StaleWeightsError
from drgrpo_jax.hosts import fail_together, failure_code, remote_failure


def test_the_failing_process_raises_its_own_error():
    with pytest.raises(StaleWeightsError, match="weight_version"), fail_together("sampling step 1"):
        raise StaleWeightsError("weight_version: got '1', expected '2'")
    with fail_together("nothing"):
        pass


@pytest.mark.parametrize("error, raised", [
    (RewardError("nan"), RewardError),
    (RolloutError("down", status=503), RolloutError),
    (StaleWeightsError("old"), RolloutError),
])
def test_the_other_processes_raise_reward_and_rollout_errors_as_themselves(error, raised):
    codes = np.asarray([0, failure_code(error), 0])
    failure = remote_failure(codes, "sampling step 3")
    assert type(failure) is raised and str(failure) == "sampling step 3 failed on process 1 (see its log)"


@pytest.mark.parametrize("error, kind", [(ConfigError("data.path", "no such file"), "ConfigError"),
                                         (KeyError("x"), "Exception")])
def test_anything_else_is_a_host_failure_not_a_config_error(error, kind):
    failure = remote_failure(np.asarray([failure_code(error), failure_code(RewardError("later"))]), "loading data")
    assert isinstance(failure, HostFailure) and not isinstance(failure, ConfigError)
    assert (failure.what, failure.process, failure.kind) == ("loading data", 0, kind)
    assert remote_failure(np.asarray([0, 0]), "loading data") is None
