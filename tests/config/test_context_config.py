"""mesh.context: its field, its rules (one line each, naming the key, before anything compiles) and the device count."""

import typing

import pytest

from drgrpo_jax.config.load import load_config
from drgrpo_jax.config.schema import ModelConfig
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.launch.cluster import run_shape
from drgrpo_jax.models.context_parallel import CANNOT_SPLIT

BASE = ["model.path=some/model"]  # defaults: 256 prompt + 256 budget tokens, 64 responses a step


def _refused(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, BASE + overrides)
    message = str(info.value)
    assert "\n" not in message and info.value.key == "mesh.context", message
    return message


def test_context_defaults_to_one_way_and_counts_in_the_mesh_devices():
    config = load_config(None, BASE)
    assert config.mesh.context == 1 and config.mesh.devices == 1
    config = load_config(None, [*BASE, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "mesh.context=2"])
    assert config.mesh.devices == 16


@pytest.mark.parametrize("ways", [2, 3, 8, 128])
def test_any_number_of_ways_splits_any_row(ways):
    """The step pads each row to whole chunks itself: 3 ways over 256 + 255 tokens, or packed rows of the default
    odd pack_length, are no error."""
    config = load_config(None, [*BASE, f"mesh.context={ways}", "rollout.max_new_tokens=255", "train.pack_rows=2"])
    assert config.mesh.context == ways


@pytest.mark.parametrize("overrides, fragments", [
    (["mesh.context=0"], ["must be >= 1, got 0"]),
    (["model.attention_impl=splash", "mesh.context=2"], ["model.attention_impl=splash", "use auto or blockwise"]),
    (["model.attention_impl=cudnn", "mesh.context=2"], ["model.attention_impl=cudnn", "use auto or blockwise"]),
])
def test_each_context_rule_is_one_line_naming_mesh_context(overrides, fragments):
    message = _refused(overrides)
    assert message.startswith("mesh.context: ")
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("impl", ["splash", "cudnn"])
def test_whole_row_kernels_pass_without_context(impl):
    assert load_config(None, [*BASE, f"model.attention_impl={impl}"]).mesh.context == 1


def test_the_refused_kernels_are_values_the_schema_offers():
    """The one list of kernels that cannot take the split (the model's) names real model.attention_impl choices."""
    choices = typing.get_args(typing.get_type_hints(ModelConfig)["attention_impl"])
    assert CANNOT_SPLIT and set(CANNOT_SPLIT) <= set(choices)


def test_the_generation_service_mesh_takes_no_context_axis():
    """Generation is not split by tokens: rollout.service_mesh (the service's --mesh) refuses it in one line."""
    with pytest.raises(ConfigError) as info:
        load_config(None, [*BASE, "rollout.service_mesh=context=2"])
    assert info.value.key == "rollout.service_mesh" and "'context=2' is not tensor=N or data=N" in str(info.value)


def test_the_launchers_count_context_ways_as_devices():
    config = load_config(None, [*BASE, "mesh.fsdp=2", "mesh.context=4", "train.micro_batches=1",
                                "mesh.num_processes=2", "mesh.coordinator_address=h:1", "rollout.urls=[http://s:1]"])
    shape = run_shape(config)
    assert (shape.processes, shape.devices_per_process, shape.devices) == (2, 4, 8)
    with pytest.raises(ConfigError, match="^mesh: data x fsdp x tensor x context = 6 devices do not split over "
                                          "mesh.num_processes = 4 processes$"):
        run_shape(load_config(None, [*BASE, "mesh.tensor=3", "mesh.context=2", "mesh.num_processes=4",
                                     "mesh.coordinator_address=h:1", "rollout.urls=[http://s:1]",
                                     "rollout.max_new_tokens=252"]))
