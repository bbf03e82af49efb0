"""Mixtures of experts (Qwen3-MoE's shape): dense layers and bad expert fields refused, the grouped experts against
a dense per-expert reference, the training step on expert-sharded meshes, LoRA on a mixture. Each family's parity
with transformers is test_moe_families.py's."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import transformers
from flax import nnx

from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models.config import DecoderConfig, LoraSpec, from_hf_config
from drgrpo_jax.models.lora import adapter_arrays, add_adapters, merge_adapters
from drgrpo_jax.models.moe import grouped_experts, moe_mlp
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.sharding import MeshShape, batch_sharding, make_mesh, param_shardings, place, shard_model
from drgrpo_jax.step.config import StepConfig
from drgrpo_jax.step.train_step import init_state, jit_train_step, state_shardings

from support.tiny_models import write_tiny_qwen3_moe
from support.tiny_step import STEP_RESPONSE, assert_same, make_step_batch

VOCAB = 96


def _ids(seed: int, shape) -> np.ndarray:
    return np.random.RandomState(seed).randint(3, VOCAB, shape)


@pytest.mark.parametrize("field, value, dense", [("mlp_only_layers", [1], "[1]"), ("decoder_sparse_step", 2, "[0]")])
def test_dense_layers_in_a_mixture_are_refused_in_one_line(field, value, dense):
    hf = transformers.Qwen3MoeConfig(num_hidden_layers=2, **{field: value}).to_dict()
    with pytest.raises(ValueError, match=re.escape(f"mlp_only_layers/decoder_sparse_step: layers {dense} keep")):
        from_hf_config(hf)


def test_expert_fields_are_checked():
    base = dict(family="qwen3_moe", num_experts=4, experts_per_token=2, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="experts_per_token: 5 exceeds num_experts=4"):
        DecoderConfig(**{**base, "experts_per_token": 5})
    with pytest.raises(ValueError, match="moe_intermediate_size: must be a positive int"):
        DecoderConfig(**{**base, "moe_intermediate_size": 0})
    with pytest.raises(ValueError, match="num_experts: qwen3 has a dense MLP"):
        DecoderConfig(family="qwen3", num_experts=4)


# ---------------------------------------------------------------- grouped matmuls against the dense reference


def dense_experts(x_MD, weights_Mk, experts_Mk, gate_eDf, up_eDf, down_efD, activation):
    """Every expert on every token, masked by the routing weights: the oracle of `grouped_experts`."""
    share_Me = jnp.einsum("mk,mke->me", weights_Mk, jax.nn.one_hot(experts_Mk, gate_eDf.shape[0]))
    hidden_eMf = activation(jnp.einsum("md,edf->emf", x_MD, gate_eDf)) * jnp.einsum("md,edf->emf", x_MD, up_eDf)
    return jnp.einsum("emd,me->md", jnp.einsum("emf,efd->emd", hidden_eMf, down_efD), share_Me)


def silu_glu(gate, up):
    """Qwen3-MoE's expert nonlinearity: silu(gate) * up."""
    return jax.nn.silu(gate) * up


def _uneven_routing(M: int, e: int, k: int, rng) -> np.ndarray:
    """[M, k] distinct experts per token drawn with skewed odds: expert 0 takes most tokens, the last none."""
    odds = np.array([2.0 ** -i for i in range(e - 1)] + [0.0])
    return np.stack([rng.choice(e, k, replace=False, p=odds / odds.sum()) for _ in range(M)]).astype(np.int32)


def test_grouped_experts_equal_the_dense_reference_in_value_and_gradient():
    M, D, e, f, k = 40, 12, 6, 10, 2
    rng = np.random.default_rng(0)
    experts_Mk = _uneven_routing(M, e, k, rng)
    loads = np.bincount(experts_Mk.ravel(), minlength=e)
    assert loads[0] > 2 * M * k / e and loads[-1] == 0  # uneven, with an idle expert
    x_MD, weights_Mk = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((M, D), (M, k)))
    gate, up = (jnp.asarray(rng.normal(size=(e, D, f)) / np.sqrt(D), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(e, f, D)) / np.sqrt(f), jnp.float32)
    cotangent_MD = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)

    def loss(fn, nonlinearity, *args):
        return jnp.sum(fn(args[0], args[1], experts_Mk, *args[2:], nonlinearity) * cotangent_MD)

    args = (x_MD, weights_Mk, gate, up, down)
    grouped = jax.jit(jax.value_and_grad(functools.partial(loss, grouped_experts, silu_glu), argnums=range(5)))(*args)
    dense = jax.jit(jax.value_and_grad(functools.partial(loss, dense_experts, jax.nn.silu), argnums=range(5)))(*args)
    np.testing.assert_allclose(grouped[0], dense[0], rtol=1e-5)
    for name, g, d in zip(("x", "weights", "gate", "up", "down"), grouped[1], dense[1]):
        np.testing.assert_allclose(g, d, atol=1e-5, rtol=1e-5, err_msg=name)
    assert np.all(np.asarray(grouped[1][2])[-1] == 0)  # the idle expert takes no gradient


def test_routed_layer_equals_the_dense_reference_with_the_routers_gradient():
    """moe_mlp (top-k softmax routing, then grouped experts) against the same routing into the dense oracle,
    gradients through the router included; the router is biased so that the loads are uneven."""
    M, D, e, f, k = 32, 8, 4, 6, 2
    rng = np.random.default_rng(1)
    x_MD = jnp.asarray(rng.normal(size=(M, D)) + 1.0, jnp.float32)  # tokens share a direction the router favours
    p = {"router": jnp.asarray(rng.normal(size=(D, e)) / 2 + np.array([[0.3, 0.0, 0.0, -0.3]]), jnp.float32),
         "expert_gate": jnp.asarray(rng.normal(size=(e, D, f)), jnp.float32) / 3,
         "expert_up": jnp.asarray(rng.normal(size=(e, D, f)), jnp.float32) / 3,
         "expert_down": jnp.asarray(rng.normal(size=(e, f, D)), jnp.float32) / 3}

    def reference(x_MD, p):
        probs_Me = jax.nn.softmax(x_MD @ p["router"], axis=-1)
        weights_Mk, experts_Mk = jax.lax.top_k(probs_Me, k)
        weights_Mk = weights_Mk / weights_Mk.sum(-1, keepdims=True)
        return dense_experts(x_MD, weights_Mk, experts_Mk, p["expert_gate"], p["expert_up"], p["expert_down"],
                             jax.nn.silu)

    loads = np.bincount(np.asarray(jax.lax.top_k(x_MD @ p["router"], k)[1]).ravel(), minlength=e)
    assert loads.max() >= 2 * loads.min() + 8, loads  # uneven

    def loss(fn, x_MD, p):
        return jnp.sum(jnp.sin(fn(x_MD, p)))

    ours = jax.jit(jax.value_and_grad(functools.partial(loss, lambda x, p: moe_mlp(x, p, k, True, silu_glu)[0]),
                                      argnums=(0, 1)))(x_MD, p)
    oracle = jax.jit(jax.value_and_grad(functools.partial(loss, reference), argnums=(0, 1)))(x_MD, p)
    np.testing.assert_allclose(ours[0], oracle[0], rtol=1e-5)
    for g, d in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(oracle[1])):
        np.testing.assert_allclose(g, d, atol=1e-5, rtol=1e-5)
    assert np.abs(np.asarray(ours[1][1]["router"])).max() > 0


# ---------------------------------------------------------------- meshes, the training step, the sampler


MOE_CONFIG = DecoderConfig(family="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, num_experts=8,
                           experts_per_token=2, moe_intermediate_size=16, norm_topk_prob=True)


def _moe_step(mesh_shape):
    """(params after one SGD step, the step's metrics) of the in-memory MoE on a (data, fsdp, tensor) mesh."""
    data, fsdp, tensor = mesh_shape
    mesh = make_mesh(MeshShape(data=data, fsdp=fsdp, tensor=tensor), jax.devices()[:data * fsdp * tensor])
    graphdef, state = init_state(shard_model(Transformer(MOE_CONFIG, rngs=nnx.Rngs(0)), mesh), optax.sgd(0.5),
                                 jax.random.key(0))
    shardings = state_shardings(state, param_shardings(state.params, mesh), mesh)
    config = StepConfig(loss=LossConfig(budget=STEP_RESPONSE), micro_batches=2, logprob_chunk=5)
    step = jit_train_step(graphdef, optax.sgd(0.5), optax.constant_schedule(0.5), config, shardings, mesh)
    batch = make_step_batch()
    shift = np.random.default_rng(0).normal(scale=0.1, size=batch.old_logprobs.shape).astype(np.float32)
    batch = place(dataclasses.replace(batch, old_logprobs=shift - 4.0, behaviour_logprobs=shift - 4.0),
                  batch_sharding(mesh))
    state, metrics = step(jax.device_put(state, shardings), batch)
    return jax.device_get(state.params), jax.device_get(metrics)


@pytest.mark.heavy
def test_training_step_on_expert_sharded_meshes_equals_one_device():
    params, metrics = _moe_step((1, 1, 1))
    initial = nnx.split(Transformer(MOE_CONFIG, rngs=nnx.Rngs(0)), nnx.Param)[1]
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), params, initial)
    assert min(jax.tree.leaves(moved["blocks"]["expert_gate"])) > 0  # the experts took a gradient
    for mesh_shape in ((1, 8, 1), (2, 2, 2)):
        sharded_params, sharded_metrics = _moe_step(mesh_shape)
        assert_same(sharded_params, params, f"params after a step on {mesh_shape}")
        np.testing.assert_allclose(sharded_metrics.loss, metrics.loss, rtol=1e-5, atol=1e-7)


def test_lora_on_attention_of_a_mixture_and_mlp_targets_refused(tmp_path):
    folder = write_tiny_qwen3_moe(str(tmp_path))
    ours = from_pretrained(folder)
    ids = jnp.asarray(_ids(5, (2, 7)))
    before = np.asarray(ours(ids))
    with pytest.raises(ValueError, match="lora.targets: qwen3_moe has no gate_proj, up_proj, down_proj"):
        add_adapters(from_pretrained(folder), LoraSpec(rank=2), jax.random.key(0))
    adapted = add_adapters(ours, LoraSpec(rank=2, targets=("q_proj", "v_proj")), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(adapted(ids)), before)  # B = 0: a fresh adapter changes nothing
    adapters = adapter_arrays(nnx.state(adapted, nnx.LoRAParam))
    adapters["q_proj_lora_b"] = adapters["q_proj_lora_b"] + 0.1
    merged = merge_adapters(adapted, adapted.runtime.lora, adapters)
    assert not np.allclose(np.asarray(merged(ids)), before)  # the adapter reaches the sparse layers' input
