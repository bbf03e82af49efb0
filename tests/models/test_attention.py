"""Blockwise (flash-style) attention equals the reference attention: values and gradients, every mask, the models."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models import attention as attn
from drgrpo_jax.models.config import DecoderConfig, RuntimeOptions
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.sharding import MeshShape, batch_sharding, make_mesh, param_shardings, place, shard_model
from drgrpo_jax.step.batch import Batch
from drgrpo_jax.step.config import StepConfig
from drgrpo_jax.step.train_step import init_state, jit_train_step, state_shardings

from support.compiled import compiled_dots

F32_TOL = 1e-5
# bf16 inputs: both sides round probabilities to bf16 before the value product, at different points
# (per block against the running max vs once against the row max), so ~2^-8 relative on outputs.
BF16_TOL = 2e-2


def _layout(kind: str, B: int, T: int, rng: np.random.RandomState):
    """(positions, segment ids) [B, T] for a mask kind: causal, left padding, packed documents."""
    segments = np.ones((B, T), np.int32)
    if kind == "left_padded":  # rows padded at the start by different amounts; one row is all padding but 3
        for b, pad in enumerate([0, T // 3, T - 3, 1][:B]):
            segments[b, :pad] = 0
        segments[B - 1, -2:] = 0  # right padding too, as the trainer's responses
    elif kind == "packed":  # two or three documents per row, per-document positions, padding at the end
        for b in range(B):
            cuts = np.sort(rng.choice(np.arange(1, T - 2), size=2 + b % 2, replace=False))
            segments[b] = np.searchsorted(cuts, np.arange(T), side="right") + 1
            segments[b, T - 2 - b:] = 0
    positions = np.zeros((B, T), np.int32)
    for b in range(B):
        for t in range(1, T):
            same = segments[b, t] == segments[b, t - 1] and segments[b, t] != 0
            positions[b, t] = positions[b, t - 1] + 1 if same else 0
    return jnp.asarray(positions), jnp.asarray(segments)


def _inputs(B, T, C, R, H, dtype, seed=0):
    """Random queries [B, T, Q, H], keys and values [B, T, C, H], and an output projection."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, T, C * R, H), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (B, T, C, H), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (B, T, C, H), jnp.float32).astype(dtype)
    return q, k, v, jax.random.normal(keys[3], (B, T, C * R, H), jnp.float32)


def _both(q, k, v, positions, segments, projection, window, block_size, scale=0.3):
    """(output, grads of q, k, v) of the reference and of the blockwise kernel, padding queries dropped.

    The reference gives a query that sees nothing the mean of the values, the blockwise 0: the loss reads
    only queries that see something, as the model's does.
    """
    idx = jnp.arange(q.shape[1])
    mask = attn.self_attention_mask(segments, segments, idx, idx, positions, positions, window)
    seen = mask.any(-1)[:, :, None, None]

    def reference(q, k, v):
        return attn.reference_attention(q, k, v, mask, scale)

    def blockwise(q, k, v):
        return attn.blockwise_attention(q, k, v, positions, segments, scale=scale, window=window,
                                        block_size=block_size)

    cotangent = jnp.where(seen, projection, 0.0)

    @functools.partial(jax.jit, static_argnums=3)
    def run(q, k, v, fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, *vjp(cotangent.astype(out.dtype))

    return [run(q, k, v, fn) for fn in (reference, blockwise)], seen


def _assert_close(results, seen, tol):
    (ref, *ref_grads), (got, *got_grads) = results
    assert got.dtype == ref.dtype
    ref32, got32 = np.asarray(ref, np.float32), np.asarray(got, np.float32)
    seen = np.broadcast_to(np.asarray(seen), ref32.shape)
    np.testing.assert_allclose(got32[seen], ref32[seen], atol=tol * max(1.0, np.abs(ref32).max()), rtol=tol)
    assert np.all(got32[~seen] == 0), "a query that sees nothing gets 0"
    for name, r, g in zip("qkv", ref_grads, got_grads):
        assert g.dtype == r.dtype, name
        r, g = np.asarray(r, np.float32), np.asarray(g, np.float32)
        assert np.all(np.isfinite(g)), name
        np.testing.assert_allclose(g, r, atol=tol * max(1.0, np.abs(r).max()), rtol=tol, err_msg=f"d{name}")


CASES = {  # name: (mask kind, B, T, C, R, H, window, block)
    "causal_mha_one_block": ("causal", 2, 24, 2, 1, 8, None, 512),
    "causal_gqa_ragged_blocks": ("causal", 2, 50, 2, 3, 8, None, 16),  # 50 = 3 * 16 + 2
    "left_padded_gqa": ("left_padded", 4, 40, 2, 2, 8, None, 16),
    "packed_segments": ("packed", 3, 48, 1, 4, 8, None, 16),
    "window_inside_a_block": ("causal", 2, 48, 2, 2, 8, 5, 16),
    "window_across_blocks": ("left_padded", 4, 70, 2, 2, 8, 37, 16),
    "packed_window": ("packed", 3, 64, 2, 2, 16, 9, 16),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_blockwise_matches_reference_float32(case):
    kind, B, T, C, R, H, window, block = CASES[case]
    positions, segments = _layout(kind, B, T, np.random.RandomState(1))
    q, k, v, projection = _inputs(B, T, C, R, H, jnp.float32)
    results, seen = _both(q, k, v, positions, segments, projection, window, block)
    _assert_close(results, seen, F32_TOL)


@pytest.mark.parametrize("case", ["left_padded_gqa", "window_across_blocks", "packed_window"])
def test_blockwise_matches_reference_bfloat16(case):
    kind, B, T, C, R, H, window, block = CASES[case]
    positions, segments = _layout(kind, B, T, np.random.RandomState(2))
    q, k, v, projection = _inputs(B, T, C, R, H, jnp.bfloat16, seed=3)
    results, seen = _both(q, k, v, positions, segments, projection, window, block)
    _assert_close(results, seen, BF16_TOL)


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_mixed_precision_runs_every_gemm_in_bfloat16_with_float32_results(impl):
    """dtype=bfloat16 on float32 inputs (the mixed-precision step): outputs and gradients stay float32 and
    within bf16 rounding of the float32 oracle, and every GEMM of the compiled forward and backward takes
    bf16 operands into a float32 result (XLA's CPU upcasts a bf16 dot whose operand layout it cannot hand to
    YNNPACK into a float32 one, ~5x slower: gemm.row_major)."""
    kind, B, T, C, R, H, window, block = CASES["packed_window"]
    positions, segments = _layout(kind, B, T, np.random.RandomState(4))
    q, k, v, projection = _inputs(B, T, C, R, H, jnp.float32, seed=5)
    idx = jnp.arange(T)
    mask = attn.self_attention_mask(segments, segments, idx, idx, positions, positions, window)
    seen = mask.any(-1)[:, :, None, None]

    def run(dtype):
        if impl == "reference" or dtype is None:
            return lambda q, k, v: attn.reference_attention(q, k, v, mask, 0.3, dtype)
        return lambda q, k, v: attn.blockwise_attention(q, k, v, positions, segments, scale=0.3, window=window,
                                                        block_size=block, dtype=dtype)

    def vjp(fn):
        def out_and_grads(q, k, v):
            out, pull = jax.vjp(fn, q, k, v)
            return out, *pull(jnp.where(seen, projection, 0.0))
        return out_and_grads

    want, got = jax.jit(vjp(run(None)))(q, k, v), jax.jit(vjp(run(jnp.bfloat16)))(q, k, v)
    for name, w, g in zip(("out", "dq", "dk", "dv"), want, got):
        assert g.dtype == jnp.float32, name
        w, g = np.asarray(w), np.asarray(g)
        if name == "out":  # padding queries: the reference's mean of the values, the blockwise kernel's 0
            keep = np.broadcast_to(np.asarray(seen), w.shape)
            w, g = w[keep], g[keep]
        np.testing.assert_allclose(g, w, atol=BF16_TOL * max(1.0, np.abs(w).max()), rtol=BF16_TOL, err_msg=name)
    dots = compiled_dots(jax.jit(vjp(run(jnp.bfloat16))).lower(q, k, v).compile().as_text())
    assert len(dots) >= 6 and set(dots) == {("f32", "bf16", "bf16")}, dots  # QK^T, PV and their 4 gradients


@pytest.mark.parametrize("case", ["left_padded_gqa", "window_across_blocks", "packed_window"])
def test_blockwise_with_sinks_matches_reference_in_value_and_gradient(case):
    """Attention sinks (GPT-OSS): one logit per query head in every softmax's denominator; the blockwise kernel
    and its custom backward (the sinks' own gradient included) against the float32 reference."""
    kind, B, T, C, R, H, window, block = CASES[case]
    positions, segments = _layout(kind, B, T, np.random.RandomState(7))
    q, k, v, projection = _inputs(B, T, C, R, H, jnp.float32, seed=8)
    sinks_Q = jnp.asarray(np.random.RandomState(9).normal(scale=2.0, size=C * R), jnp.float32)
    idx = jnp.arange(T)
    mask = attn.self_attention_mask(segments, segments, idx, idx, positions, positions, window)
    seen = np.broadcast_to(np.asarray(mask.any(-1))[:, :, None, None], q.shape)
    cotangent = jnp.where(jnp.asarray(seen), projection, 0.0)

    def out_and_grads(fn):
        out, pull = jax.vjp(fn, q, k, v, sinks_Q)
        return out, *pull(cotangent)

    want = jax.jit(lambda: out_and_grads(
        lambda q, k, v, s: attn.reference_attention(q, k, v, mask, 0.3, sinks_Q=s)))()
    got = jax.jit(lambda: out_and_grads(lambda q, k, v, s: attn.blockwise_attention(
        q, k, v, positions, segments, scale=0.3, window=window, block_size=block, sinks_Q=s)))()
    plain = np.asarray(attn.reference_attention(q, k, v, mask, 0.3))
    assert np.abs(np.asarray(want[0]) - plain)[seen].min() > 0  # every seen query's output moved by its sink
    for name, w, g in zip(("out", "dq", "dk", "dv", "dsinks"), want, got):
        w, g = np.asarray(w), np.asarray(g)
        np.testing.assert_allclose(g, w, atol=F32_TOL * max(1.0, np.abs(w).max()), rtol=F32_TOL, err_msg=name)
    assert np.abs(np.asarray(got[4])).min() > 0  # every head's sink takes a gradient


def test_accelerator_kernels_refuse_sinks_and_auto_avoids_them():
    choose = attn.choose_impl
    for impl in ("cudnn", "splash"):
        with pytest.raises(ValueError, match=f"attention: {impl} has no attention sinks"):
            choose(impl, seq_len=4096, dtype=jnp.bfloat16, head_dim=64, sinks=True)
    assert choose("auto", seq_len=4096, dtype=jnp.bfloat16, head_dim=64, backend="gpu", sinks=True) == "blockwise"
    assert choose("auto", seq_len=4096, dtype=jnp.bfloat16, head_dim=64, backend="tpu", sinks=True) == "blockwise"


def test_a_query_that_sees_nothing_passes_no_gradient():
    B, T = 2, 20
    positions, segments = _layout("left_padded", B, T, np.random.RandomState(0))
    q, k, v, _ = _inputs(B, T, 1, 2, 8, jnp.float32)
    pad = np.asarray(segments == 0)

    def loss(q, k, v):  # reads only padding queries
        out = attn.blockwise_attention(q, k, v, positions, segments, scale=0.5, block_size=8)
        return jnp.sum(jnp.where(jnp.asarray(pad)[:, :, None, None], out, 0.0))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)  # one program (eagerly, ~45)
    assert pad.any() and all(np.all(np.asarray(g) == 0) for g in grads)


def test_memory_is_linear_in_length():
    """Compiled forward+backward temporaries: the reference's grow as S^2, the blockwise kernel's as S."""
    C, R, H = 3, 3, 64  # SmolLM2-135M's heads

    def temp_bytes(impl: str, S: int) -> int:
        q = jax.ShapeDtypeStruct((1, S, C * R, H), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, S, C, H), jnp.float32)
        ids = jax.ShapeDtypeStruct((1, S), jnp.int32)

        def loss(q, k, v, positions, segments):
            return jnp.sum(attn.attention(q, k, v, positions, segments, scale=0.125, impl=impl) ** 2)

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return grad.lower(q, kv, kv, ids, ids).compile().memory_analysis().temp_size_in_bytes

    def scores_bytes(S: int) -> int:  # one layer's [B, Q, S, S] float32 scores, B = 1
        return C * R * S * S * 4

    assert temp_bytes("reference", 2048) > scores_bytes(2048)  # what the analysis sees in the quadratic program
    small, large = temp_bytes("blockwise", 2048), temp_bytes("blockwise", 4096)
    assert large < scores_bytes(4096) / 4, (large, scores_bytes(4096))
    assert large < 2.5 * small, (small, large)  # linear: twice the length, about twice the memory


# ---------------------------------------------------------------- dispatch


def test_auto_on_cpu_picks_reference_for_short_and_blockwise_for_long():
    choose = attn.choose_impl
    assert jax.default_backend() == "cpu"
    assert choose("auto", seq_len=128, dtype=jnp.float32, head_dim=64) == "reference"
    assert choose("auto", seq_len=attn.BLOCKWISE_MIN_LENGTH, dtype=jnp.float32, head_dim=64) == "blockwise"
    assert choose("reference", seq_len=8192, dtype=jnp.float32, head_dim=64) == "reference"
    assert choose("blockwise", seq_len=8, dtype=jnp.float32, head_dim=64) == "blockwise"


def test_mixed_precision_hands_the_gpu_kernel_16_bit_operands(monkeypatch):
    """float32 activations under bfloat16 compute (the GPU default): `auto` picks cuDNN by the compute dtype and
    gives it bf16 q, k, v; the output comes back float32 (the kernel itself is replaced: this machine has no GPU)."""
    seen = []

    def fake_cudnn(q, k, v, positions, segments, *, scale, window):
        seen.append((q.dtype, k.dtype, v.dtype))
        return q

    monkeypatch.setattr(attn.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(attn, "cudnn_attention", fake_cudnn)
    B, T, C, R, H = 1, 256, 2, 2, 16
    q, k, v = (jnp.ones(shape, jnp.float32) for shape in ((B, T, C * R, H), (B, T, C, H), (B, T, C, H)))
    positions, segments = jnp.arange(T)[None], jnp.ones((B, T), jnp.int32)
    out = attn.attention(q, k, v, positions, segments, scale=0.25, dtype=jnp.bfloat16)
    assert seen == [(jnp.bfloat16,) * 3] and out.dtype == jnp.float32
    # and so does the model: float32 weights and activations, bf16 compute (the trainer's mixed precision), T odd
    model = Transformer(_family_config("llama"), rngs=nnx.Rngs(0), runtime=RuntimeOptions(compute_dtype="bfloat16"))
    ids = jnp.zeros((1, 29), jnp.int32)
    model(ids, jnp.arange(29)[None], jnp.ones((1, 29), jnp.int32))
    assert seen[1:] == [(jnp.bfloat16,) * 3]  # traced once: the layers are one scanned block


def test_auto_per_backend_and_explicit_kernels_check_their_constraints():
    choose = attn.choose_impl
    assert choose("auto", seq_len=4096, dtype=jnp.bfloat16, head_dim=64, backend="gpu") == "cudnn"
    assert choose("auto", seq_len=4096, dtype=jnp.float32, head_dim=64, backend="gpu") == "blockwise"
    assert choose("auto", seq_len=4095, dtype=jnp.bfloat16, head_dim=64, backend="gpu") == "cudnn"  # pads to even
    assert choose("auto", seq_len=4096, dtype=jnp.bfloat16, head_dim=60, backend="gpu") == "blockwise"
    assert choose("auto", seq_len=4096, dtype=jnp.bfloat16, head_dim=64, backend="tpu") == "splash"
    assert choose("auto", seq_len=4000, dtype=jnp.bfloat16, head_dim=64, backend="tpu") == "blockwise"
    with pytest.raises(ValueError, match="cudnn"):
        choose("cudnn", seq_len=4096, dtype=jnp.float32, head_dim=64)
    with pytest.raises(ValueError, match="splash"):
        choose("splash", seq_len=100, dtype=jnp.bfloat16, head_dim=64)
    with pytest.raises(ValueError, match="attention"):
        choose("flash", seq_len=100, dtype=jnp.bfloat16, head_dim=64)
    with pytest.raises(ValueError, match="attention_impl"):
        RuntimeOptions(attention_impl="flash")


@pytest.mark.heavy  # compiles the interpreted Pallas kernel
def test_splash_interpreted_on_cpu_matches_reference():
    """The TPU path's mask and layout, run through Pallas' interpreter (no TPU here: values only)."""
    B, T, C, R, H = 1, 256, 2, 2, 128
    positions, segments = _layout("packed", B, T, np.random.RandomState(4))
    q, k, v, _ = _inputs(B, T, C, R, H, jnp.float32, seed=5)
    idx = jnp.arange(T)
    for window in (None, 40):
        mask = attn.self_attention_mask(segments, segments, idx, idx, positions, positions, window)
        want = attn.reference_attention(q, k, v, mask, 0.1)
        got = attn.splash_attention(q, k, v, positions, segments, scale=0.1, window=window, interpret=True)
        seen = np.asarray(mask.any(-1))
        np.testing.assert_allclose(np.asarray(got)[seen], np.asarray(want)[seen], atol=1e-4)


# ---------------------------------------------------------------- the models


def _family_config(family: str) -> DecoderConfig:
    """A tiny random config with each family's distinctive attention features (GQA, q/k norm, Gemma's windows)."""
    common = dict(family=family, vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8)
    if family == "gemma3":
        return DecoderConfig(**common, layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                             sliding_window=5, query_pre_attn_scalar=12, activation="gelu_pytorch_tanh",
                             tie_word_embeddings=True)
    if family == "gpt_oss":  # sinks, windows, biases and experts
        return DecoderConfig(**common, layer_types=("sliding_attention", "full_attention", "sliding_attention"),
                             sliding_window=5, qkv_bias=True, o_bias=True, num_experts=4, experts_per_token=2,
                             moe_intermediate_size=8)
    return DecoderConfig(**common, qkv_bias=family == "qwen2")


@pytest.mark.heavy  # builds and compiles four model families
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3", "gpt_oss"])
def test_model_forward_and_gradients_blockwise_equal_reference(family, monkeypatch):
    monkeypatch.setattr(attn, "DEFAULT_BLOCK_SIZE", 8)  # cut T = 30 into ragged blocks
    B, T = 3, 30
    positions, segments = _layout("packed" if family != "llama" else "left_padded", B, T, np.random.RandomState(6))
    ids = jnp.asarray(np.random.RandomState(7).randint(0, 64, (B, T)))
    seen = np.asarray(segments != 0)
    outputs = []
    for impl in ("reference", "blockwise"):
        # Gemma's and GPT-OSS's blockwise side also rematerialises: the layer-kind cond (and the sinks' custom
        # backward) inside a checkpointed scan body.
        remat = "full" if impl == "blockwise" and family in ("gemma3", "gpt_oss") else "none"
        runtime = RuntimeOptions(remat=remat, attention_impl=impl)
        graphdef, state = nnx.split(Transformer(_family_config(family), rngs=nnx.Rngs(0), runtime=runtime))
        if family == "gpt_oss":  # sinks as large as a trained model's, not the init's 0.02
            state["blocks"]["sinks"].set_value(state["blocks"]["sinks"][...] * 100)

        def loss(state, graphdef=graphdef):
            logits = nnx.merge(graphdef, state)(ids, positions, segments)
            logp = jnp.where(jnp.asarray(seen)[:, :, None], jax.nn.log_softmax(logits), 0.0)
            return jnp.sum(logp) / seen.sum(), logits

        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
        outputs.append((np.asarray(logits), grads))
    (ref_logits, ref_grads), (got_logits, got_grads) = outputs
    np.testing.assert_allclose(got_logits[seen], ref_logits[seen], atol=1e-5, rtol=1e-5)
    for r, g in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(got_grads)):
        np.testing.assert_allclose(g, r, atol=1e-5 * max(1.0, np.abs(r).max()), rtol=1e-4)


@pytest.mark.heavy  # compiles the sharded train step
def test_train_step_blockwise_equals_reference(monkeypatch):
    """One Dr.GRPO step of the tiny model (left-padded prompts, right-padded responses) on 2 devices."""
    monkeypatch.setattr(attn, "DEFAULT_BLOCK_SIZE", 8)
    N, U, T = 4, 6, 12
    rng = np.random.default_rng(0)
    prompt_mask = np.arange(U)[None, :] >= U - np.array([6, 3, 1, 4])[:, None]
    response_mask = np.arange(T)[None, :] < np.array([12, 7, 1, 0])[:, None]
    batch = Batch(prompt_ids=np.where(prompt_mask, rng.integers(0, 64, (N, U)), 0).astype(np.int32),
                  prompt_mask=prompt_mask,
                  response_ids=np.where(response_mask, rng.integers(0, 64, (N, T)), 0).astype(np.int32),
                  response_mask=response_mask, advantages=rng.normal(size=N).astype(np.float32),
                  old_logprobs=np.full((N, T), -4.0, np.float32), behaviour_logprobs=np.full((N, T), -4.0, np.float32),
                  row_valid=np.ones(N, bool))
    mesh = make_mesh(MeshShape(data=2, fsdp=1, tensor=1), jax.devices()[:2])
    config = StepConfig(loss=LossConfig(budget=T), logprob_chunk=5)
    results = []
    for impl in ("reference", "blockwise"):
        model = shard_model(Transformer(dataclasses.replace(_family_config("llama"), num_layers=2),
                                        rngs=nnx.Rngs(0), runtime=RuntimeOptions(attention_impl=impl)), mesh)
        optimizer = optax.sgd(1.0)
        graphdef, state = init_state(model, optimizer, jax.random.key(0))
        shardings = state_shardings(state, param_shardings(state.params, mesh), mesh)
        state = jax.device_put(state, shardings)
        step = jit_train_step(graphdef, optimizer, optax.constant_schedule(1.0), config, shardings, mesh)
        state, metrics = step(state, place(batch, batch_sharding(mesh)))
        results.append((jax.device_get(state.params), jax.device_get(metrics)))
    (ref_params, ref_metrics), (got_params, got_metrics) = results
    assert ref_metrics.grad_norm > 0
    np.testing.assert_allclose(got_metrics.loss, ref_metrics.loss, rtol=1e-5)
    np.testing.assert_allclose(got_metrics.grad_norm, ref_metrics.grad_norm, rtol=1e-4)
    for r, g in zip(jax.tree.leaves(ref_params), jax.tree.leaves(got_params)):
        np.testing.assert_allclose(g, r, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- on a GPU (-m gpu: scripts/gpu_check.sh)

needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: scripts/gpu_check.sh runs these")

GPU_CASES = {  # name: (mask kind, B, T, C, R, H, window): cuDNN's head dims (H % 8 == 0)
    "causal_gqa": ("causal", 2, 256, 3, 3, 64, None),  # SmolLM2-135M's heads
    "left_padded_odd_length": ("left_padded", 4, 199, 2, 2, 64, None),  # the trainer's U + T - 1
    "packed_segments": ("packed", 3, 256, 1, 4, 64, None),
    "window": ("left_padded", 4, 320, 2, 2, 64, 37),
    "packed_window": ("packed", 3, 256, 2, 2, 128, 50),
}


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("impl", ["cudnn", "blockwise"])
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_kernels_match_the_float32_reference(case, impl):
    """bf16 q, k, v through cuDNN flash attention and through our blockwise kernel, on the GPU: the outputs of
    queries that see something and the gradients of q, k, v, against the reference in float32 on the same values."""
    kind, B, T, C, R, H, window = GPU_CASES[case]
    positions, segments = _layout(kind, B, T, np.random.RandomState(8))
    q, k, v, projection = _inputs(B, T, C, R, H, jnp.bfloat16, seed=9)
    idx = jnp.arange(T)
    mask = attn.self_attention_mask(segments, segments, idx, idx, positions, positions, window)
    seen = mask.any(-1)[:, :, None, None]
    kernel = attn.cudnn_attention if impl == "cudnn" else attn.blockwise_attention

    def got(q, k, v):
        return kernel(q, k, v, positions, segments, scale=0.3, window=window)

    def want(q, k, v):
        return attn.reference_attention(q, k, v, mask, 0.3)

    def out_and_grads(fn, q, k, v):
        out, pull = jax.vjp(fn, q, k, v)
        return out, *pull(jnp.where(seen, projection, 0.0).astype(out.dtype))

    expected = jax.jit(functools.partial(out_and_grads, want))(*(x.astype(jnp.float32) for x in (q, k, v)))
    results = jax.jit(functools.partial(out_and_grads, got))(q, k, v)
    keep = np.broadcast_to(np.asarray(seen), expected[0].shape)
    for name, w, g in zip(("out", "dq", "dk", "dv"), expected, results):
        assert g.dtype == jnp.bfloat16, name
        w, g = np.asarray(w, np.float32), np.asarray(g, np.float32)
        if name == "out":  # a query that sees nothing: the reference's mean of the values, the kernels' own value
            w, g = w[keep], g[keep]
        assert np.all(np.isfinite(g)), name
        np.testing.assert_allclose(g, w, atol=BF16_TOL * max(1.0, np.abs(w).max()), rtol=BF16_TOL, err_msg=name)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_auto_on_a_gpu_runs_cudnn_in_the_model_within_bf16_of_the_reference(family):
    """`attention_impl: auto` under bfloat16 compute picks cuDNN on a GPU (its forward and backward custom calls
    are in the program), and the model's logits and gradients stay within bf16 rounding of the float32 reference
    (Gemma 3: sliding windows and packed segments; Llama: left padding)."""
    B, T = 3, 30
    positions, segments = _layout("packed" if family == "gemma3" else "left_padded", B, T, np.random.RandomState(6))
    ids = jnp.asarray(np.random.RandomState(7).randint(0, 64, (B, T)))
    seen = np.asarray(segments != 0)
    outputs = []
    for impl, compute in (("reference", None), ("auto", "bfloat16")):
        runtime = RuntimeOptions(attention_impl=impl, compute_dtype=compute)
        graphdef, state = nnx.split(Transformer(_family_config(family), rngs=nnx.Rngs(0), runtime=runtime))

        def loss(state, graphdef=graphdef):
            logits = nnx.merge(graphdef, state)(ids, positions, segments)
            logp = jnp.where(jnp.asarray(seen)[:, :, None], jax.nn.log_softmax(logits), 0.0)
            return jnp.sum(logp) / seen.sum(), logits

        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        if impl == "auto":
            program = step.lower(state).as_text()
            assert "__cudnn$fmha" in program and "Backward" in program, "auto did not pick cuDNN"
        (_, logits), grads = step(state)
        outputs.append((np.asarray(logits, np.float32), grads))
    (ref_logits, ref_grads), (got_logits, got_grads) = outputs
    np.testing.assert_allclose(got_logits[seen], ref_logits[seen], atol=BF16_TOL * np.abs(ref_logits).max())
    for r, g in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(got_grads)):
        r, g = np.asarray(r, np.float32), np.asarray(g, np.float32)
        assert np.linalg.norm(g - r) <= 3e-2 * np.linalg.norm(r) + 1e-6, (np.linalg.norm(g - r), np.linalg.norm(r))

