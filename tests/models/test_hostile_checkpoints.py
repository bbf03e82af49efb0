"""Checkpoints whose config.json lies: every field checked, and the config compared with the weights' headers
before anything is allocated, so each fails in one line within seconds (issue 64, finding 8: 10^9 layers hung
both mixtures for minutes, decoder_sparse_step 0 divided by zero, a missing intermediate_size was a bare KeyError,
int8 experts loaded as if they were weights)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from drgrpo_jax.models.hf_io import read_safetensors, write_safetensors
from drgrpo_jax.models.pretrained import from_pretrained

from support.tiny_models import write_tiny_gpt_oss, write_tiny_llama, write_tiny_mixtral, write_tiny_qwen3_moe

_WRITERS: dict[str, Callable[[str], str]] = {"mixtral": write_tiny_mixtral, "qwen3_moe": write_tiny_qwen3_moe,
                                             "gpt_oss": write_tiny_gpt_oss, "llama": write_tiny_llama}
MIXTURES = ("mixtral", "qwen3_moe", "gpt_oss")
SECONDS = 2.0  # reading headers and config.json takes milliseconds; 10^9 layers once took minutes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    """Each family's tiny checkpoint, read-only: tests edit copies."""
    root = tmp_path_factory.mktemp("tiny")
    return {family: write(str(root / family)) for family, write in _WRITERS.items()}


def _copy(tiny: dict[str, str], family: str, tmp_path) -> str:
    return shutil.copytree(tiny[family], str(tmp_path / family))


def _edit_config(folder: str, **changes) -> None:
    """config.json with `changes` (a value of `...` deletes the key)."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    for key, value in changes.items():
        config.pop(key) if value is ... else config.__setitem__(key, value)
    with open(path, "w") as f:
        json.dump(config, f)


def _retype_weights(folder: str, dtype, where: str) -> None:
    """Every tensor whose name holds `where` stored as `dtype` (a quantized checkpoint's integer codes)."""
    path = os.path.join(folder, "model.safetensors")
    tensors = read_safetensors(path)
    write_safetensors(path, {name: w.astype(dtype) if where in name else w for name, w in tensors.items()})


@contextlib.contextmanager
def _within(seconds: float) -> Iterator[None]:
    """TimeoutError when the block runs longer than `seconds` (a Python loop over 10^9 layers is interrupted)."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _refused(folder: str, pattern: str) -> str:
    """The one-line ValueError from_pretrained gives `folder`, within SECONDS, matching `pattern`."""
    with _within(SECONDS), pytest.raises(ValueError) as caught:
        from_pretrained(folder)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 400, message
    assert re.search(pattern, message), message
    return message


@pytest.mark.parametrize("family", [*MIXTURES, "llama"])
def test_a_billion_layers_fail_against_the_weights_at_once(family, tiny, tmp_path):
    folder = _copy(tiny, family, tmp_path)
    _edit_config(folder, num_hidden_layers=1_000_000_000)
    held = 3 if family == "gpt_oss" else 2
    _refused(folder, rf"^num_hidden_layers: config.json says 1000000000, the weights hold {held} layers")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("step", [0, -1, "2", 1.5])
def test_decoder_sparse_step_must_be_a_positive_int(family, step, tiny, tmp_path):
    folder = _copy(tiny, family, tmp_path)
    _edit_config(folder, decoder_sparse_step=step)
    _refused(folder, r"^config.json.decoder_sparse_step: must be a positive int, got ")


@pytest.mark.parametrize("family", [*MIXTURES, "llama"])
@pytest.mark.parametrize("field", ["intermediate_size", "hidden_size", "num_attention_heads", "vocab_size"])
def test_a_missing_required_field_is_named(family, field, tiny, tmp_path):
    folder = _copy(tiny, family, tmp_path)
    _edit_config(folder, **{field: ...})
    _refused(folder, rf"^config.json.{field}: is required and missing$")


@pytest.mark.parametrize("family, where", [("mixtral", "experts"), ("qwen3_moe", "experts"),
                                           ("gpt_oss", "experts.down_proj"), ("llama", "mlp.up_proj")])
@pytest.mark.parametrize("dtype, name", [(np.int8, "I8"), (np.int32, "I32")])
def test_integer_weights_are_refused_naming_the_tensor(family, where, dtype, name, tiny, tmp_path):
    folder = _copy(tiny, family, tmp_path)
    _retype_weights(folder, dtype, where)
    _refused(folder, rf"^weights: model\.layers\.0\.\S*{re.escape(where.split('.')[0])}\S* is {name}, not one of")


@pytest.mark.parametrize("family, field, value, pattern", [
    ("qwen3_moe", "num_experts", 1_000_000_000, r"^num_experts/num_local_experts: config.json says 1000000000, "
                                                r"the weights hold 8 experts"),
    ("mixtral", "num_local_experts", 6, r"^num_experts/num_local_experts: config.json says 6, the weights hold 4"),
    ("gpt_oss", "num_local_experts", 8, r"^weights: model.layers.0.mlp.router.weight has shape \[4, 32\], "
                                        r"config.json implies \[8, 32\]$"),
    ("mixtral", "intermediate_size", 24, r"^weights: model.layers.0.mlp.experts.0.w1.weight has shape \[16, 32\], "
                                         r"config.json implies \[24, 32\]$"),
    ("qwen3_moe", "moe_intermediate_size", 1_000_000_000, r"^weights: model.layers.0.mlp.experts.0.\w+.weight has "
                                                          r"shape \[\d+, \d+\], config.json implies"),
    ("llama", "hidden_size", 1_000_000_000, r"^weights: model.embed_tokens.weight has shape \[51, 32\], "
                                            r"config.json implies \[51, 1000000000\]$"),
    ("llama", "vocab_size", 1_000_000_000, r"^weights: model.embed_tokens.weight has shape \[51, 32\]"),
    ("llama", "num_key_value_heads", 4, r"^weights: model.layers.0.self_attn.k_proj.weight has shape \[16, 32\], "
                                        r"config.json implies \[32, 32\]$"),
])
def test_the_config_is_compared_with_every_tensors_shape_first(family, field, value, pattern, tiny, tmp_path):
    folder = _copy(tiny, family, tmp_path)
    _edit_config(folder, **{field: value})
    _refused(folder, pattern)


@pytest.mark.parametrize("family, field, value, pattern", [
    ("llama", "rms_norm_eps", "1e-6", r"rms_norm_eps: must be a finite number > 0, got '1e-6'"),
    ("llama", "rms_norm_eps", 0, r"rms_norm_eps: must be a finite number > 0, got 0"),
    ("mixtral", "rope_theta", -1.0, r"rope_theta: must be a finite number > 0, got -1.0"),
    ("qwen3_moe", "rope_parameters", {"rope_type": "default", "rope_theta": float("inf")},
     r"rope_parameters.rope_theta: must be a finite number > 0, got inf"),
    ("llama", "num_attention_heads", 4.0, r"num_attention_heads: must be a positive int, got 4.0"),
    ("llama", "num_hidden_layers", True, r"num_hidden_layers: must be a positive int, got True"),
    ("mixtral", "num_experts_per_tok", 0, r"num_experts_per_tok: must be a positive int, got 0"),
    ("qwen3_moe", "mlp_only_layers", "all", r"mlp_only_layers: must be a list, got 'all'"),
    ("gpt_oss", "swiglu_limit", float("nan"), r"swiglu_limit: must be a finite number > 0, got nan"),
    ("gpt_oss", "layer_types", ["full_attention"], r"layer_types: must list one of .* for each of the "
                                                   r"num_hidden_layers=3 layers"),
    ("llama", "hidden_act", "relu6", r"hidden_act: 'relu6' is not supported \(supported: \['silu'"),
    ("llama", "rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                               "high_freq_factor": 1.0, "original_max_position_embeddings": 64},
     r"rope_scaling.high_freq_factor: must exceed low_freq_factor=4.0, got 1.0"),
    ("llama", "eos_token_id", [2, "</s>"], r"eos_token_id: must be an int >= 0 or a list of them"),
    ("llama", "tie_word_embeddings", "no", r"tie_word_embeddings: must be true or false, got 'no'"),
    ("llama", "quantization_config", {"quant_method": "gptq"}, r"quantization_config: gptq checkpoints are not "
                                                               r"supported"),
    ("llama", "max_position_embeddings", "x" * 10_000, r"max_position_embeddings: must be a positive int, "
                                                       r"got 'xxx+\.\.\.$"),
])
def test_every_field_is_checked_and_named(family, field, value, pattern, tiny, tmp_path):
    folder = _copy(tiny, family, tmp_path)
    _edit_config(folder, rope_parameters=None, **{field: value}) if field == "rope_scaling" else _edit_config(
        folder, **{field: value})
    _refused(folder, pattern)


@pytest.mark.parametrize("family", [*MIXTURES, "llama"])
def test_the_untouched_checkpoints_still_load(family, tiny):
    with _within(60.0):  # a guard, not the point: these build the model
        model = from_pretrained(tiny[family])
    assert model.config.family == family
