"""The run configuration: frozen typed sections, YAML + dotted overrides, validation with one-line errors.

OmegaConf structured configs do the typed merge (wrong types, unknown keys, Literal choices); `validate`
(`rules.py`) adds the cross-field rules so a bad config fails before anything compiles, and leaves the library's
own rules to its configs: it builds them (`derived.step_configs`) and names the config key of any field they refuse
(`_LIBRARY_KEYS`). Sections and their fields: `schema.py`; loading and the command line: `load.py`; the generation
service's settings, its flags and its YAML, through the same fields and typed merge: `serve.py`; command-line flags
made from fields (the service's, the evaluator's): `flags.py`; the services' API key rule: `api_keys.py`.
"""

from drgrpo_jax.config.derived import (
    component_names,
    function_name,
    lora_base_dtype,
    lora_spec,
    one_window_per_rollout,
    pack_length,
    step_configs,
)
from drgrpo_jax.config.load import (
    check_paths,
    config_from_argv,
    describe_config,
    dump_config,
    load_config,
    resolve_model_path,
)
from drgrpo_jax.config.rules import validate
from drgrpo_jax.config.schema import (
    TRACKERS,
    AlgorithmConfig,
    Config,
    DataConfig,
    LoraConfig,
    MeshConfig,
    ModelConfig,
    MoeConfig,
    OptimizerConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "AlgorithmConfig", "Config", "DataConfig", "LoraConfig", "MeshConfig", "ModelConfig", "MoeConfig",
    "OptimizerConfig", "RewardConfig", "RolloutConfig", "RunConfig", "TRACKERS", "TrainConfig", "check_paths",
    "component_names", "config_from_argv", "describe_config", "dump_config", "function_name", "load_config",
    "lora_base_dtype", "lora_spec", "one_window_per_rollout", "pack_length", "resolve_model_path", "step_configs",
    "validate"
]

