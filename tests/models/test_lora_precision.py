"""LoRA precision: the bfloat16 step against float32, the frozen base stored in bfloat16 or int8 (models/quant.py),
its step, sharding, exact resume and merged export, the plan's base bytes, and the config key's rules."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from drgrpo_jax.config.load import load_config
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models.config import LoraSpec
from drgrpo_jax.models.lora import add_adapters, merged_model, store_base
from drgrpo_jax.models.quant import dequantize, quantize, weight
from drgrpo_jax.models.transformer import Transformer, project

from support.tiny_models import tiny_decoder_config
from support.tiny_step import STEP_RESPONSE, lora_step_fn, make_step_batch

TINY = tiny_decoder_config()
RANK = 3  # no other axis of the tiny model or the step batch is 3: the HLO check below finds the adapters' GEMMs by it
SPEC = LoraSpec(rank=RANK, alpha=6.0)


def lora_model(base_dtype: str | None = None, b_scale: float = 0.3, peaked: bool = False) -> Transformer:
    """The tiny model with random adapters (B != 0, so A gets gradient), its base optionally stored narrower.

    `peaked`: matrices scaled to std 0.3 (peaked next-token distributions, as a trained LM has).
    """
    model = Transformer(TINY, rngs=nnx.Rngs(0))
    if peaked:
        for name, variable in [("embed", model.embed), *vars(model.blocks).items()]:
            if isinstance(variable, nnx.Param) and variable[...].ndim >= 3 or name == "embed":
                variable.set_value(variable[...] * 15.0)
    model = add_adapters(model, SPEC, jax.random.key(1))
    for index, (name, variable) in enumerate(sorted(vars(model.blocks).items())):
        if name.endswith("_lora_b"):
            variable.set_value(b_scale * jax.random.normal(jax.random.key(100 + index), variable[...].shape))
    return model if base_dtype is None else store_base(model, base_dtype)


# ---------------------------------------------------------------------------------------------
# int8: the quantiser and the dequantised GEMM
# ---------------------------------------------------------------------------------------------


def test_int8_is_symmetric_per_output_channel_with_bfloat16_exact_scales():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(2, 64, 48)).astype(np.float32)  # [L, X, Y]
    w[1, :, 5] = 0.0  # an all-zero output channel
    q, scale = quantize(jnp.asarray(w), in_dims=1)
    q, scale = np.asarray(q), np.asarray(scale)
    assert q.dtype == np.int8 and scale.shape == (2, 48) and scale.dtype == np.float32
    assert np.abs(q).max() <= 127 and np.abs(q[0]).max(axis=0).min() >= 126  # each channel spans the range
    assert np.array_equal(scale, np.asarray(jnp.asarray(scale).astype(jnp.bfloat16).astype(jnp.float32)))
    assert scale[1, 5] == 1.0 and not q[1, :, 5].any()  # no division by zero
    assert np.all(np.abs(q * scale[:, None, :] - w) <= scale[:, None, :] / 2 * (1 + 1e-5))  # round to nearest
    # A weight already on an int8 grid with bfloat16 scales, each channel reaching +-127, quantises to itself.
    grid_q = rng.integers(-127, 128, size=(2, 16, 8)).astype(np.int8)
    grid_q[:, 0, :] = 127 * np.where(rng.random((2, 8)) < 0.5, -1, 1)
    grid_scale = np.asarray(jnp.asarray(rng.uniform(1e-3, 1.0, (2, 8)), jnp.bfloat16).astype(jnp.float32))
    again_q, again_scale = quantize(jnp.asarray(grid_q * grid_scale[:, None, :]), in_dims=1)
    np.testing.assert_array_equal(np.asarray(again_q), grid_q)
    np.testing.assert_array_equal(np.asarray(again_scale), grid_scale)
    # A layer dequantised on bfloat16 scales is the float32 dequantised weight rounded once to bfloat16.
    layer32 = dequantize(jnp.asarray(q[0]), jnp.asarray(scale[0]))
    layer16 = dequantize(jnp.asarray(q[0]), jnp.asarray(scale[0]).astype(jnp.bfloat16))
    assert layer32.dtype == jnp.float32 and layer16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(layer16), np.asarray(layer32.astype(jnp.bfloat16)))
    # Head-shaped weights: o_proj [L, Q, H, D] has two input axes and one scale per output D.
    o_q, o_scale = quantize(jnp.asarray(rng.normal(size=(2, 4, 8, 32)), jnp.float32), in_dims=2)
    assert o_q.shape == (2, 4, 8, 32) and o_scale.shape == (2, 32)


def test_int8_dequantised_matmul_matches_float32_within_its_quantisation_step():
    """x @ dequantize(q, s) against x @ w for Gaussian weights: relative error stated at 2%, and it did quantise
    (> 1e-4). int8 rounds each weight by at most half a step, absmax / 254; absmax of 256 Gaussian inputs is
    ~2.9 std, so the rounding's std is ~2.9 / 127 / sqrt(12) = 0.66% of a weight's (measured 0.70% on the output)."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=(1, 256, 96)).astype(np.float32)
    x = rng.normal(size=(2, 10, 256)).astype(np.float32)
    q, scale = quantize(jnp.asarray(w), in_dims=1)
    layer = {"w": q[0], "w_scale": scale[0]}
    got = np.asarray(project(jnp.asarray(x), weight(layer, "w")))
    want = np.einsum("btx,xy->bty", x.astype(np.float64), w[0].astype(np.float64))
    relative = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 1e-4 < relative < 0.02, relative
    np.testing.assert_array_equal(np.asarray(weight({"w": jnp.asarray(w[0])}, "w")), w[0])  # unquantised: as is


# ---------------------------------------------------------------------------------------------
# The step in bfloat16 against float32
# ---------------------------------------------------------------------------------------------


def _lora_sgd_step(compute_dtype: str, base_dtype: str | None = None):
    """(loss, float64 adapter gradients, state after, lowered HLO) of one SGD(lr=1) LoRA step with KL, off-policy."""
    from drgrpo_jax.step.config import StepConfig
    from drgrpo_jax.step.policy import policy_logprobs
    from drgrpo_jax.step.train_step import init_state, train_step

    optimizer = optax.sgd(1.0)  # adapters_after = adapters - grad: the update is the window's gradient
    graphdef, state = init_state(lora_model(base_dtype, peaked=True), optimizer, jax.random.key(0))
    config = StepConfig(loss=LossConfig(budget=STEP_RESPONSE, entropy_coef=0.05, kl_coef=0.1), micro_batches=2,
                        logprob_chunk=5, compute_dtype=compute_dtype)
    batch = make_step_batch()
    float32 = dataclasses.replace(config, compute_dtype="float32")
    old = jax.jit(functools.partial(policy_logprobs, graphdef, float32))(state.params, batch, state.frozen)
    shift = np.random.default_rng(1).uniform(-0.15, 0.15, old.shape).astype(np.float32)
    batch = dataclasses.replace(batch, old_logprobs=np.asarray(old) + shift, behaviour_logprobs=np.asarray(old))
    step = jax.jit(functools.partial(train_step, graphdef, optimizer, optax.constant_schedule(1.0), config))
    hlo = step.lower(state, batch).as_text()
    new_state, metrics = step(state, batch)
    grads = jax.tree.map(lambda before, after: np.asarray(before, np.float64) - np.asarray(after, np.float64),
                         state.params, new_state.params)
    return float(metrics.loss), grads, new_state, hlo


def _dots(hlo: str) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) tensor types of every dot_general in a lowered program."""
    return re.findall(r"stablehlo\.dot_general .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)", hlo)


@pytest.mark.heavy
def test_bfloat16_lora_step_matches_float32_within_bfloat16_precision():
    """model.compute_dtype=bfloat16 with LoRA: base and adapter GEMMs in bfloat16 accumulating in float32, on
    float32 adapter masters; the loss and the adapter gradients agree with float32's.

    Stated tolerances, as the full fine-tuning test's (tests/step/test_train_step.py): the loss within 1e-3 absolute
    (measured 1.9e-4), the adapters' gradient within 0.1 in relative L2 norm (measured 0.050; 0.038 before
    attention's GEMMs ran in bfloat16) and each adapter's within 0.15 (measured at most 0.063).
    """
    loss32, grads32, state32, hlo32 = _lora_sgd_step("float32")
    loss16, grads16, state16, hlo16 = _lora_sgd_step("bfloat16")
    assert "bf16" not in hlo32 and "bf16" in hlo16
    adapter_dots = [d for d in _dots(hlo16) if re.search(rf"<(\d+x)*{RANK}(x\d+)*x?bf16>", d[0] + d[1])]
    assert len(adapter_dots) >= 4  # A and B forward, and their backward GEMMs
    for lhs, rhs, out in adapter_dots:  # the PERF_NOTES trap: a bfloat16 GEMM must accumulate in float32
        assert lhs.endswith("xbf16>") and rhs.endswith("xbf16>") and out.endswith("xf32>"), (lhs, rhs, out)
    assert {x.dtype for x in jax.tree.leaves(state16.params)} == {jnp.dtype(jnp.float32)}  # float32 masters
    assert {x.dtype for x in jax.tree.leaves(state16.opt_state) if hasattr(x, "dtype")} <= {jnp.dtype(jnp.float32),
                                                                                            jnp.dtype(jnp.int32)}
    assert {x.dtype for x in jax.tree.leaves(state16.frozen)} == {jnp.dtype(jnp.float32)}  # the base: not recast
    assert abs(loss16 - loss32) < 1e-3
    flat32, flat16 = (np.concatenate([g.ravel() for g in jax.tree.leaves(t)]) for t in (grads32, grads16))
    relative = np.linalg.norm(flat16 - flat32) / np.linalg.norm(flat32)
    assert 1e-4 < relative < 0.1, relative  # bfloat16 did round, but little
    for (path, g32), g16 in zip(jax.tree_util.tree_leaves_with_path(grads32), jax.tree.leaves(grads16)):
        assert np.linalg.norm(g16 - g32) <= 0.15 * np.linalg.norm(g32), jax.tree_util.keystr(path)


# ---------------------------------------------------------------------------------------------
# The stored base: bfloat16 or int8
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("base_dtype, stored", [("bfloat16", jnp.bfloat16), ("int8", jnp.int8)])
def test_store_base_narrows_the_projections_only(base_dtype, stored):
    model = lora_model(base_dtype)
    arrays = model.blocks.arrays()
    for name in SPEC.targets:
        assert arrays[name].dtype == stored, name
        assert arrays[f"{name}_lora_a"].dtype == jnp.float32  # the adapters: float32 masters
        assert (f"{name}_scale" in arrays) == (base_dtype == "int8")
    assert arrays["attn_norm"].dtype == model.embed[...].dtype == jnp.float32  # the residual stream keeps float32
    if base_dtype == "int8":
        assert arrays["o_proj_scale"].shape == (TINY.num_layers, TINY.hidden_size)
        assert arrays["q_proj_scale"].shape == (TINY.num_layers, TINY.num_heads, TINY.head_dim)


@pytest.mark.heavy
@pytest.mark.parametrize("base_dtype, tolerance, merged_tolerance", [("bfloat16", 1e-3, 1e-3), ("int8", 2e-3, 1e-5)])
def test_stored_base_model_and_its_merged_export_match_the_float32_base(base_dtype, tolerance, merged_tolerance):
    """Logits of the stored base (adapters on) against the float32 base's, next to the adapters' own effect
    (~0.58): within `tolerance` (measured 2.1e-4 bfloat16, 5.1e-4 int8). The merged export (float32, int8
    dequantised) against the stored model: int8 to float32 rounding (measured 1.2e-7); bfloat16 by the
    activations' rounding in the stored model's bfloat16 GEMMs, which the float32 merged model skips (1.8e-4)."""
    ids = jax.random.randint(jax.random.key(0), (2, 7), 0, TINY.vocab_size)
    logits = nnx.jit(lambda m, x: m(x))
    want = logits(lora_model(), ids)
    assert float(jnp.abs(want - logits(lora_model(b_scale=0.0), ids)).max()) > 0.3  # the adapters matter
    model = lora_model(base_dtype)
    got = logits(model, ids)
    assert 1e-6 < float(jnp.abs(got - want).max()) < tolerance  # it did round
    merged = merged_model(model)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(merged, nnx.Param))} == {jnp.dtype(jnp.float32)}
    assert not any(name.endswith("_scale") for name in merged.blocks.arrays())
    np.testing.assert_allclose(logits(merged, ids), got, atol=merged_tolerance)


def _stored_base_steps(base_dtype: str, mesh_shape=(1, 1, 1), steps: int = 2, checkpoint_dir=None):
    """(initial state, state after each step, metrics of each) of LoRA steps (KL on) on a base stored as
    `base_dtype`; with `checkpoint_dir` the state after step 1 is saved there."""
    from drgrpo_jax.checkpoint import Checkpointer, abstract_state_like

    state, one, frozen_shardings = lora_step_fn(lora_model(base_dtype, b_scale=0.0), mesh_shape, micro_batches=2)
    # What a resumed process does: load and store the base again (deterministic), place it.
    rebuilt = jax.device_put(nnx.split(lora_model(base_dtype, b_scale=0.0), nnx.LoRAParam, nnx.Param)[2],
                             frozen_shardings)
    initial, states, history = jax.device_get(state), [], []
    for index in range(steps):
        state, metrics = one(state)
        states.append(jax.device_get(state))
        history.append(jax.device_get(metrics))
        if checkpoint_dir is not None and index == 0:
            with Checkpointer(checkpoint_dir, save_every=1, keep=1) as checkpointer:
                checkpointer.save(1, state.checkpointed(), {"step": 1})
            abstract = abstract_state_like(state.checkpointed())  # before the next step donates it
    return initial, states, history, one, (rebuilt, abstract if checkpoint_dir is not None else None)


@pytest.mark.heavy
@pytest.mark.parametrize("base_dtype, mesh_atol", [("bfloat16", 1e-5), ("int8", 1e-6)])
def test_stored_base_step_trains_only_adapters_shards_and_resumes_exactly(base_dtype, mesh_atol, tmp_path):
    """`mesh_atol`: on another mesh the float32 partial sums add in another order; int8 dequantises to float32
    and agrees to float32 rounding, while a bfloat16 GEMM input may then round to the neighbouring bfloat16
    (measured 1.5e-6 on one adapter entry of ~3e-4, none elsewhere)."""
    from drgrpo_jax.checkpoint import Checkpointer

    initial, states, history, one, (rebuilt, abstract) = _stored_base_steps(base_dtype, checkpoint_dir=tmp_path)
    names = {str(path[-1]) for path, _ in nnx.to_flat_state(states[0].params)}
    assert names == {f"{t}_lora_{m}" for t in SPEC.targets for m in "ab"}  # gradients and Adam: adapters only
    for got, want in zip(jax.tree.leaves(states[-1].frozen), jax.tree.leaves(initial.frozen)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)  # the stored base never moves, int8 and scales included
    # The KL reference is the same stored base with the adapters off: 0 while B = 0, then it grows.
    assert history[0].tokens.kl < 1e-9 < history[1].tokens.kl and history[0].grad_norm > 0
    # Resume: the base stored again is the same bits; adapters, Adam and the step come from the checkpoint.
    for got, want in zip(jax.tree.leaves(jax.device_get(rebuilt)), jax.tree.leaves(initial.frozen)):
        np.testing.assert_array_equal(got, want)
    with Checkpointer(tmp_path, save_every=1, keep=1) as checkpointer:
        restored = checkpointer.restore(1, abstract)
    resumed, metrics = one(dataclasses.replace(restored.state, frozen=rebuilt))
    resumed = jax.device_get(resumed)
    for part in ("params", "opt_state", "step"):
        got, want = jax.tree.leaves(getattr(resumed, part)), jax.tree.leaves(getattr(states[1], part))
        for got_leaf, want_leaf in zip(got, want, strict=True):
            np.testing.assert_array_equal(got_leaf, want_leaf)
    assert jax.device_get(metrics).row() == history[1].row()
    # Sharded: the scales shard like their weights' output axes; the update agrees with one device's.
    _, sharded, sharded_history, _, _ = _stored_base_steps(base_dtype, (2, 2, 2), steps=1)
    for got_leaf, want_leaf in zip(jax.tree.leaves(sharded[0].params), jax.tree.leaves(states[0].params)):
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-5, atol=mesh_atol)
    np.testing.assert_allclose(sharded_history[0].loss, history[0].loss, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# The plan and the config
# ---------------------------------------------------------------------------------------------


def test_plan_counts_the_stored_base_by_base_dtype():
    from drgrpo_jax.models.config import from_hf_config
    from drgrpo_jax.plan import planner as plan
    from drgrpo_jax.plan.hardware import PRESETS

    model = from_hf_config(PRESETS["Qwen2.5-Math-7B"])
    D, I, Q, C, H, L = 3584, 18944, 28, 4, 128, 28
    projections = L * (2 * D * Q * H + 2 * D * C * H + 3 * D * I)  # q, o; k, v; gate, up, down
    scales = L * (Q * H + 2 * C * H + D + 2 * I + D)  # one float32 per output channel: q, k, v, o, gate, up, down

    def trainer(*overrides):
        config = load_config(None, ["model.path=x", "mesh.fsdp=1", "model.lora.rank=16", *overrides])
        return plan.make_plan(config, model)

    full = trainer()
    parameters = full["model"]["parameters"]
    assert full["trainer"]["params"] == 4 * parameters
    for base_dtype, stored in [("bfloat16", 4 * parameters - 2 * projections),
                               ("int8", 4 * parameters - 3 * projections + 4 * scales)]:
        narrow = trainer(f"model.lora.base_dtype={base_dtype}")
        assert narrow["trainer"]["params"] == stored, base_dtype
        for key in ("adapters", "optimizer", "gradients"):  # the float32 adapters do not change
            assert narrow["trainer"][key] == full["trainer"][key]
        assert narrow["service"] == full["service"]  # the services load model.path's weights, as before
    assert trainer("model.lora.base_dtype=int8")["trainer"]["params"] < 0.4 * full["trainer"]["params"]
    bf16 = trainer("model.dtype=bfloat16")["trainer"]["params"]
    assert bf16 == 2 * parameters == trainer("model.dtype=bfloat16", "model.lora.base_dtype=bfloat16")["trainer"][
        "params"]
    assert trainer("model.dtype=bfloat16", "model.lora.base_dtype=int8")["trainer"]["params"] == \
        bf16 - projections + 4 * scales


@pytest.mark.parametrize("overrides, reason", [
    (["model.lora.base_dtype=int8"], "needs model.lora.rank > 0"),
    (["model.lora.rank=8", "model.dtype=bfloat16", "model.lora.base_dtype=float32"], "would widen"),
    (["model.lora.rank=8", "model.lora.base_dtype=bfloat16", "model.compute_dtype=float32"], "compute in bfloat16"),
    (["model.lora.rank=8", "model.lora.base_dtype=int4"], "expected one of"),
])
def test_bad_base_dtype_names_the_key(overrides, reason):
    with pytest.raises(ConfigError, match=f"^model.lora.base_dtype: .*{reason}"):
        load_config(None, ["model.path=m", *overrides])
    assert load_config(None, ["model.path=m"]).model.lora.base_dtype == "model"  # the default: as before
    load_config(None, ["model.path=m", "model.lora.rank=8", "model.lora.base_dtype=int8",
                       "model.compute_dtype=float32"])  # int8 dequantises to float32 there


@pytest.mark.subprocess  # the trainer CLI and its generation service
def test_trainer_runs_lora_on_an_int8_base_in_bfloat16_and_pushes_merged_models(tiny_model, prompts_file, tmp_path):
    """run.setup stores the base as int8, the step computes in bfloat16, each push is the merged (dequantised)
    float32 model, and final/ is the PEFT adapter."""
    import json
    import os

    from drgrpo_jax.models.lora import load_adapter
    from drgrpo_jax.models.pretrained import from_pretrained

    from support.trainer_runs import start_trainer, trainer_overrides

    output_dir = tmp_path / "run"
    process = start_trainer(trainer_overrides(tiny_model, prompts_file, output_dir, steps=2) + [
        "model.lora.rank=4", "model.lora.alpha=8", "algorithm.kl_coef=0.05", "model.lora.base_dtype=int8",
        "model.compute_dtype=bfloat16", "model.lora.push=merged",
        "rollout.weight_sync=disk"])  # versioned folders to inspect (auto would push merged models over shm)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    with open(output_dir / "metrics.jsonl") as f:
        rows = [row for row in map(json.loads, f) if "loss" in row]
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows) and rows[-1]["grad_norm"] > 0
    assert "config.json" in os.listdir(output_dir / "weights" / "v2")  # a merged HF folder, not an adapter
    spec, final = load_adapter(str(output_dir / "final"), from_pretrained(tiny_model).config)
    assert spec.rank == 4 and float(np.abs(final["q_proj_lora_b"]).max()) > 0
    with open(output_dir / "weights" / "v2" / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "float32"  # dequantised into model.dtype
