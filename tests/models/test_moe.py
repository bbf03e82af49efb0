"""Qwen3-MoE: logits parity with transformers, HF folders in (per-expert and fused layouts) and out, the grouped
experts against a dense per-expert reference, and the same numbers on expert-sharded meshes, in the training step
and in the sampler."""

import dataclasses
import functools
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec as P

from drgrpo_jax.losses import LossConfig
from drgrpo_jax.models.config import DecoderConfig, LoraSpec, from_hf_config, to_hf_config
from drgrpo_jax.models.hf_io import read_safetensors, save_pretrained, write_safetensors
from drgrpo_jax.models.lora import adapter_arrays, add_adapters, merge_adapters
from drgrpo_jax.models.moe import grouped_experts, moe_mlp
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.sampler.batch import RowRequest, SamplingParams, make_batch
from drgrpo_jax.sampler.generate import generate
from drgrpo_jax.sharding import MeshShape, batch_sharding, make_mesh, param_shardings, place, shard_model
from drgrpo_jax.step.config import StepConfig
from drgrpo_jax.step.train_step import init_state, jit_train_step, state_shardings

from support.tiny_models import hf_logits, write_tiny_qwen3_moe
from support.tiny_step import STEP_RESPONSE, assert_same, make_step_batch

VOCAB = 96
TOL = 1e-4


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "raw_topk"])
def moe_pair(request, tmp_path_factory):
    """(transformers' Qwen3MoeForCausalLM, the folder it was saved to), routing weights renormalised or not."""
    folder = write_tiny_qwen3_moe(str(tmp_path_factory.mktemp("qwen3_moe")), norm_topk_prob=request.param)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval(), folder


def _ids(seed: int, shape) -> np.ndarray:
    return np.random.RandomState(seed).randint(3, VOCAB, shape)


def test_config_reads_the_experts_and_writes_them_back(moe_pair):
    model, _ = moe_pair
    config = from_hf_config(model.config.to_dict())
    assert (config.family, config.num_experts, config.experts_per_token, config.moe_intermediate_size) == (
        "qwen3_moe", 8, 2, 16)
    assert config.norm_topk_prob == model.config.norm_topk_prob and config.qk_norm
    assert from_hf_config(transformers.Qwen3MoeConfig(**to_hf_config(config)).to_dict()) == config


def test_logits_match_transformers(moe_pair):
    model, folder = moe_pair
    ours = from_pretrained(folder)
    ids = _ids(0, (2, 12))
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids))), hf_logits(model, ids), atol=TOL, rtol=0)
    # Left-padded rows: padding tokens are routed too (dropless), and change no real token's experts.
    lengths = np.array([10, 7, 3])
    real = np.arange(10)[None, :] >= (10 - lengths)[:, None]
    ids = np.where(real, _ids(1, (3, 10)), 0)
    positions = np.maximum(np.cumsum(real, axis=1) - 1, 0)
    ref = hf_logits(model, ids, attention_mask=real.astype(np.int64), position_ids=positions)
    got = np.asarray(ours(jnp.asarray(ids), jnp.asarray(positions, jnp.int32), jnp.asarray(real, jnp.int32)))
    np.testing.assert_allclose(got[real], ref[real], atol=TOL, rtol=0)


def _fuse_experts(src: str, dst: str, num_experts: int) -> None:
    """`src`'s folder rewritten in transformers' fused layout: experts.gate_up_proj [e, 2f, D], experts.down_proj."""
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    tensors = read_safetensors(os.path.join(src, "model.safetensors"))
    out = {k: v for k, v in tensors.items() if not re.search(r"\.experts\.\d+\.", k)}
    for prefix in sorted({k.split(".experts.")[0] for k in tensors if ".experts." in k}):
        def w(j, proj, prefix=prefix):
            return tensors[f"{prefix}.experts.{j}.{proj}.weight"]

        out[f"{prefix}.experts.gate_up_proj"] = np.stack(
            [np.concatenate([w(j, "gate_proj"), w(j, "up_proj")]) for j in range(num_experts)])
        out[f"{prefix}.experts.down_proj"] = np.stack([w(j, "down_proj") for j in range(num_experts)])
    write_safetensors(os.path.join(dst, "model.safetensors"), out)


def test_fused_layout_reads_the_same_model(moe_pair, tmp_path):
    model, folder = moe_pair
    fused = str(tmp_path / "fused")
    _fuse_experts(folder, fused, model.config.num_experts)
    ids = _ids(2, (2, 9))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(fused, attn_implementation="eager").eval()
    np.testing.assert_array_equal(hf_logits(reloaded, ids), hf_logits(model, ids))  # transformers' own layout
    np.testing.assert_allclose(np.asarray(from_pretrained(fused)(jnp.asarray(ids))), hf_logits(model, ids),
                               atol=TOL, rtol=0)


def test_saved_folder_loads_in_transformers_with_the_same_logits(moe_pair, tmp_path):
    model, folder = moe_pair
    save_pretrained(from_pretrained(folder), str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen3MoeForCausalLM"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    ids = _ids(3, (2, 11))
    np.testing.assert_allclose(hf_logits(reloaded, ids), hf_logits(model, ids), atol=1e-6, rtol=0)


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


@pytest.mark.heavy
@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (2, 2, 2), (1, 4, 2)])
def test_expert_sharded_logits_equal_one_device(moe_pair, mesh_shape):
    model, folder = moe_pair
    data, fsdp, tensor = mesh_shape
    mesh = make_mesh(MeshShape(data=data, fsdp=fsdp, tensor=tensor))
    sharded = from_pretrained(folder, mesh=mesh)
    gate = sharded.blocks.expert_gate[...]
    assert gate.sharding.spec == P(None, "fsdp", None, "tensor")  # each fsdp shard holds e / fsdp whole experts
    assert {s.data.shape[1] for s in gate.addressable_shards} == {8 // fsdp}
    ids = jax.device_put(jnp.asarray(_ids(4, (8, 10))), batch_sharding(mesh))
    graphdef, state = nnx.split(sharded)
    logits = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, ids)
    np.testing.assert_allclose(np.asarray(logits), hf_logits(model, np.asarray(ids)), atol=TOL, rtol=0)


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
        np.testing.assert_allclose(sharded_metrics["loss"], metrics["loss"], rtol=1e-5, atol=1e-7)


@pytest.mark.heavy
def test_greedy_generation_equals_transformers_greedy(moe_pair):
    """The KV-cache sampler (model.decode through the same sparse layers) against transformers' generate."""
    model, folder = moe_pair
    ours = from_pretrained(folder)
    prompts = [(1, 7, 12, 30, 4), (1, 22), (1, 40, 41, 9, 9, 9, 3, 17, 25)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    batch = make_batch([RowRequest(p, params, seed=0) for p in prompts], ours.config.eos_token_ids,
                       batch_size=4, prompt_len=16)
    out = jax.tree.map(np.asarray, generate(*nnx.split(ours), batch, max_new_tokens=12))
    for b, prompt in enumerate(prompts):
        with torch.inference_mode():
            full = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                  pad_token_id=0)
        assert out.tokens_BT[b, :out.lengths_B[b]].tolist() == full[0, len(prompt):].tolist()


def test_lora_on_attention_of_a_mixture_and_mlp_targets_refused(moe_pair):
    _, folder = moe_pair
    ours = from_pretrained(folder)
    ids = jnp.asarray(_ids(5, (2, 7)))
    before = np.asarray(ours(ids))
    with pytest.raises(ValueError, match="lora.targets: qwen3_moe has no gate_proj, up_proj, down_proj"):
        add_adapters(from_pretrained(folder), LoraSpec(rank=2), jax.random.key(0))
    adapted = add_adapters(ours, LoraSpec(rank=2, targets=("q_proj", "v_proj")), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(adapted(ids)), before)  # B = 0: a fresh adapter changes nothing
    adapters = adapter_arrays(nnx.state(adapted, nnx.LoRAParam))
    adapters["q_proj_lora_b"] = adapters["q_proj_lora_b"] + 0.1
    merged = merge_adapters(adapted, adapted.config.lora, adapters)
    assert not np.allclose(np.asarray(merged(ids)), before)  # the adapter reaches the sparse layers' input
