"""The sharded training step: the same window gives the same update on every mesh and micro-batching."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from drgrpo_jax.errors import FieldError
from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models.config import RuntimeOptions
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.step.config import StepConfig, importance_weights
from drgrpo_jax.step.optimizer import make_optimizer
from drgrpo_jax.step.policy import policy_logprobs
from drgrpo_jax.step.train_step import init_state, train_step

from support import oracles
from support.compiled import compiled_dots
from support.tiny_models import tiny_decoder_config
from support.tiny_step import STEP_RESPONSE, STEP_ROWS, assert_same, make_step_batch, run_step
from support.two_processes import run_two_processes

pytestmark = pytest.mark.heavy  # the sharded training step compiled on several meshes

AGGREGATIONS = ["fixed_budget", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
TINY = tiny_decoder_config()


@pytest.fixture(scope="module")
def reference():
    return {agg: run_step((1, 1, 1), 1, agg) for agg in AGGREGATIONS}


MESHES = [(8, 1, 1), (2, 2, 2), (1, 8, 1)]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("mesh_shape, micro_batches", [((8, 1, 1), 2), ((2, 2, 2), 4), ((1, 8, 1), 1)])
def test_update_is_invariant_to_mesh_and_micro_batches(reference, aggregation, mesh_shape, micro_batches):
    state, history, _ = run_step(mesh_shape, micro_batches, aggregation)
    ref_state, ref_history, _ = reference[aggregation]
    assert_same(state.params, ref_state.params, "params")
    for k in ref_history[0].keys() - {"compiles_so_far"}:
        np.testing.assert_allclose(history[0][k], ref_history[0][k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert ref_history[0]["grad_norm"] > 0


@pytest.mark.parametrize("mesh_shape, micro_batches", [((2, 2, 2), 2), ((1, 8, 1), 4)])
def test_full_remat_sums_the_gradients_in_place_to_the_same_update(reference, mesh_shape, micro_batches):
    """Under full remat the layer scan's backward adds into the running gradient sum (models/grad_sums.py)."""
    state, history, _ = run_step(mesh_shape, micro_batches, remat="full")
    assert_same(state.params, reference["fixed_budget"][0].params, "params")
    np.testing.assert_allclose(history[0]["grad_norm"], reference["fixed_budget"][1][0]["grad_norm"], rtol=1e-5)


@pytest.mark.slow  # the full cross product: 12 more compiles of the step (~1 min)
@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), *MESHES])
@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_full_matrix_fixed_budget(reference, mesh_shape, micro_batches):
    state, history, _ = run_step(mesh_shape, micro_batches)
    assert_same(state.params, reference["fixed_budget"][0].params, "params")


@pytest.mark.parametrize("aggregation", ["fixed_budget", "seq_mean_token_mean"])
def test_on_policy_step_uses_its_own_logprobs_and_matches_the_recomputed_ones(reference, aggregation):
    """One window per rollout: the step's stop-gradient log-probs replace the old-log-prob forward exactly."""
    state, history, _ = run_step((2, 2, 2), 2, aggregation, on_policy=True)  # batch.old_logprobs are NaN
    ref_state, ref_history, _ = reference[aggregation]
    assert_same(state.params, ref_state.params, "params")
    for k in ("loss", "pg_loss", "grad_norm", "entropy", "num_tokens"):
        np.testing.assert_allclose(history[0][k], ref_history[0][k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert history[0]["clip_fraction"] == 0 and history[0]["approx_kl"] == 0  # ratio exactly 1


def test_on_policy_step_keeps_truncated_importance_sampling():
    shifted = dict(tis_cap=1.5, behaviour_shift=-0.3)  # exp(old - behaviour) = exp(0.3) > 1.5 is capped
    state, history, _ = run_step((1, 1, 1), 1, on_policy=True, **shifted)
    ref_state, ref_history, _ = run_step((1, 1, 1), 1, **shifted)
    assert_same(state.params, ref_state.params, "params")
    np.testing.assert_allclose(history[0]["tis_weight"], ref_history[0]["tis_weight"], rtol=1e-6)


def test_metrics_are_complete_and_the_step_compiles_once():
    state, history, step = run_step((2, 2, 2), 2, steps=4, optimizer=make_optimizer(1e-2, total_steps=4)[0])
    expected = {"loss", "pg_loss", "kl", "entropy", "clip_fraction", "approx_kl", "grad_norm", "learning_rate",
                "num_responses", "num_tokens", "skipped", "behaviour_kl", "tis_weight"}
    assert expected <= set(history[0])
    for metrics in history:
        assert all(np.isfinite(v) for v in metrics.values())
    assert history[0]["num_responses"] == STEP_ROWS - 1
    assert history[0]["num_tokens"] == make_step_batch().response_mask[:-1].sum()
    assert int(state.step) == 4
    # Step 2 compiles the on-mesh old log-probs once (step 1 used shared ones); then nothing compiles.
    assert history[0]["compiles_so_far"] > 0, "the counter sees programs, compiled or cached"
    assert history[3]["compiles_so_far"] == history[1]["compiles_so_far"], "a step of the same shapes recompiled"
    # on-policy (old == current at the start of each step): the ratio is 1 and nothing clips
    assert history[0]["clip_fraction"] == 0 and history[0]["approx_kl"] < 1e-10


def test_empty_window_changes_nothing():
    initial = jax.device_get(nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)), nnx.Param)[1])
    state, history, _ = run_step((2, 2, 2), 2, lengths=np.zeros(STEP_ROWS, int), steps=2,
                                 optimizer=make_optimizer(1e-2, total_steps=2)[0])
    for metrics in history:
        assert metrics["skipped"] == 1 and metrics["grad_norm"] == 0.0 and metrics["loss"] == 0.0
        assert all(np.isfinite(v) for v in metrics.values())
    assert int(state.step) == 2
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(initial)):
        np.testing.assert_array_equal(a, b)
    assert all(int(x) == 0 for x in jax.tree.leaves(state.opt_state) if np.ndim(x) == 0 and
               np.issubdtype(np.asarray(x).dtype, np.integer)), "the optimizer's step count must not move"


@pytest.mark.parametrize("mesh_shape, micro_batches, remat", [((1, 1, 1), 1, "none"), ((2, 2, 2), 2, "full")])
def test_the_update_overwrites_the_donated_state_without_copying_it(mesh_shape, micro_batches, remat):
    """The params' update reads the old Adam moments; unless their overwrite is ordered after it, XLA copies every
    moment first (twice the params' bytes at the update: 56 GB for 7B)."""
    state, _, step = run_step(mesh_shape, micro_batches, optimizer=make_optimizer(1e-2, total_steps=1)[0],
                              remat=remat)
    text = step.lower(state, make_step_batch()).compile().as_text()
    parameters = re.findall(r"^\s*%(\S+) = .* parameter\(\d+\)(.*)$", text, re.MULTILINE)  # (name, sharding, path)
    moments = [name for name, rest in parameters
               if re.search(r"opt_state[\W_]*\d[\W_]*\d[\W_]*(mu|nu)[\W_]", name + rest)]
    assert len(moments) == 2 * len(jax.tree.leaves(state.params)), "the check must see every moment"
    copied = [name for name in moments if re.search(rf"copy\(%{re.escape(name)}\)", text)]
    assert not copied, f"moments copied before their in-place update: {copied}"


def test_a_shard_with_every_response_masked():
    lengths = np.array([0, 0, 11, 12, 10, 12, 9, 12, 1, 2, 0, 3, 1, 1, 2, 0])  # shard 0 of data=8 holds rows 0, 1
    unsharded, ref_history, _ = run_step((1, 1, 1), 1, lengths=lengths)
    sharded, history, _ = run_step((8, 1, 1), 1, lengths=lengths)
    assert_same(sharded.params, unsharded.params, "params")
    assert all(np.isfinite(v) for v in history[0].values())


def test_kl_uses_a_frozen_reference():
    state, history, _ = run_step((2, 2, 2), 1, kl_coef=0.1, steps=2, optimizer=make_optimizer(1e-2, total_steps=2)[0])
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference before the first update
    assert history[1]["kl"] > 0
    initial = jax.device_get(nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)), nnx.Param)[1])
    for a, b in zip(jax.tree.leaves(state.ref_params), jax.tree.leaves(initial)):
        np.testing.assert_array_equal(a, b)


def test_truncated_importance_sampling():
    plain, plain_history, _ = run_step((1, 1, 1), 1)
    same, same_history, _ = run_step((1, 1, 1), 1, tis_cap=2.0)
    assert_same(same.params, plain.params, "TIS with behaviour == old changes nothing")
    shifted, history, _ = run_step((1, 1, 1), 1, tis_cap=2.0, behaviour_shift=-1.0)  # old/behaviour = e > cap
    assert history[0]["tis_weight"] == pytest.approx(2.0)
    assert history[0]["behaviour_kl"] > 0
    np.testing.assert_allclose(history[0]["pg_loss"], 2.0 * plain_history[0]["pg_loss"], rtol=1e-5)


def test_adam_moments_are_float32_for_bfloat16_params():
    """make_optimizer keeps float32 state whatever the param dtype; the update comes back in the param dtype."""
    model = nnx.jit(lambda: Transformer(TINY, rngs=nnx.Rngs(0), dtype=jnp.bfloat16))()  # one program, not ~40 ops
    optimizer, _ = make_optimizer(1e-2, total_steps=2, weight_decay=0.1)
    _, state = init_state(model, optimizer, jax.random.key(0))
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    floats = [x for x in jax.tree.leaves(state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert len(floats) == 2 * len(jax.tree.leaves(state.params))
    assert {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}
    grads = jax.tree.map(lambda p: np.full(p.shape, 1e-3, np.float32), state.params)
    # One program for the whole update (eagerly, each of Adam's ops per leaf shape is a program of its own)
    updates, opt_state = jax.jit(optimizer.update)(grads, state.opt_state, state.params)
    assert {x.dtype for x in jax.tree.leaves(updates)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(opt_state) if jnp.issubdtype(x.dtype, jnp.floating)} == \
        {jnp.dtype(jnp.float32)}
    # nu = (1 - b2) * g^2 = 1e-9 to float32 precision; a bfloat16 moment would be off by up to 2^-8 relative
    nu = [x for x in jax.tree.leaves(opt_state) if jnp.issubdtype(x.dtype, jnp.floating)][-1]
    np.testing.assert_allclose(np.asarray(nu), (1 - 0.999) * 1e-6, rtol=1e-6)


def _peaked_params():
    """The tiny model with its matrices scaled to std 0.3: peaked next-token distributions, as a trained LM has."""
    graphdef, params = nnx.split(Transformer(TINY, rngs=nnx.Rngs(0)), nnx.Param)
    scaled = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 15.0 if x.ndim >= 2 and "norm" not in jax.tree_util.keystr(path) else x, params)
    return graphdef, scaled


def _mixed_precision_step(compute_dtype: str):
    """(token log-probs, loss, float64 gradient, params after, lowered HLO) of one SGD(lr=1) step, off-policy.

    The old log-probs are float32's own, shifted per token within +-0.15 (every ratio inside the clip, so
    every token carries gradient); an entropy bonus makes the loss depend on the whole distribution.
    """
    graphdef, params = _peaked_params()
    optimizer = optax.sgd(1.0)  # params_after = params - grad: the update is the window's gradient
    state = init_state(nnx.merge(graphdef, params), optimizer, jax.random.key(0))[1]
    config = StepConfig(loss=LossConfig(budget=STEP_RESPONSE, entropy_coef=0.05), micro_batches=2,
                        logprob_chunk=5, compute_dtype=compute_dtype)
    batch = make_step_batch()
    float32_config = dataclasses.replace(config, compute_dtype="float32")
    old = jax.jit(functools.partial(policy_logprobs, graphdef, float32_config))(params, batch)
    shift = np.random.default_rng(1).uniform(-0.15, 0.15, old.shape).astype(np.float32)
    batch = dataclasses.replace(batch, old_logprobs=np.asarray(old) + shift, behaviour_logprobs=np.asarray(old))
    logprobs = jax.jit(functools.partial(policy_logprobs, graphdef, config))(params, batch)
    step = jax.jit(functools.partial(train_step, graphdef, optimizer, optax.constant_schedule(1.0), config))
    hlo = step.lower(state, batch).as_text()
    new_state, metrics = step(state, batch)
    grads = jax.tree.map(lambda before, after: np.asarray(before, np.float64) - np.asarray(after, np.float64),
                         state.params, new_state.params)
    return np.asarray(logprobs), float(metrics.loss), grads, new_state.params, hlo


def test_bfloat16_compute_matches_float32_within_bfloat16_precision():
    """compute_dtype=bfloat16 runs the GEMMs in bfloat16 on float32 masters; params stay float32.

    Stated tolerances, about twice what this peaked model measures (bfloat16 keeps 8 bits, 2^-9 relative per
    rounding, on logits spanning ~9 nats): token log-probs within 0.15 nats (measured 0.08), the loss within
    2e-3 absolute (its per-token terms are O(1), a bf16 ulp at 1 is 7.8e-3; measured 1.2e-4 with float32
    attention, 7.6e-4 since attention's GEMMs run in bfloat16 too), the gradient within 0.1 in relative L2
    norm (measured 0.044) and every parameter's within 0.15 (measured at most 0.051).
    """
    logprobs32, loss32, grads32, _, hlo32 = _mixed_precision_step("float32")
    logprobs16, loss16, grads16, params16, hlo16 = _mixed_precision_step("bfloat16")
    assert "bf16" not in hlo32 and "bf16" in hlo16  # the cast happened, inside the compiled step
    assert {x.dtype for x in jax.tree.leaves(params16)} == {jnp.dtype(jnp.float32)}
    mask = make_step_batch().response_mask
    assert logprobs16.dtype == np.float32 and np.abs(logprobs16 - logprobs32)[mask].max() < 0.15
    assert np.ptp(logprobs32[mask]) > 5.0  # peaked distributions: the check is not about a uniform model
    assert abs(loss16 - loss32) < 2e-3
    flat32, flat16 = (np.concatenate([g.ravel() for g in jax.tree.leaves(t)]) for t in (grads32, grads16))
    relative = np.linalg.norm(flat16 - flat32) / np.linalg.norm(flat32)
    assert 1e-4 < relative < 0.1, relative  # bfloat16 did round (float32 against itself: ~1e-7), but little
    for (path, g32), g16 in zip(jax.tree_util.tree_leaves_with_path(grads32), jax.tree.leaves(grads16)):
        assert np.linalg.norm(g16 - g32) <= 0.15 * np.linalg.norm(g32), jax.tree_util.keystr(path)
    with pytest.raises(FieldError, match="^StepConfig.compute_dtype: unknown 'float16'"):
        StepConfig(loss=LossConfig(budget=4), compute_dtype="float16")


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_bfloat16_step_runs_every_gemm_in_bfloat16_into_float32(impl):
    """Every dot of the compiled (optimised) bf16 step, projections, attention and the vocabulary's forward and
    backward, takes bf16 operands into a float32 result: XLA's CPU silently upcasts a bf16 dot it cannot hand to
    YNNPACK (a folded transpose, a transposed output) into a float32 dot, ~5x slower (models/gemm.py)."""
    graphdef, params = _peaked_params()
    model = nnx.merge(graphdef, params)
    model.runtime = RuntimeOptions(attention_impl=impl, remat="full")
    graphdef, state = init_state(model, optax.sgd(1.0), jax.random.key(0))
    config = StepConfig(loss=LossConfig(budget=STEP_RESPONSE), micro_batches=2, logprob_chunk=5,
                        compute_dtype="bfloat16")
    step = jax.jit(functools.partial(train_step, graphdef, optax.sgd(1.0), optax.constant_schedule(1.0), config))
    dots = compiled_dots(step.lower(state, make_step_batch()).compile().as_text(), shapes=True)
    assert {(o.split("[")[0], x.split("[")[0], y.split("[")[0]) for o, x, y in dots} == {("f32", "bf16", "bf16")}, dots
    V, W = TINY.vocab_size, 5
    assert sum(o.count(",") == 3 for o, _, _ in dots) >= 6  # attention: QK^T, PV and their 4 gradients (4-D)
    assert {o for o, _, _ in dots} >= {f"f32[{W},{V}]", f"f32[{W},{TINY.hidden_size}]",  # logits, dhidden
                                       f"f32[{V},{TINY.hidden_size}]"}  # and the tied embedding's gradient


def test_bad_step_config_names_the_field():
    with pytest.raises(FieldError, match="^StepConfig.micro_batches: must be an int >= 1, got 0$"):
        StepConfig(loss=LossConfig(budget=4), micro_batches=0)
    for cap in (0.5, 0.0, float("inf"), float("nan")):  # C < 1 would down-weight on-policy tokens too
        with pytest.raises(FieldError, match="^StepConfig.tis_cap: must be finite and >= 1") as info:
            StepConfig(loss=LossConfig(budget=4), tis_cap=cap)
        assert (info.value.owner, info.value.field) == ("StepConfig", "tis_cap")
    with pytest.raises(TypeError, match="^StepConfig.tis_cap: must be a number"):
        StepConfig(loss=LossConfig(budget=4), tis_cap="2")
    assert StepConfig(loss=LossConfig(budget=4), tis_cap=1.0).tis_cap == 1.0
    with pytest.raises(ValueError, match="^train.micro_batches"):
        run_step((1, 1, 1), 3)
    with pytest.raises(ValueError, match="^optimizer.decay"):
        make_optimizer(1e-3, total_steps=3, decay="step")


@pytest.mark.subprocess  # two jax.distributed processes
@pytest.mark.parametrize("dcn_data, mesh", [(1, "2,2,1,2"), (2, "2,2,1,2"), (1, "1,1,4,2")],
                         ids=["one_slice", "two_slices", "context_across_hosts"])
def test_two_processes_match_one(reference, tmp_path, dcn_data, mesh):
    """A two-process jax.distributed run on loopback gives the one-process update: one slice, two (data crossing
    them), or a row's tokens split four ways over both processes (data, fsdp, context, tensor = 1, 1, 4, 2)."""
    result = run_two_processes("multihost_worker.py", tmp_path / "out.npz", str(dcn_data), mesh)
    ref_state, ref_history, _ = reference["fixed_budget"]
    for i, leaf in enumerate(jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(result[f"param_{i}"], leaf, rtol=1e-5, atol=1e-5 * np.abs(leaf).max())
    for k in ref_history[0].keys() - {"compiles_so_far"}:
        np.testing.assert_allclose(result[f"metric_{k}"], ref_history[0][k], rtol=1e-5, atol=1e-7, err_msg=k)


# ------------------------------------------------------------------ sequence-level TIS / MIS, GSPO and CISPO


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("options", [dict(tis_cap=1.5), dict(mis_high=1.5), dict(mis_high=2.0, mis_low=0.7), {}])
def test_importance_weights_match_the_oracle(level, options):
    rng = np.random.default_rng(1)
    mask = np.arange(STEP_RESPONSE)[None, :] < rng.integers(0, STEP_RESPONSE + 1, (32, 1))
    mismatch = np.where(mask, rng.normal(0, 0.15, (32, STEP_RESPONSE)), 0.0).astype(np.float32)
    config = StepConfig(loss=LossConfig(budget=STEP_RESPONSE), tis_level=level, **options)
    weight, truncated, dropped = importance_weights(jnp.asarray(mismatch), config)
    expected = oracles.importance_oracle(mismatch, mask, level, **options)
    np.testing.assert_allclose(np.where(mask, weight, 1.0), expected, rtol=1e-5)
    if "mis_high" in options:
        assert 0 < (dropped & mask).sum() < mask.sum() and not truncated.any()
        np.testing.assert_array_equal(dropped & mask, (expected == 0) & mask)
    if "tis_cap" in options:
        assert 0 < (truncated & mask).sum() < mask.sum() and not dropped.any()


SEQUENCE_IS = [dict(tis_cap=1.5, tis_level="sequence"), dict(mis_high=1.6, mis_low=0.5, tis_level="sequence")]


@pytest.mark.parametrize("options", SEQUENCE_IS)
def test_sequence_importance_sampling_is_invariant_to_mesh_and_micro_batches(options):
    # old / behaviour = exp(0.05) per token: the sequence ratio exp(0.05 * length) leaves the band on long rows.
    shift = dict(behaviour_shift=-0.05, **options)
    ref_state, ref_history, _ = run_step((1, 1, 1), 1, "token_mean", **shift)
    state, history, _ = run_step((2, 2, 2), 4, "token_mean", **shift)
    assert_same(state.params, ref_state.params, "params")
    for k in ("loss", "tis_weight", "is_truncated", "is_dropped", "behaviour_kl"):
        np.testing.assert_allclose(history[0][k], ref_history[0][k], rtol=1e-5, atol=1e-7, err_msg=k)
    plain_state, plain_history, _ = run_step((1, 1, 1), 1, "token_mean")
    assert ref_history[0]["loss"] != plain_history[0]["loss"], "the correction changes the update"
    if "mis_high" in options:  # some responses leave the gradient, never all
        assert 0 < ref_history[0]["is_dropped"] < 1
    else:
        assert 0 < ref_history[0]["is_truncated"] < 1


@pytest.mark.parametrize("policy_loss, aggregation", [("gspo", "seq_mean_token_mean"),
                                                      ("gspo_token", "seq_mean_token_mean"), ("cispo", "token_mean")])
def test_new_policy_losses_are_invariant_to_mesh_and_micro_batches(policy_loss, aggregation):
    # Two optimizer steps, so the second one's ratios differ from 1 and the clip and weights act.
    options = dict(loss_options={"policy_loss": policy_loss}, steps=2)
    ref_state, ref_history, _ = run_step((1, 1, 1), 1, aggregation, **options)
    state, history, _ = run_step((2, 2, 2), 4, aggregation, **options)
    assert_same(state.params, ref_state.params, "params")
    for k in ("loss", "pg_loss", "clip_fraction", "grad_norm"):
        np.testing.assert_allclose(history[1][k], ref_history[1][k], rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize(
    "options, error, field",
    [
        (dict(tis_level="row"), FieldError, "StepConfig.tis_level"),
        (dict(mis_high=0.9), FieldError, "StepConfig.mis_high"),
        (dict(mis_high="2"), TypeError, "StepConfig.mis_high"),
        (dict(mis_high=2.0, mis_low=1.5), FieldError, "StepConfig.mis_low"),
        (dict(mis_low=0.5), FieldError, "StepConfig.mis_low"),
        (dict(mis_high=2.0, tis_cap=2.0), FieldError, "StepConfig.mis_high"),
    ],
)
def test_bad_importance_options_name_the_field(options, error, field):
    with pytest.raises(error) as info:
        StepConfig(loss=LossConfig(budget=4), **options)
    assert str(info.value).startswith(field) and "\n" not in str(info.value)
