"""model.moe: router replay and the router's coefficients, checked in one line naming the key; the coefficients reach
the step's StepConfig; replay needs a mixture, which is known once model.path's config.json is read."""

import pytest

from drgrpo_jax.config.derived import step_configs
from drgrpo_jax.config.load import load_config
from drgrpo_jax.config.rules import check_model_options
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.models.config import DecoderConfig

BASE = ["model.path=some/model"]


def _error(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(None, BASE + overrides)
    assert "\n" not in str(info.value)
    return info.value


def test_the_router_terms_are_off_by_default_and_reach_the_step():
    default = load_config(None, BASE)
    assert default.model.moe.router_replay is False
    assert step_configs(default)[0].router_aux_coef == step_configs(default)[0].router_z_coef == 0.0
    config = load_config(None, BASE + ["model.moe.router_replay=true", "model.moe.router_aux_coef=0.01",
                                       "model.moe.router_z_coef=0.001"])
    train, logprob = step_configs(config)
    assert (train.router_aux_coef, train.router_z_coef) == (0.01, 0.001)
    assert (logprob.router_aux_coef, logprob.router_z_coef) == (0.01, 0.001)


@pytest.mark.parametrize("key", ["model.moe.router_aux_coef", "model.moe.router_z_coef"])
@pytest.mark.parametrize("value", ["-0.1", "inf", "nan"])
def test_a_negative_or_infinite_coefficient_is_refused(key, value):
    error = _error([f"{key}={value}"])
    assert error.key == key and "must be finite and >= 0" in str(error)


def test_replay_with_multi_turn_episodes_is_refused():
    error = _error(["model.moe.router_replay=true", "environment.tools=[calculator]"])
    assert error.key == "model.moe.router_replay" and "single-turn rollouts only" in str(error)


def test_replay_needs_a_mixture_once_the_model_is_known():
    config = load_config(None, BASE + ["model.moe.router_replay=true"])
    dense = DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=8)
    with pytest.raises(ConfigError, match=r"^model\.moe\.router_replay: needs a mixture-of-experts model; llama is "
                                          r"dense"):
        check_model_options(config, dense)
    check_model_options(load_config(None, BASE), dense)  # off: any model
