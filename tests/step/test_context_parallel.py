"""Context parallelism (models/context_parallel.py): a mesh whose `context` axis splits every row's tokens gives one
device's old log-probs, loss, gradient and update, float32, for padded and packed rows, grouped-query attention,
sliding windows, attention sinks, a mixture of experts and LoRA adapters; and bfloat16 GEMMs within bfloat16's
rounding."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from drgrpo_jax.checkpoint import Checkpointer
from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models import attention
from drgrpo_jax.models.config import DecoderConfig, LoraSpec, RuntimeOptions
from drgrpo_jax.models.context_parallel import from_context_layout, to_context_layout, zigzag_order
from drgrpo_jax.models.lora import add_adapters
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.sharding import MeshShape, batch_sharding, make_mesh, param_shardings, place, shard_model
from drgrpo_jax.step.config import StepConfig
from drgrpo_jax.step.train_step import init_state, jit_policy_logprobs, jit_train_step, state_shardings

from support.tiny_step import STEP_RESPONSE, assert_same, make_step_batch

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
              head_dim=8, max_position_embeddings=64)
WINDOWED = dict(layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=5)
MODELS = {
    "llama": DecoderConfig(family="llama", **COMMON),  # grouped-query: 4 query heads over 2 kv heads
    "gemma3": DecoderConfig(family="gemma3", **COMMON, **WINDOWED, query_pre_attn_scalar=12,
                            activation="gelu_pytorch_tanh", tie_word_embeddings=True),
    "gpt_oss": DecoderConfig(family="gpt_oss", **COMMON, **WINDOWED, qkv_bias=True, o_bias=True, num_experts=4,
                             experts_per_token=2, moe_intermediate_size=8),  # sinks, windows and a mixture
    "qwen3_moe": DecoderConfig(family="qwen3_moe", **COMMON, num_experts=4, experts_per_token=2,
                               moe_intermediate_size=8),
}
PACKED = dict(pack_rows=16, pack_length=24)


def test_the_layout_gives_each_shard_an_early_and_a_late_chunk():
    assert zigzag_order(7, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]  # 7 tokens padded to 8: chunks 0, 3 | 1, 2
    x = np.arange(2 * 7).reshape(2, 7)
    laid_out = np.asarray(to_context_layout(x, 2, fill=-1))
    assert laid_out[0].tolist() == [0, 1, 6, -1, 2, 3, 4, 5]
    np.testing.assert_array_equal(from_context_layout(laid_out, 2, 7), x)


def _window(replay: bool):
    """The step tests' window; `replay`: with distinct random experts for every token and layer (router replay)."""
    batch = make_step_batch()
    if not replay:
        return batch
    rows, tokens = batch.prompt_ids.shape[0], batch.prompt_ids.shape[1] + batch.response_ids.shape[1]
    draws = np.random.default_rng(1).random((rows, tokens, MODELS["qwen3_moe"].num_layers, 4))
    return dataclasses.replace(batch, routed_experts=np.argsort(draws, axis=-1)[..., :2].astype(np.int32))


def _with_adapters(model: Transformer) -> Transformer:
    """`model` with rank-2 adapters on every projection, B random (a fresh B = 0 would hide a wrong layout)."""
    model = add_adapters(model, LoraSpec(rank=2, alpha=4.0), jax.random.key(1))
    for index, (name, variable) in enumerate(sorted(vars(model.blocks).items())):
        if name.endswith("_lora_b"):
            variable.set_value(0.1 * jax.random.normal(jax.random.key(100 + index), variable[...].shape))
    return model


def _stepper(family: str, mesh_shape: tuple[int, int, int, int], impl: str = "blockwise", remat: str = "none",
             replay: bool = False, lora: bool = False, compute_dtype: str | None = None, **step_options):
    """(initial state placed, its shardings, one(state) -> (old log-probs, metrics, state)): SGD steps of one window
    on a (data, fsdp, tensor, context) mesh, each recomputing its old log-probs there."""
    data, fsdp, tensor, context = mesh_shape
    mesh = make_mesh(MeshShape(data=data, fsdp=fsdp, tensor=tensor, context=context),
                     jax.devices()[:data * fsdp * tensor * context])
    runtime = RuntimeOptions(attention_impl=impl, remat=remat, compute_dtype=compute_dtype)
    model = Transformer(MODELS[family], rngs=nnx.Rngs(0), runtime=runtime)
    model = shard_model(_with_adapters(model) if lora else model, mesh)
    optimizer = optax.sgd(0.5)
    graphdef, state = init_state(model, optimizer, jax.random.key(0))
    config = StepConfig(loss=LossConfig(budget=STEP_RESPONSE), micro_batches=2, logprob_chunk=5, **step_options)
    params_shardings = param_shardings(state.params, mesh)
    frozen_shardings = None if state.frozen is None else param_shardings(state.frozen, mesh)
    shardings = state_shardings(state, params_shardings, mesh, frozen_shardings)
    step = jit_train_step(graphdef, optimizer, optax.constant_schedule(0.5), config, shardings, mesh)
    logprobs = jit_policy_logprobs(graphdef, config, params_shardings, mesh, frozen_shardings)
    batch = place(_window(replay), batch_sharding(mesh))

    def one(state):
        old = logprobs(state.params, batch) if state.frozen is None else logprobs(state.params, batch, state.frozen)
        state, metrics = step(state, dataclasses.replace(batch, old_logprobs=old, behaviour_logprobs=old + 0.1))
        return old, metrics, state

    return jax.device_put(state, shardings), shardings, one


def _run(family: str, mesh_shape: tuple[int, int, int, int], **options):
    """(old log-probs, metrics, params after one SGD update) of one window on a (data, fsdp, tensor, context) mesh."""
    state, _, one = _stepper(family, mesh_shape, **options)
    old, metrics, state = one(state)
    return jax.device_get((old, metrics, state.params))


def _assert_same_step(family, mesh_shape, **options):
    old, metrics, params = _run(family, mesh_shape, **options)
    want_old, want_metrics, want_params = _run(family, (1, 1, 1, 1), **options)
    real = make_step_batch().response_mask
    np.testing.assert_allclose(old[real], want_old[real], rtol=1e-5, atol=1e-5, err_msg="old log-probs")
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose(getattr(metrics, name), getattr(want_metrics, name), rtol=1e-5, err_msg=name)
    assert_same(params, want_params, "params after one update")


@pytest.mark.heavy  # a step compiled on two meshes
def test_a_context_split_step_with_bfloat16_gemms_stays_within_their_rounding():
    """bfloat16 GEMM operands (float32 accumulation): the split changes only the order of float32 sums, so the two
    meshes agree far more closely than bfloat16 rounds one value (2**-8), while both moved from float32's."""
    options = dict(compute_dtype="bfloat16")
    old, metrics, params = _run("llama", (1, 1, 1, 4), **options)
    want_old, want_metrics, want_params = _run("llama", (1, 1, 1, 1), **options)
    float32_old, _, _ = _run("llama", (1, 1, 1, 1))
    real = make_step_batch().response_mask
    np.testing.assert_allclose(old[real], want_old[real], rtol=2e-3, atol=2e-3, err_msg="old log-probs")
    assert np.abs(want_old[real] - float32_old[real]).max() > 1e-4  # the GEMMs did run in bfloat16
    for name in ("loss", "grad_norm"):
        np.testing.assert_allclose(getattr(metrics, name), getattr(want_metrics, name), rtol=2e-3, err_msg=name)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    """Blocks of 4 tokens: each shard's queries and the gathered keys span several blocks of the kernel."""
    monkeypatch.setattr(attention, "DEFAULT_BLOCK_SIZE", 4)


@pytest.mark.heavy  # a step compiled on two meshes per case
@pytest.mark.parametrize("family, mesh_shape, options", [
    ("llama", (1, 1, 1, 2), {}),
    ("llama", (2, 1, 1, 4), {}),
    ("llama", (1, 1, 1, 8), PACKED),
    ("llama", (2, 2, 1, 2), PACKED),
    ("llama", (1, 1, 2, 4), dict(remat="full")),
    ("llama", (1, 2, 1, 2), dict(remat="save_attention_out")),
    ("llama", (2, 1, 1, 2), dict(impl="reference")),
    ("gemma3", (1, 2, 1, 4), PACKED),
    ("gpt_oss", (1, 2, 2, 2), {}),
    ("qwen3_moe", (1, 2, 1, 4), PACKED),
    ("qwen3_moe", (2, 1, 1, 2), dict(replay=True)),
    ("qwen3_moe", (1, 1, 1, 4), dict(replay=True, **PACKED)),
    ("llama", (1, 2, 1, 2), dict(lora=True)),
    ("gemma3", (1, 1, 1, 4), dict(lora=True, **PACKED)),
])
def test_a_context_split_step_equals_one_device(family, mesh_shape, options):
    _assert_same_step(family, mesh_shape, **options)


@pytest.mark.parametrize("impl", ["cudnn", "splash"])
def test_kernels_that_take_a_whole_row_are_refused(impl):
    from drgrpo_jax.models.context_parallel import context_impl

    with pytest.raises(ValueError, match=f"^attention: {impl} cannot split a row over mesh.context > 1"):
        context_impl(impl, seq_len=256, dtype=np.float32, head_dim=8)
    assert context_impl("auto", seq_len=4096, dtype=np.float32, head_dim=8) == "blockwise"


@pytest.mark.heavy  # three meshes' steps compiled
def test_a_run_saved_at_context_2_resumes_at_context_4(tmp_path):
    """Parameters carry no context axis: a checkpoint saved on one context size restores onto another, and the
    run goes on as on one device."""
    state, _, one = _stepper("llama", (1, 1, 2, 2))
    _, _, state = one(state)
    saver = Checkpointer(tmp_path / "run", save_every=1, keep=1)
    saver.save(1, state, {"step": 1}, force=True)
    saver.close()
    fresh, _, resumed_step = _stepper("llama", (2, 1, 1, 4))
    resumed = Checkpointer(tmp_path / "run", save_every=1, keep=1).restore(1, fresh).state  # its shardings
    _, metrics, resumed = resumed_step(resumed)
    state, _, single = _stepper("llama", (1, 1, 1, 1))
    for _ in range(2):
        _, want_metrics, state = single(state)
    np.testing.assert_allclose(metrics.loss, want_metrics.loss, rtol=1e-5)
    assert_same(jax.device_get(resumed.params), jax.device_get(state.params), "params after the resumed step")
