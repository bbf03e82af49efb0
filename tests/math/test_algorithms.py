"""The algorithm table: each name binds an estimator and an aggregation; forbidden options fail clearly."""

import pytest

from drgrpo_jax import advantages
from drgrpo_jax.algorithms import ALGORITHMS, check_algorithm_options
from drgrpo_jax.errors import FieldError
from drgrpo_jax.losses import LossConfig


def test_dr_grpo_is_one_switch_for_both_halves():
    algorithm = ALGORITHMS["dr_grpo"]
    assert algorithm.advantage_fn is advantages.dr_grpo
    assert algorithm.aggregation == "fixed_budget"


def test_every_entry_is_consistent():
    assert set(ALGORITHMS) == {"dr_grpo", "grpo", "dapo", "rloo", "gdpo", "gspo", "gspo_token", "cispo"}
    for name, algorithm in ALGORITHMS.items():
        assert algorithm.name == name
        LossConfig(aggregation=algorithm.aggregation, budget=16, policy_loss=algorithm.policy_loss)
    assert ALGORITHMS["grpo"].aggregation == "seq_mean_token_mean"
    assert ALGORITHMS["dapo"].aggregation == "token_mean"
    assert ALGORITHMS["gdpo"].multi_reward
    with pytest.raises(TypeError):
        ALGORITHMS["new"] = ALGORITHMS["grpo"]  # the table is read-only


@pytest.mark.parametrize(
    "name, kwargs, error, field",
    [
        ("dr_grpo", dict(scale_rewards=True, budget=64), ValueError, "algorithm.scale_rewards"),
        ("dr_grpo", dict(whiten_advantages=True, budget=64), ValueError, "algorithm.whiten_advantages"),
        ("dr_grpo", dict(kl_in_reward=True, budget=64), ValueError, "algorithm.kl_in_reward"),
        ("dr_grpo", dict(budget=True), TypeError, "LossConfig.budget"),
        ("dr_grpo", dict(budget=64.0), TypeError, "LossConfig.budget"),
        ("dr_grpo", dict(budget=0), ValueError, "LossConfig.budget"),
        ("dr_grpo", dict(budget=64, group_size=1), ValueError, "algorithm.group_size"),
        ("grpo", dict(scale_rewards=True), ValueError, "algorithm.scale_rewards"),
        ("gdpo", dict(whiten_advantages=True), ValueError, "algorithm.whiten_advantages"),
        ("rloo", dict(scale_rewards="yes"), TypeError, "algorithm.scale_rewards"),
        ("ppo", dict(), ValueError, "algorithm.name"),
    ],
)
def test_forbidden_options_name_the_key(name, kwargs, error, field):
    with pytest.raises(error) as info:
        check_algorithm_options(name, **kwargs)
    message = str(info.value)
    assert message.startswith(field) and "\n" not in message
    assert isinstance(info.value, FieldError) and f"{info.value.owner}.{info.value.field}" == field


def test_allowed_options_pass():
    check_algorithm_options("dr_grpo", budget=64, group_size=2)
    check_algorithm_options("rloo", scale_rewards=True, whiten_advantages=True, group_size=4)
    check_algorithm_options("grpo", whiten_advantages=True)


def test_the_2025_successors_bind_their_surrogate_and_aggregation():
    expected = {"gspo": ("gspo", "seq_mean_token_mean"), "gspo_token": ("gspo_token", "seq_mean_token_mean"),
                "cispo": ("cispo", "token_mean")}
    for name, (policy_loss, aggregation) in expected.items():
        algorithm = ALGORITHMS[name]
        assert (algorithm.policy_loss, algorithm.aggregation) == (policy_loss, aggregation)
        assert algorithm.advantage_fn is advantages.grpo  # both papers normalise rewards within the group
        check_algorithm_options(name, whiten_advantages=True, budget=64, group_size=2)
        with pytest.raises(FieldError, match=rf"^algorithm.scale_rewards: {name} forbids it.*already divides"):
            check_algorithm_options(name, scale_rewards=True)
    assert all(ALGORITHMS[name].policy_loss == "ppo_clip" for name in ("dr_grpo", "grpo", "dapo", "rloo", "gdpo"))
