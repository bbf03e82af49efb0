"""The plan's generation-service figures (drgrpo_jax/plan/service.py) against the compiled sampler's own memory
analysis on 8 CPU devices, for one device and for (data, tensor) service meshes (issue #43)."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax.numpy as jnp
import pytest
from flax import nnx

from drgrpo_jax.config.load import load_config
from drgrpo_jax.models.config import DecoderConfig, from_hf_config
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.plan import cli
from drgrpo_jax.plan import planner as plan
from drgrpo_jax.plan.hardware import PRESETS, device_spec
from drgrpo_jax.plan.service import service_memory, service_total
from drgrpo_jax.sampler import programs
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams, make_batch, mesh_rows
from drgrpo_jax.sampler.generate import span_schedule
from drgrpo_jax.sampler.memory import batch_memory
from drgrpo_jax.sharding import parse_service_mesh, service_mesh, shard_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Big enough that weights, cache and temporaries outweigh XLA's small buffers; 2 layers keep the compiles short.
SMALL = DecoderConfig(family="llama", vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=2,
                      num_heads=8, num_kv_heads=8, head_dim=32, max_position_embeddings=512)
PROMPT, NEW, ROWS = 16, 128, 8  # bucketed, as the service buckets them


def _compiled(spec: str) -> dict[str, int]:
    """Per-device bytes of the sampler's two programs over the mesh: (arguments, outputs, temporaries) of the
    prefill, and of the decode loop at the last span (its cache donated: outputs alias arguments)."""
    mesh = service_mesh(parse_service_mesh(spec))
    model = Transformer(SMALL, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model if mesh is None else shard_model(model, mesh))
    data = 1 if mesh is None else mesh.shape["data"]
    # Every row its own prompt: the prefill's worst case, which the plan assumes.
    rows = [RowRequest(tuple(range(3 + i, 3 + i + PROMPT - i)), SamplingParams(max_new_tokens=NEW), seed=1)
            for i in range(ROWS)]
    batch = programs.place_batch(make_batch(rows, (2,), batch_size=mesh_rows(ROWS, data), prompt_len=PROMPT,
                                            num_prompts=mesh_rows(ROWS, data)), mesh)
    slots = span_schedule(PROMPT, NEW)
    assert slots[-1] == PROMPT + NEW - 1  # the last decode phase: its cache is the plan's
    kwargs = dict(max_new_tokens=NEW, num_slots=slots[-1], cache_dtype=jnp.float32, mesh=mesh)
    prefill = programs.prefill.lower(graphdef, state, batch, **kwargs).compile().memory_analysis()
    decoding = programs.prefill(graphdef, state, batch, **kwargs)
    until_step = jnp.int32(NEW)
    decode = programs.decode_phase.lower(graphdef, state, decoding, until_step, mesh=mesh).compile().memory_analysis()
    return {"prefill_peak": prefill.argument_size_in_bytes + prefill.output_size_in_bytes
            + prefill.temp_size_in_bytes,
            "prefill_arguments": prefill.argument_size_in_bytes,
            "decode_arguments": decode.argument_size_in_bytes, "decode_temp": decode.temp_size_in_bytes,
            "decode_peak": decode.argument_size_in_bytes + decode.output_size_in_bytes - decode.alias_size_in_bytes
            + decode.temp_size_in_bytes}


@pytest.mark.heavy  # two sampler programs compiled per mesh
@pytest.mark.parametrize("spec", ["", "tensor=2", "tensor=4", "tensor=2,data=2"])
def test_service_figures_match_the_compiled_programs_within_10_percent(spec):
    config = load_config(None, ["model.path=x", f"rollout.max_prompt_tokens={PROMPT}",
                                f"rollout.max_new_tokens={NEW}"])
    mesh = parse_service_mesh(spec)
    planned = service_memory(config, SMALL, ROWS, tensor=mesh.tensor, data=mesh.data)
    measured = _compiled(spec)
    batch_inputs = measured["prefill_arguments"] - planned["weights"]
    assert 0 <= batch_inputs < 0.01 * planned["weights"]  # the prefill reads the weights and the prompts' ids
    carry = measured["decode_arguments"] - planned["weights"]  # the cache and the rows' outputs and settings
    assert planned["kv_cache"] == pytest.approx(carry, rel=0.1)
    # The decode loop's temporaries: the per-layer slices of the stacked weights, RoPE tables and sampling.
    assert planned["layer_split"] + planned["decode_temporaries"] == pytest.approx(measured["decode_temp"], rel=0.1)
    assert service_total(planned) == pytest.approx(max(measured["prefill_peak"], measured["decode_peak"]), rel=0.1)


RECIPE = os.path.join(REPO, "configs", "recipes", "qwen2.5_math_7b_dr_grpo_lora_v5e8.yaml")


def test_the_7b_lora_v5e8_recipe_fits_with_the_sharded_service(capsys):
    """Its header's command and figures are the plan's; one chip cannot hold it, its rollout.service_mesh can, and
    the header says which backends were verified."""
    header = open(RECIPE).read()
    assert cli.main(["--config", RECIPE, "--model-config", "Qwen2.5-Math-7B", "--device", "v5e", "--format",
                      "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    service = result["service"]
    assert result["fits"] == {"trainer": True, "service": True}
    assert (service["mesh"], service["tensor_ways"], service["devices"], service["smallest_tensor"]) == (
        "tensor=4", 4, 4, 4)
    stated = re.search(r"service ([\d.]+) GiB per chip of 4", header)
    assert stated and float(stated.group(1)) == round(service["total"] / 2**30, 2)
    assert "tpu-vm --tpu my-v5e-8" in header and "--serve-chips 4" in header  # its mesh: rollout.service_mesh
    assert "SGLang, SGLang-JAX and vLLM were not run" in header
    assert "Backends verified: drgrpo_jax.serve (ours) only, over HTTP in tests" in header
    config, _ = cli._load(RECIPE, [])
    one_chip = plan.make_plan(config, plan.resolve_decoder_config(config, "Qwen2.5-Math-7B")[0],
                              device=device_spec("v5e"), serve_mesh="")
    assert not one_chip["fits"]["service"] and one_chip["service"]["smallest_tensor"] == 4
    assert any("--mesh tensor=4" in line for line in one_chip["advice"])


def test_the_plan_splits_figures_by_tensor_and_data_and_names_the_smallest_tensor(capsys):
    config = load_config(None, ["model.path=x", "rollout.max_prompt_tokens=256", "rollout.max_new_tokens=1024"])
    qwen = from_hf_config(PRESETS["Qwen2.5-Math-7B"])
    one = service_memory(config, qwen, 32)
    four = service_memory(config, qwen, 32, tensor=4)
    both = service_memory(config, qwen, 32, tensor=2, data=2)
    # float32: every parameter but the norms has a heads, MLP or vocabulary axis (split 4 ways); norms are whole
    norms = (qwen.hidden_size + 2 * qwen.num_layers * qwen.hidden_size) * 4
    assert four["weights"] == (one["weights"] - norms) // 4 + norms
    assert four["kv_cache"] * 4 == pytest.approx(one["kv_cache"], rel=1e-3)  # heads split
    assert both["kv_cache"] * 4 == pytest.approx(one["kv_cache"], rel=1e-3)  # half the heads of half the rows
    assert both["weights"] == service_memory(config, qwen, 32, tensor=2)["weights"]  # data replicates weights
    assert cli.main(["--model-config", "Qwen2.5-Math-7B", "model.path=x", "--device", "v5e", "--serve-mesh",
                      "tensor=2,data=2"]) == 0
    text = capsys.readouterr().out
    assert "one of its 4 devices (--mesh tensor=2,data=2" in text and "the smallest service mesh that fits" in text
    for argv, reason in ((["--serve-mesh", "heads=2"], "'heads=2' is not tensor=N"),
                         (["--serve-mesh", "tensor=3"], "does not split over 3 devices")):
        assert cli.main(["--model-config", "Qwen2.5-Math-7B", "model.path=x", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m drgrpo_jax.plan: config error: --serve-mesh: ") and reason in err, err


@pytest.mark.heavy  # two prefill programs compiled
def test_a_long_prompts_prefill_grows_linearly_with_it_as_planned():
    """A prompt past PREFILL_CHUNK is prefilled a chunk of columns a program: the program's memory (the prompt's
    cache it writes and its temporaries) doubles with the prompt, not quadruples, and is the plan's figure."""
    config = dataclasses.replace(SMALL, max_position_embeddings=8192)
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    measured = {}
    for length in (2048, 4096):
        ids = jnp.ones((1, programs.PREFILL_CHUNK), jnp.int32)
        analysis = programs.prefill_part.lower(graphdef, state, ids, jnp.zeros_like(ids), None, prompt_len=length,
                                                cache_dtype=jnp.float32).compile().memory_analysis()
        measured[length] = analysis.output_size_in_bytes + analysis.temp_size_in_bytes
        planned = batch_memory(config, 1, length, 1, 4)["prefill_attention"]
        assert planned == pytest.approx(measured[length], rel=0.1)
    assert measured[4096] / measured[2048] == pytest.approx(2, rel=0.1)
