"""A mixture's sampler memory (sampler/memory.py) against the compiled prefill and decode programs' own memory
analysis on CPU, where ragged_dot runs JAX's per-expert fallback: the dispatch buffers, the fallback's copies of
the expert weights, and the routed experts a recording batch carries (issue #55); within the 10% the dense
sampler checks allow (tests/plan/test_plan_service.py)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest
from flax import nnx

from drgrpo_jax.config.load import load_config
from drgrpo_jax.config.serve import ServeConfig
from drgrpo_jax.models.config import DecoderConfig
from drgrpo_jax.models.hf_io import load_hf_config
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.plan.service import service_memory, service_total
from drgrpo_jax.sampler import programs
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams, make_batch
from drgrpo_jax.sampler.memory import batch_memory, batch_peak
from drgrpo_jax.serve.batch_budget import BatchBudget

from support.tiny_models import write_tiny_qwen3_moe

# Experts large enough that their buffers and the fallback's weight copies outweigh XLA's small ones.
MOE = DecoderConfig(family="qwen3_moe", vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=2,
                    num_heads=8, num_kv_heads=8, head_dim=32, max_position_embeddings=1024, num_experts=8,
                    experts_per_token=2, moe_intermediate_size=256, norm_topk_prob=True)


def _compiled(rows: int, prompt: int, new: int, record: bool = False) -> dict[str, int]:
    """Bytes of the sampler's prefill and decode loop (at its last span, the cache donated) on one device for
    `rows` rows, each its own prompt (the prefill's worst case, which the plan assumes)."""
    graphdef, state = nnx.split(Transformer(MOE, rngs=nnx.Rngs(0)))
    requests = [RowRequest(tuple(range(3 + i, 3 + i + prompt - i % prompt)), SamplingParams(max_new_tokens=new),
                           seed=1) for i in range(rows)]
    batch = make_batch(requests, (2,), batch_size=rows, prompt_len=prompt, num_prompts=rows)
    kwargs = dict(max_new_tokens=new, num_slots=prompt + new - 1, cache_dtype=jnp.float32, record_experts=record)
    prefill = programs.prefill.lower(graphdef, state, batch, **kwargs).compile().memory_analysis()
    decoding = programs.prefill(graphdef, state, batch, **kwargs)
    decode = programs.decode_phase.lower(graphdef, state, decoding, jnp.int32(new)).compile().memory_analysis()
    return {"prefill_arguments": prefill.argument_size_in_bytes,
            "prefill_peak": prefill.argument_size_in_bytes + prefill.output_size_in_bytes
            + prefill.temp_size_in_bytes,
            "decode_arguments": decode.argument_size_in_bytes, "decode_temp": decode.temp_size_in_bytes,
            "decode_peak": decode.argument_size_in_bytes + decode.output_size_in_bytes - decode.alias_size_in_bytes
            + decode.temp_size_in_bytes}


def _planned(rows: int, prompt: int, new: int, replay: bool = False) -> dict[str, int]:
    config = load_config(None, ["model.path=x", f"rollout.max_prompt_tokens={prompt}",
                                f"rollout.max_new_tokens={new}", f"model.moe.router_replay={replay}"])
    return service_memory(config, MOE, rows, backend="cpu")


@pytest.mark.heavy  # two sampler programs compiled per case
@pytest.mark.parametrize("rows, prompt, new, peak", [
    (8, 16, 128, "decode"),  # every layer's fallback copies of the experts, and the layers' weights
    (16, 512, 32, "prefill"),  # a chunk's attention scores outweigh its dispatch buffers
    (32, 128, 64, "prefill"),  # the dispatch buffers outweigh the scores
])
def test_moe_service_figures_match_the_compiled_programs_within_10_percent(rows, prompt, new, peak):
    """The cache, the peaking program's figure (the other's is not the plan's concern) and the total."""
    planned = _planned(rows, prompt, new)
    measured = _compiled(rows, prompt, new)
    assert planned["kv_cache"] == pytest.approx(measured["decode_arguments"] - planned["weights"], rel=0.1)
    prefill = measured["prefill_peak"] - measured["prefill_arguments"]  # the cache it writes and its temporaries
    assert (measured["prefill_peak"] > measured["decode_peak"]) == (peak == "prefill")
    if peak == "decode":
        assert planned["layer_split"] + planned["decode_temporaries"] == pytest.approx(measured["decode_temp"],
                                                                                       rel=0.1)
    else:
        assert planned["layer_split"] + planned["kv_cache"] + planned["prefill_attention"] == pytest.approx(
            prefill, rel=0.1)
    assert service_total(planned) == pytest.approx(max(measured["prefill_peak"], measured["decode_peak"]), rel=0.1)


@pytest.mark.heavy  # two sampler programs compiled, recording and not
def test_a_recording_batch_carries_its_routed_experts_in_the_figure():
    """record_experts: int32 [rows, new, L, k] and the prompts' [rows, prompt, L, k] ride in the decode loop's
    carry; the figure (0 without recording) is what the carry grows by, and the batch's peak counts it."""
    rows, prompt, new = 8, 64, 128
    plain, recording = _compiled(rows, prompt, new), _compiled(rows, prompt, new, record=True)
    figures = _planned(rows, prompt, new, replay=True)
    assert _planned(rows, prompt, new)["recorded_experts"] == 0
    assert figures["recorded_experts"] == rows * (new + prompt) * MOE.num_layers * MOE.experts_per_token * 4
    grown = recording["decode_arguments"] - plain["decode_arguments"]
    assert figures["recorded_experts"] == pytest.approx(grown, rel=0.1)
    assert service_total(figures) == pytest.approx(max(recording["prefill_peak"], recording["decode_peak"]),
                                                   rel=0.1)


def test_the_engine_budgets_recorded_experts_for_a_batch_that_asks_for_them(tmp_path):
    """A batch with one row asking return_routed_experts is budgeted with the recording buffers: two such rows
    no longer fit a budget that two plain rows fill."""
    folder = write_tiny_qwen3_moe(str(tmp_path))
    config = load_hf_config(folder)
    budget = BatchBudget.of(ServeConfig(model=folder), config, None)
    plain, recording = budget.batch_bytes(2, 20, 30), budget.batch_bytes(2, 20, 30, record=True)
    figures = batch_memory(config, 2, 32, 32, 4, record=True)
    assert recording - plain == figures["recorded_experts"] == 2 * 64 * config.num_layers * \
        config.experts_per_token * 4
    assert recording == batch_peak(figures)
    params = SamplingParams(max_new_tokens=30)
    row = RowRequest(tuple(range(1, 21)), params, seed=0)
    wanting = RowRequest(tuple(range(1, 21)), params, seed=0, return_routed_experts=True)
    budget = dataclasses.replace(budget, limit=plain)
    for first, fits in ((row, 2), (wanting, 1)):
        assert budget.rows_that_fit([first, row]) == fits
