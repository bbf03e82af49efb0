"""Config loading: YAML + dotted overrides, and one test per validation rule (one line, naming the key)."""

import dataclasses
import glob
import os
import runpy
import sys
import textwrap
import typing

import pytest

from drgrpo_jax.algorithms import ALGORITHMS
from drgrpo_jax.config.derived import optimizer_of, step_configs
from drgrpo_jax.config.load import check_paths, config_from_argv, describe_config, dump_config, load_config
from drgrpo_jax.config.rules import check_output_dir, validate
from drgrpo_jax.config.schema import TRACKERS, Config, LoraConfig, ModelConfig
from drgrpo_jax.errors import ConfigError, MissingValueError
from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models.precision import DTYPES
from drgrpo_jax.models.remat import REMAT_POLICIES
from drgrpo_jax.step.config import StepConfig
from drgrpo_jax.train import cli as train_cli
from drgrpo_jax.train import trackers

from support.paths import REPO

BASE = ["model.path=some/model"]  # the one field without a usable default


def _error(overrides: list[str], path=None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, BASE + overrides)
    return info.value


def _assert_one_line(error: ConfigError, key: str, *fragments: str) -> None:
    message = str(error)
    assert "\n" not in message
    assert message.startswith(f"{key}: "), message
    assert error.key == key
    for fragment in fragments:
        assert fragment in message, message


def test_defaults_and_overrides_are_typed():
    config = load_config(
        None,
        BASE
        + [
            "train.steps=3",
            "run.output_dir=runs/try1",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "optimizer.learning_rate=3e-6",
            "rollout.urls=[http://127.0.0.1:30000]",
            "data.task_options={min_terms: 2, max_terms: 3}",
            "algorithm.clip_high=0.28",
        ],
    )
    assert isinstance(config, Config)
    assert config.train.steps == 3 and config.run.output_dir == "runs/try1"
    assert (config.mesh.data, config.mesh.fsdp, config.mesh.tensor) == (2, 2, 2)
    assert config.optimizer.learning_rate == pytest.approx(3e-6) and isinstance(config.optimizer.learning_rate, float)
    assert config.rollout.urls == ("http://127.0.0.1:30000",)
    assert config.data.task_options == {"min_terms": 2, "max_terms": 3}
    assert config.algorithm.clip_high == pytest.approx(0.28)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.train.steps = 5  # type: ignore[misc]


def test_yaml_then_overrides_win(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        textwrap.dedent(
            """
            model: {path: m}
            train: {steps: 7, micro_batches: 2}
            rollout: {group_size: 4, prompts_per_step: 4}
            """
        )
    )
    config = load_config(path, ["train.steps=9"])
    assert config.train.steps == 9 and config.train.micro_batches == 2 and config.rollout.group_size == 4


def test_dump_round_trips(tmp_path):
    config = load_config(None, BASE + ["reward.functions=[math_verify,format]", "reward.weights=[1.0,0.5]"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(config))
    assert load_config(path, []) == config


def test_every_field_has_a_description():
    text = describe_config()
    for section in dataclasses.fields(Config):
        assert f"\n{section.name}: " in text
        for field in dataclasses.fields(section.default_factory):  # type: ignore[arg-type]
            assert field.metadata.get("help"), f"{section.name}.{field.name} has no description"
            key = field.name.removesuffix("_")  # a keyword's field (rollout.async_) shows under its key
            assert f"{section.name}.{key} = " in text


@pytest.mark.parametrize(
    "overrides, key, fragment",
    [
        (["train.stpes=3"], "train.stpes", "did you mean train.steps?"),
        (["trian.steps=3"], "trian", "did you mean train?"),
        (["rollout.groupsize=4"], "rollout.groupsize", "did you mean rollout.group_size?"),
        (["train.steps=abc"], "train.steps", "Integer"),
        (["rollout.max_new_tokens=1.5"], "rollout.max_new_tokens", "Integer"),
        (["train.resume=maybe"], "train.resume", "bool"),
        (["model.dtype=float16"], "model.dtype", "expected one of"),
        (["model.attention_impl=flash"], "model.attention_impl", "expected one of"),
        (["data.source=csv"], "data.source", "expected one of"),
        (["optimizer.decay=step"], "optimizer.decay", "expected one of"),
        (["train.steps"], "train.steps", "section.key=value"),
        (["model.path=..."], "model.path", "is not a YAML value"),  # the docs' own placeholder
        (["data.template=[a"], "data.template", "quote it as a string: data.template='\"[a\"'"),
        (["model.path=a: b: c"], "model.path", "mapping values are not allowed here"),
    ],
)
def test_typed_merge_errors(overrides, key, fragment):
    _assert_one_line(_error(overrides), key, fragment)


def test_the_algorithm_choices_are_the_tables():
    """algorithm.name takes the names of drgrpo_jax.algorithms.ALGORITHMS, and an unknown one is refused
    before anything compiles, on one line naming the key and every name of the table (--help lists them too)."""
    for name in ALGORITHMS:
        assert load_config(None, [*BASE, f"algorithm.name={name}"]).algorithm.name == name
    _assert_one_line(_error(["algorithm.name=ppo"]), "algorithm.name", "'ppo'", *ALGORITHMS)
    assert ", ".join(ALGORITHMS) in describe_config()


def test_the_tracker_choices_are_the_trackers_implemented():
    assert set(trackers._PACKAGES) == set(TRACKERS)


def test_the_dtype_choices_are_the_precision_table():
    """model.dtype, model.compute_dtype and model.lora.base_dtype take the names of models.precision.DTYPES."""
    model, lora = typing.get_type_hints(ModelConfig), typing.get_type_hints(LoraConfig)
    assert typing.get_args(model["dtype"]) == tuple(DTYPES)
    assert typing.get_args(model["compute_dtype"]) == ("auto", *DTYPES)
    assert typing.get_args(lora["base_dtype"]) == ("model", *DTYPES, "int8")


def test_unknown_key_in_yaml_names_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {path: m}\noptimizer: {learning_rat: 1.0e-6}\n")
    error = _error([], path)
    _assert_one_line(error, "optimizer.learning_rat", "bad.yaml", "did you mean optimizer.learning_rate?")


def test_sections_must_be_mappings(tmp_path):
    path = tmp_path / "sections.yaml"
    path.write_text("model: {path: m}\ntrain: 3\n")
    _assert_one_line(_error([], path), "train", "must be a mapping of fields, got 3")
    _assert_one_line(_error(["rollout=[1]"]), "rollout", "must be a mapping of fields")
    path.write_text("model: {path: m}\ntrain:\n")  # an empty section keeps the defaults
    assert load_config(path, []).train == load_config(None, BASE).train


def test_missing_or_broken_config_file(tmp_path):
    _assert_one_line(_error([], tmp_path / "nope.yaml"), "--config", "no such file")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    _assert_one_line(_error([], broken), "--config", "cannot parse")


@pytest.mark.parametrize(
    "overrides, key, fragment",
    [
        # The algorithm's rules, delegated to drgrpo_jax.algorithms.
        (["algorithm.scale_rewards=true"], "algorithm.scale_rewards", "dr_grpo forbids"),
        (["algorithm.whiten_advantages=true"], "algorithm.whiten_advantages", "dr_grpo forbids"),
        (["algorithm.kl_in_reward=true"], "algorithm.kl_in_reward", "forbids"),
        (["algorithm.name=grpo", "algorithm.scale_rewards=true"], "algorithm.scale_rewards", "grpo"),
        (["rollout.max_new_tokens=0"], "rollout.max_new_tokens", "positive int"),
        (["rollout.max_new_tokens=-4"], "rollout.max_new_tokens", "positive int"),
        (["rollout.group_size=1"], "rollout.group_size", "at least 2"),
        (["algorithm.name=rloo", "rollout.group_size=1"], "rollout.group_size", "rloo"),
        # Batch sizes against minibatches, micro-batches and the mesh.
        (["rollout.prompts_per_step=3", "rollout.group_size=3", "algorithm.minibatches_per_rollout=2"],
         "algorithm.minibatches_per_rollout", "9 responses"),
        (["train.micro_batches=3"], "train.micro_batches", "64 responses per optimizer step"),
        (["mesh.data=3"], "mesh.data", "mesh.data * mesh.fsdp = 3"),
        (["mesh.data=2", "mesh.fsdp=4", "train.micro_batches=16"], "mesh.data", "= 8"),
        # Ranges.
        (["train.steps=0"], "train.steps", ">= 1"),
        (["train.micro_batches=0"], "train.micro_batches", ">= 1"),
        (["train.keep_checkpoints=0"], "train.keep_checkpoints", ">= 1"),
        (["train.save_every=0"], "train.save_every", ">= 1"),
        (["mesh.tensor=0"], "mesh.tensor", ">= 1"),
        (["rollout.temperature=0"], "rollout.temperature", "> 0"),
        (["rollout.top_p=0"], "rollout.top_p", "(0, 1]"),
        (["rollout.top_p=1.5"], "rollout.top_p", "(0, 1]"),
        (["rollout.top_k=-1"], "rollout.top_k", ">= 0"),
        (["rollout.max_staleness=-1"], "rollout.max_staleness", ">= 0"),
        (["rollout.timeout_s=0"], "rollout.timeout_s", "> 0"),
        (["reward.timeout_s=-1"], "reward.timeout_s", "> 0"),
        (["reward.num_workers=0"], "reward.num_workers", ">= 1"),
        (["optimizer.learning_rate=-1e-6"], "optimizer.learning_rate", "> 0 and <= 1.0"),
        (["optimizer.b2=1.0"], "optimizer.b2", "[0, 1)"),
        (["optimizer.eps=0"], "optimizer.eps", "> 0"),
        (["optimizer.max_grad_norm=-1"], "optimizer.max_grad_norm", ">= 0"),
        (["algorithm.clip_low=-0.1"], "algorithm.clip_low", ">= 0"),
        (["algorithm.clip_high=-0.1"], "algorithm.clip_high", ">= 0"),
        (["algorithm.kl_coef=-1"], "algorithm.kl_coef", ">= 0"),
        (["algorithm.dual_clip=0.5"], "algorithm.dual_clip", "> 1"),
        (["algorithm.tis_cap=0"], "algorithm.tis_cap", ">= 1"),
        (["algorithm.tis_cap=0.5"], "algorithm.tis_cap", ">= 1"),
        (["algorithm.entropy_coef=-0.01"], "algorithm.entropy_coef", ">= 0"),
        (["algorithm.clip_low=inf"], "algorithm.clip_low", "finite"),
        (["algorithm.ppo_epochs=0"], "algorithm.ppo_epochs", ">= 1"),
        (["algorithm.entropy_coef=nan"], "algorithm.entropy_coef", "finite"),
        (["data.eval_size=-1"], "data.eval_size", ">= 0"),
        # Model, data, rewards, multi-host.
        (["model.path=''"], "model.path", "must be set"),
        (["data.source=jsonl"], "data.path", "data.source=jsonl"),
        (["data.template=no placeholder"], "data.template", "{question}"),
        (["reward.functions=[]"], "reward.functions", "at least one"),
        (["reward.functions=[math_verfy]"], "reward.functions[0]", "did you mean math_verify?"),
        (["reward.functions=[math_verify,not a path]"], "reward.functions[1]", "package.module:function"),
        (["reward.functions=[math_verify,math_verify]"], "reward.functions", "twice"),
        (["reward.functions=[math_verify,format]", "reward.weights=[1.0]"], "reward.weights", "1 entries for 2"),
        (["reward.components=[correct,correct]"], "reward.components", "twice"),
        (["reward.components=[correct,length,format]", "reward.weights=[1.0,2.0]"], "reward.weights",
         "2 entries for 3 reward.components"),
        (["data.source=jsonl", "data.path=x.jsonl", "reward.functions=[task]"], "reward.functions[0]", "reasoning_gym"),
        (["mesh.num_processes=2"], "mesh.coordinator_address", "must be set"),
        (["mesh.process_id=1"], "mesh.process_id", "< mesh.num_processes"),
        (["model.dtype=bfloat16", "model.compute_dtype=float32"], "model.compute_dtype", "model.dtype=float32"),
        (["model.compute_dtype=float16"], "model.compute_dtype", "expected one of"),
        (["rollout.ignore_eos=maybe"], "rollout.ignore_eos", ""),
    ],
)
def test_validation_rules(overrides, key, fragment):
    _assert_one_line(_error(overrides), key, fragment)


@pytest.mark.parametrize("cap", [0.0, 0.5, 0.999, float("inf")])
def test_a_tis_cap_below_1_is_refused_where_the_step_would_refuse_it(cap):
    """The rule lives in StepConfig alone: load_config (so `python -m drgrpo_jax.config` and plan) refuses
    exactly what the step refuses, in one line naming algorithm.tis_cap."""
    _assert_one_line(_error([f"algorithm.tis_cap={cap}"]), "algorithm.tis_cap", ">= 1", str(cap))
    with pytest.raises(ValueError):
        StepConfig(loss=LossConfig(budget=4), tis_cap=cap)


@pytest.mark.parametrize("cap", [1, 1.0, 2.0, 10.5])
def test_a_tis_cap_of_at_least_1_passes_validate_and_builds_the_step(cap):
    config = load_config(None, BASE + [f"algorithm.tis_cap={cap}", "algorithm.minibatches_per_rollout=2"])
    validate(config)
    train, logprob = step_configs(config)
    assert isinstance(train, StepConfig) and train.tis_cap == cap and logprob.tis_cap == cap
    assert (train.micro_batches, logprob.micro_batches) == (1, 2)  # the old log-probs slice the whole rollout
    assert train.loss.budget == config.rollout.max_new_tokens and train.loss.aggregation == "fixed_budget"


@pytest.mark.parametrize("overrides, on_policy", [
    ([], True),  # one epoch, one minibatch: the step's own log-probs are the old ones
    (["algorithm.ppo_epochs=2"], False),
    (["algorithm.minibatches_per_rollout=2"], False),
])
def test_the_step_skips_the_old_logprob_pass_only_with_one_window_per_rollout(overrides, on_policy):
    train, logprob = step_configs(load_config(None, BASE + overrides))
    assert train.on_policy is on_policy and logprob.on_policy is False


def test_an_unset_required_value_is_a_missing_value_error():
    assert isinstance(_error(["model.path=''"]), MissingValueError)
    assert not isinstance(_error(["train.steps=0"]), MissingValueError)


def test_valid_batch_layouts_pass():
    config = load_config(
        None,
        BASE
        + [
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "algorithm.minibatches_per_rollout=2",
            "train.micro_batches=2",
            "mesh.data=2",
            "mesh.fsdp=2",
        ],
    )
    assert config.train.micro_batches == 2


def test_check_paths(tmp_path, tiny_model):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    check_paths(load_config(None, [f"model.path={tiny_model}"]))
    with pytest.raises(ConfigError) as info:
        check_paths(load_config(None, [f"model.path={model_dir}"]))
    _assert_one_line(info.value, "model.path", "no *.safetensors files")
    # A cached Hub repo with an empty weights file: main raised struct's "unpack requires a buffer of 8 bytes"
    (model_dir / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        check_paths(load_config(None, [f"model.path={model_dir}"]))
    _assert_one_line(info.value, "model.path", "model.safetensors is not a safetensors file")
    with pytest.raises(ConfigError) as info:
        check_paths(load_config(None, [f"model.path={tmp_path / 'missing'}"]))
    _assert_one_line(info.value, "model.path", "no such folder")
    with pytest.raises(ConfigError) as info:
        check_paths(
            load_config(None, [f"model.path={tiny_model}", "data.source=jsonl", f"data.path={tmp_path / 'x.jsonl'}"])
        )
    _assert_one_line(info.value, "data.path", "no such file")


def test_command_line_help_and_one_line_errors(capsys):
    config = config_from_argv(["model.path=m", "train.steps=3"], prog="train")
    assert config.train.steps == 3
    with pytest.raises(SystemExit) as info:
        config_from_argv(["model.path=m", "train.stpes=3"], prog="train")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == "train: config error: train.stpes: unknown key (command line); did you mean train.steps?\n"
    with pytest.raises(SystemExit) as info:
        config_from_argv(["--help"], prog="train")
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert all(f"\n{name}: " in out for name in ("run", "model", "data", "rollout", "algorithm", "reward", "mesh"))


@pytest.mark.parametrize("name, policy_loss, aggregation", [
    ("gspo", "gspo", "seq_mean_token_mean"), ("gspo_token", "gspo_token", "seq_mean_token_mean"),
    ("cispo", "cispo", "token_mean")])
def test_the_new_algorithms_build_their_loss(name, policy_loss, aggregation):
    config = load_config(None, BASE + [f"algorithm.name={name}", "algorithm.clip_low=3e-4", "algorithm.clip_high=4e-4"])
    train, _ = step_configs(config)
    assert (train.loss.policy_loss, train.loss.aggregation) == (policy_loss, aggregation)
    assert (train.loss.clip_low, train.loss.upper_clip) == (3e-4, 4e-4)


def test_sequence_importance_sampling_keys_reach_the_step():
    config = load_config(None, BASE + ["algorithm.tis_level=sequence", "algorithm.mis_high=2", "algorithm.mis_low=0.5"])
    train, logprob = step_configs(config)
    assert (train.tis_level, train.mis_high, train.mis_low, train.tis_cap) == ("sequence", 2.0, 0.5, None)
    assert logprob.mis_high == 2.0


@pytest.mark.parametrize("overrides, key, fragment", [
    (["algorithm.name=cispo", "algorithm.dual_clip=3"], "algorithm.dual_clip", "cispo"),
    (["algorithm.name=gspo", "algorithm.scale_rewards=true"], "algorithm.scale_rewards", "gspo forbids it"),
    (["algorithm.name=gspo_token", "algorithm.kl_in_reward=true"], "algorithm.kl_in_reward", "forbids"),
    (["algorithm.tis_level=row"], "algorithm.tis_level", "row"),
    (["algorithm.mis_high=0.5"], "algorithm.mis_high", ">= 1"),
    (["algorithm.mis_low=0.5"], "algorithm.mis_low", "needs mis_high"),
    (["algorithm.mis_high=2", "algorithm.mis_low=2"], "algorithm.mis_low", "[0, 1]"),
    (["algorithm.mis_high=2", "algorithm.tis_cap=2"], "algorithm.mis_high", "tis_cap"),
])
def test_what_the_new_options_forbid_names_the_key(overrides, key, fragment):
    _assert_one_line(_error(overrides), key, fragment)


@pytest.mark.parametrize("buffer", [0, 300])
def test_the_overlong_reward_needs_a_buffer_within_the_budget(buffer):
    overrides = ["reward.functions=[math_verify,overlong]", f"reward.overlong_buffer={buffer}"]
    _assert_one_line(_error(overrides), "reward.overlong_buffer", "[1, rollout.max_new_tokens = 256]")
    config = load_config(None, BASE + ["reward.functions=[math_verify,overlong]", "reward.overlong_buffer=64",
                                       "algorithm.name=gdpo"])
    assert config.reward.functions == ("math_verify", "overlong")


@pytest.mark.parametrize("overrides, concrete, step_dtype", [
    ([], "float32", "float32"),  # auto: validation knows no device and builds a float32 step
    ([], "bfloat16", "bfloat16"),  # run.setup passes the device's resolution
    (["model.compute_dtype=bfloat16"], None, "bfloat16"),
    (["model.compute_dtype=float32"], None, "float32"),
])
def test_compute_dtype_reaches_the_step_and_the_old_logprob_pass(overrides, concrete, step_dtype):
    config = load_config(None, BASE + overrides)
    assert load_config(None, BASE).model.compute_dtype == "auto"
    train, logprob = step_configs(config, concrete)
    assert (train.compute_dtype, logprob.compute_dtype) == (step_dtype, step_dtype)


def test_an_unknown_compute_dtype_names_the_key_when_the_step_refuses_it():
    with pytest.raises(ConfigError, match="^model.compute_dtype: unknown 'float16'"):
        step_configs(load_config(None, BASE), "float16")


def test_auto_compute_dtype_is_bfloat16_where_the_hardware_multiplies_it_fast():
    from types import SimpleNamespace

    from drgrpo_jax.models.precision import native_bfloat16, resolve_compute_dtype

    tpu, a100, v100 = (SimpleNamespace(platform="tpu"), SimpleNamespace(platform="gpu", compute_capability="8.0"),
                       SimpleNamespace(platform="gpu", compute_capability="7.0"))
    cpu = SimpleNamespace(platform="cpu")
    amx, zen4, avx2 = (frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}),
                       frozenset({"avx512f", "avx512_bf16"}), frozenset({"avx2"}))
    assert [resolve_compute_dtype("auto", "float32", d) for d in (tpu, a100, v100)] == \
        ["bfloat16", "bfloat16", "float32"]
    assert [resolve_compute_dtype("auto", "float32", cpu, flags) for flags in (amx, zen4, avx2)] == \
        ["bfloat16", "bfloat16", "float32"]
    assert resolve_compute_dtype("bfloat16", "float32", cpu, avx2) == "bfloat16"  # asked for: given on any device
    assert resolve_compute_dtype("float32", "float32", tpu) == "float32"  # float32 is one override away
    assert resolve_compute_dtype("auto", "bfloat16", v100) == "bfloat16"  # bfloat16 params: nothing to cast
    assert native_bfloat16(cpu, zen4) and native_bfloat16(cpu, amx)
    assert not native_bfloat16(cpu, avx2)


def test_attention_impl_lists_the_model_choices_and_kernels_need_their_backend():
    import typing

    from drgrpo_jax.config.schema import ModelConfig
    from drgrpo_jax.models.config import ATTENTION_IMPLS
    from drgrpo_jax.train.setup import check_attention_backend

    assert typing.get_args(typing.get_type_hints(ModelConfig)["attention_impl"]) == ATTENTION_IMPLS
    for impl, backend in [("auto", "cpu"), ("reference", "tpu"), ("blockwise", "cpu"), ("cudnn", "gpu"),
                          ("splash", "tpu")]:
        check_attention_backend(impl, backend)
    with pytest.raises(ConfigError, match="^model.attention_impl: cudnn runs on gpu devices only; this run's are cpu$"):
        check_attention_backend("cudnn", "cpu")
    with pytest.raises(ConfigError, match="^model.attention_impl: splash runs on tpu"):
        check_attention_backend("splash", "gpu")


def test_long_quickstart_sets_the_long_context_options():
    import os

    import jax.numpy as jnp

    from drgrpo_jax.models.attention import choose_impl
    from drgrpo_jax.plan.activations import model_call
    from drgrpo_jax.plan.remat import resolve_remat

    path = os.path.join(REPO, "configs", "quickstarts", "long_quickstart.yaml")
    config = load_config(path)
    assert config.rollout.max_new_tokens == 1024 and config.data.task == "gsm_symbolic"
    # auto, so each backend takes its own kernel; on a CPU its 1279-token rows get the memory-linear ones.
    assert config.model.remat == config.model.attention_impl == "auto"
    seq_len = model_call(config)[1]
    assert choose_impl("auto", seq_len=seq_len, dtype=jnp.float32, head_dim=64, backend="cpu") == "blockwise"
    assert resolve_remat(config, {"full": 0, "none": 1 << 40}, budget=1 << 34, backend="cpu") == "full"


@pytest.mark.parametrize("overrides, key, fragment", [
    (["train.pack_rows=-1"], "train.pack_rows", "must be >= 0"),
    (["train.pack_length=300"], "train.pack_length", "needs train.pack_rows > 0"),
    (["train.pack_rows=65"], "train.pack_rows", "65 rows for the 64 response(s) a device holds"),
    (["train.pack_rows=8", "train.pack_length=500"], "train.pack_length", "rollout.max_new_tokens - 1 = 511"),
    (["model.remat=sometimes"], "model.remat", "'sometimes' is not a policy"),
])
def test_packing_and_remat_errors_name_the_key(overrides, key, fragment):
    _assert_one_line(_error(overrides), key, fragment)


@pytest.mark.parametrize("flag, now", [("true", "full"), ("false", "none"), ("True", "full")])
def test_the_former_boolean_remat_is_refused_naming_the_policies(flag, now):
    """model.remat takes a policy name only: the old true/false fail validation, naming every policy and the
    one the boolean meant."""
    _assert_one_line(_error([f"model.remat={flag}"]), "model.remat", "is not a policy", "auto", *REMAT_POLICIES,
                     f"is now {now}")


def test_every_shipped_config_validates():
    """configs/**/*.yaml load as written (each run supplies its model and data paths)."""
    paths = sorted(glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True))
    assert paths
    for path in paths:
        load_config(path, ["model.path=some/model", "data.path=some/data.jsonl"])


def test_packing_and_remat_reach_the_step_and_the_model():
    train, logprob = step_configs(load_config(None, [*BASE, "train.pack_rows=8"]))
    assert (train.pack_rows, train.pack_length) == (logprob.pack_rows, logprob.pack_length) == (8, 256 + 256 - 1)
    assert step_configs(load_config(None, BASE))[0].pack_rows == 0  # packing is opt-in
    assert load_config(None, BASE).model.remat == "auto"
    for policy in REMAT_POLICIES:
        assert load_config(None, [*BASE, f"model.remat={policy}"]).model.remat == policy


@pytest.mark.parametrize("override, fragment", [
    ("optimizer.learning_rate=inf", "finite and > 0 and <= 1.0, got inf"),
    ("optimizer.learning_rate=0", "> 0 and <= 1.0, got 0.0"),
    ("optimizer.learning_rate=1e30", "<= 1.0, got 1e+30"),
    ("optimizer.learning_rate=nan", "finite"),
    ("optimizer.max_grad_norm=inf", "finite and >= 0"),
    ("optimizer.weight_decay=inf", "finite and >= 0"),
    ("optimizer.eps=inf", "finite and > 0"),
    ("train.eval_temperature=-1", ">= 0"),
    ("run.seed=-1", "[0, 4294967295]"),
    ("run.seed=4294967296", "[0, 4294967295]"),
    ("reward.weights=[0]", "all 0"),
    ("environment.python_timeout_s=0", "> 0"),
    ("environment.python_timeout_s=inf", "<= 9223372036 seconds"),
    ("environment.tool_timeout_s=nan", "> 0"),
    ("rollout.timeout_s=1e30", "<= 9223372036 seconds"),
    ("environment.python_memory_mb=-1", ">= 1"),
    ("environment.max_tool_calls=-1", ">= 0"),
    ("environment.max_turns=0", ">= 1"),
    ("reward.overlong_buffer=-1", ">= 0"),
    ("train.steps=2147483648", "<= 2147483647 (counts reach int32 arrays)"),
    ("rollout.group_size=1000000000", "= 4096000000000 tokens a rollout; its int32 arrays hold at most 2147483647"),
])
def test_numbers_that_fail_later_are_refused_naming_the_key(override, fragment):
    """Each was accepted and failed mid-run (lr=inf: a weight push refused after a step) or never: the environment's
    limits are checked whether or not episodes are on, one rule per family of fields."""
    _assert_one_line(_error([override]), override.split("=")[0], fragment)


def test_max_grad_norm_0_means_no_clipping_as_its_help_says():
    config = load_config(None, BASE + ["optimizer.max_grad_norm=0"])
    field = next(f for f in dataclasses.fields(config.optimizer) if f.name == "max_grad_norm")
    assert "0 = no clipping" in field.metadata["help"]
    assert optimizer_of(config)[0].hyper.max_grad_norm is None


@pytest.mark.parametrize("output_dir", ["/proc/self/x", "/dev/full/run", "{file}/run"])
def test_an_output_dir_the_run_cannot_create_exits_2_before_training(tmp_path, capsys, monkeypatch, output_dir):
    """`python -m drgrpo_jax.config` and `python -m drgrpo_jax.train` both refuse it in one line, exit status 2."""
    (tmp_path / "file").write_text("")
    output_dir = output_dir.format(file=tmp_path / "file")
    argv = ["model.path=some/model", f"run.output_dir={output_dir}"]
    monkeypatch.setattr(sys, "argv", ["drgrpo_jax.config", *argv])
    with pytest.raises(SystemExit) as info:
        runpy.run_module("drgrpo_jax.config", run_name="__main__")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m drgrpo_jax.config: config error: run.output_dir: ") and err.count("\n") == 1
    monkeypatch.setattr(train_cli, "train", lambda *args: pytest.fail("training started"))
    assert train_cli.main(argv) == 2
    assert capsys.readouterr().err.startswith("python -m drgrpo_jax.train: config error: run.output_dir: ")


def test_a_writable_output_dir_is_checked_without_being_created(tmp_path):
    check_output_dir(load_config(None, BASE + [f"run.output_dir={tmp_path / 'a' / 'b'}"]).run)
    assert os.listdir(tmp_path) == []
