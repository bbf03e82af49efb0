"""Mixtral: logits parity with transformers, HF folders in (the Hub's per-expert layout and the fused one) and out;
and upcycling a dense Llama into one (models/upcycle.py): the same function at step 0, experts that diverge."""

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import transformers
from flax import nnx

from drgrpo_jax.models.config import DecoderConfig, from_hf_config, to_hf_config
from drgrpo_jax.models.hf_io import read_safetensors, save_pretrained, write_safetensors
from drgrpo_jax.models.kv_cache import init_cache
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.models.upcycle import main as upcycle_main
from drgrpo_jax.models.upcycle import upcycle

from support.tiny_models import hf_logits, write_tiny_llama, write_tiny_mixtral

VOCAB = 96
TOL = 1e-4


@pytest.fixture(scope="module", params=[None, 4], ids=["full", "sliding"])
def mixtral_pair(request, tmp_path_factory):
    """(transformers' MixtralForCausalLM, the folder it was saved to), without and with a sliding window."""
    folder = write_tiny_mixtral(str(tmp_path_factory.mktemp("mixtral")), sliding_window=request.param)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval(), folder


def _ids(seed: int, shape) -> np.ndarray:
    return np.random.RandomState(seed).randint(3, VOCAB, shape)


def test_config_reads_the_experts_and_writes_them_back(mixtral_pair):
    model, _ = mixtral_pair
    config = from_hf_config(model.config.to_dict())
    assert (config.family, config.num_experts, config.experts_per_token, config.moe_intermediate_size) == (
        "mixtral", 4, 2, 16)
    assert config.norm_topk_prob and not config.qk_norm and config.rope.theta == 1e6
    assert config.sliding_window == model.config.sliding_window
    assert from_hf_config(transformers.MixtralConfig(**to_hf_config(config)).to_dict()) == config


def test_logits_match_transformers(mixtral_pair):
    model, folder = mixtral_pair
    ours = from_pretrained(folder)
    ids = _ids(0, (2, 12))
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids))), hf_logits(model, ids), atol=TOL, rtol=0)


def test_fused_layout_reads_the_same_model(mixtral_pair, tmp_path):
    """transformers' own names (`mlp.gate`, `mlp.experts.gate_up_proj` [e, 2f, D], `mlp.experts.down_proj`)."""
    model, folder = mixtral_pair
    os.makedirs(tmp_path / "fused")
    shutil.copy(os.path.join(folder, "config.json"), tmp_path / "fused")
    tensors = read_safetensors(os.path.join(folder, "model.safetensors"))
    fused = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in tensors.items()
             if not re.search(r"experts\.\d", k)}
    for layer in range(model.config.num_hidden_layers):
        def w(j, proj, layer=layer):
            return tensors[f"model.layers.{layer}.block_sparse_moe.experts.{j}.{proj}.weight"]

        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([w(j, "w1"), w(j, "w3")]) for j in range(4)])
        fused[f"model.layers.{layer}.mlp.experts.down_proj"] = np.stack([w(j, "w2") for j in range(4)])
    write_safetensors(str(tmp_path / "fused" / "model.safetensors"), fused)
    ids = _ids(2, (2, 9))
    np.testing.assert_allclose(np.asarray(from_pretrained(str(tmp_path / "fused"))(jnp.asarray(ids))),
                               hf_logits(model, ids), atol=TOL, rtol=0)


def test_saved_folder_loads_in_transformers_with_the_same_logits(mixtral_pair, tmp_path):
    model, folder = mixtral_pair
    save_pretrained(from_pretrained(folder), str(tmp_path))
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["architectures"] == ["MixtralForCausalLM"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    ids = _ids(3, (2, 11))
    np.testing.assert_allclose(hf_logits(reloaded, ids), hf_logits(model, ids), atol=1e-6, rtol=0)


def test_attention_biases_are_refused_in_one_line():
    config = DecoderConfig(family="mixtral", num_experts=4, experts_per_token=2, moe_intermediate_size=8,
                           norm_topk_prob=True, qkv_bias=True, o_bias=True)
    with pytest.raises(ValueError, match="qkv_bias/o_bias/norm_topk_prob: Mixtral has no attention biases"):
        to_hf_config(config)


# ---------------------------------------------------------------- upcycling a dense Llama


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("llama")))


def test_upcycled_model_is_the_dense_function(llama_folder):
    dense = from_pretrained(llama_folder)
    mixture = upcycle(dense, num_experts=4, experts_per_token=2, seed=0, router_std=1.0)
    assert (mixture.config.family, mixture.config.num_experts, mixture.config.moe_intermediate_size) == (
        "mixtral", 4, dense.config.intermediate_size)
    ids = jnp.asarray(np.random.RandomState(0).randint(3, dense.config.vocab_size, (3, 10)))
    _, _, experts_BTLk = mixture.decode_routed(ids, *_cache_free(mixture, ids))
    assert len(np.unique(np.asarray(experts_BTLk))) == 4  # the router spreads tokens over every expert
    np.testing.assert_allclose(np.asarray(mixture(ids)), np.asarray(dense(ids)), atol=1e-5, rtol=0)


def _cache_free(model, ids):
    """decode_routed's (positions, cache) for a fresh forward of `ids`."""
    B, T = ids.shape
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), init_cache(model.config, B, T)


def test_router_that_breaks_symmetry_gives_each_expert_its_own_gradient(llama_folder):
    mixture = upcycle(from_pretrained(llama_folder), num_experts=4, experts_per_token=2, seed=1, router_std=1.0)
    ids = jnp.asarray(np.random.RandomState(1).randint(3, mixture.config.vocab_size, (4, 12)))

    def loss(model):
        return -jnp.mean(jax.nn.log_softmax(model(ids[:, :-1]))[
            jnp.arange(4)[:, None], jnp.arange(11)[None], ids[:, 1:]])

    grads = nnx.grad(loss)(mixture)
    for name in ("expert_gate", "expert_up", "expert_down"):
        g_LeXY = np.asarray(getattr(grads.blocks, name)[...])
        spread = np.abs(g_LeXY - g_LeXY[:, :1]).max(axis=(0, 2, 3))  # each expert against expert 0
        assert (spread[1:] > 1e-6).all(), (name, spread)
    optimizer = nnx.Optimizer(mixture, optax.sgd(0.1), wrt=nnx.Param)
    optimizer.update(mixture, grads)
    w_eXY = np.asarray(mixture.blocks.expert_gate[...][0])
    assert all(not np.allclose(w_eXY[0], w_eXY[j]) for j in range(1, 4))


def test_upcycle_cli_writes_a_folder_transformers_and_the_trainer_load(llama_folder, tmp_path):
    out = str(tmp_path / "mixture")
    upcycle_main([llama_folder, out, "--experts", "3", "--top-k", "2", "--seed", "2"])
    ours = from_pretrained(out)
    assert (ours.config.family, ours.config.num_experts, ours.config.experts_per_token) == ("mixtral", 3, 2)
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    ids = _ids(4, (2, 8)) % ours.config.vocab_size
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    dense = transformers.AutoModelForCausalLM.from_pretrained(llama_folder, attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(reloaded, ids), hf_logits(dense, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family, message", [("qwen3", "got qwen3"), ("llama_bias", "with attention biases")])
def test_upcycle_refuses_what_mixtral_cannot_hold(family, message):
    config = (DecoderConfig(family="qwen3", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                            num_heads=2, num_kv_heads=2, head_dim=8) if family == "qwen3" else
              DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                            num_kv_heads=2, head_dim=8, qkv_bias=True, o_bias=True))
    with pytest.raises(ValueError, match=f"upcycle: the source must be a dense Llama.*{message}"):
        upcycle(Transformer(config, rngs=nnx.Rngs(0)), 4, 2)
    with pytest.raises(ValueError, match=r"upcycle: --top-k must be in \[1, --experts=4\], got 5"):
        upcycle(Transformer(DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                                          num_heads=2, num_kv_heads=2, head_dim=8), rngs=nnx.Rngs(0)), 4, 5)
