"""mesh.context: its field, its rules (one line each, naming the key, before anything compiles) and the device count."""

import typing

import pytest

from drgrpo_jax.config import rules
from drgrpo_jax.config.load import load_config
from drgrpo_jax.config.schema import ModelConfig
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.launch.cluster import run_shape

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


@pytest.mark.parametrize("ways", [2, 4, 8, 128])
def test_ways_that_split_the_padded_row_into_early_and_late_chunks_pass(ways):
    """256 + 256 = 512 tokens: 2 * ways chunks divide it up to ways = 256."""
    config = load_config(None, [*BASE, f"mesh.context={ways}"])
    assert rules.context_row_length(config) == 512 and config.mesh.context == ways


@pytest.mark.parametrize("overrides, fragments", [
    (["mesh.context=0"], ["must be >= 1, got 0"]),
    (["mesh.context=3"], ["3 ways split each row into 6 chunks", "rollout.max_prompt_tokens + "
                          "rollout.max_new_tokens = 512 tokens"]),
    (["mesh.context=512"], ["1024 chunks", "= 512 tokens"]),
    (["rollout.max_new_tokens=255", "mesh.context=2"], ["4 chunks", "= 511 tokens"]),
    # Packed rows split train.pack_length, whose default is the longest sequence the model reads (511 here).
    (["train.pack_rows=2", "mesh.context=2"], ["train.pack_length = 511 tokens"]),
    (["model.attention_impl=splash", "mesh.context=2"], ["model.attention_impl=splash", "use auto or blockwise"]),
    (["model.attention_impl=cudnn", "mesh.context=2"], ["model.attention_impl=cudnn", "use auto or blockwise"]),
])
def test_each_context_rule_is_one_line_naming_mesh_context(overrides, fragments):
    message = _refused(overrides)
    assert message.startswith("mesh.context: ")
    for fragment in fragments:
        assert fragment in message, message


def test_packed_rows_split_their_pack_length():
    config = load_config(None, [*BASE, "train.pack_rows=2", "train.pack_length=1024", "mesh.context=4"])
    assert rules.context_row_length(config) == 1024


@pytest.mark.parametrize("impl", ["splash", "cudnn"])
def test_whole_row_kernels_pass_without_context(impl):
    assert load_config(None, [*BASE, f"model.attention_impl={impl}"]).mesh.context == 1


def test_the_refused_options_are_values_the_schema_offers():
    """The one table of options that cannot take the split names real keys and choices."""
    choices = typing.get_args(typing.get_type_hints(ModelConfig)["attention_impl"])
    assert rules._WHOLE_ROW_OPTIONS
    for key, value, _why in rules._WHOLE_ROW_OPTIONS:
        assert key == "model.attention_impl" and value in choices


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
