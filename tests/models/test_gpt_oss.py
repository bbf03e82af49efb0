"""GPT-OSS: YaRN frequencies, MXFP4 experts, quantised experts refused, and the grouped experts with biases and
clamp against a dense per-expert reference. Its parity with transformers (sinks, alternating sliding/full
attention, a biased router, clamped SwiGLU experts with biases) is test_moe_families.py's."""

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from drgrpo_jax.models import mxfp4
from drgrpo_jax.models.config import RopeConfig, from_hf_config
from drgrpo_jax.models.hf_io import read_safetensors, save_pretrained
from drgrpo_jax.models.moe import clamped_swiglu, moe_mlp
from drgrpo_jax.models.params import param_specs
from drgrpo_jax.models.pretrained import from_pretrained

from support.tiny_models import hf_logits, write_tiny_gpt_oss

VOCAB = 96
TOL = 1e-4


def _ids(seed: int, shape) -> np.ndarray:
    return np.random.RandomState(seed).randint(3, VOCAB, shape)


@pytest.mark.parametrize("params", [
    {"factor": 4.0, "original_max_position_embeddings": 16, "truncate": False},  # GPT-OSS's own form
    {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0, "beta_slow": 2.0},  # truncated
    {"factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.9, "mscale_all_dim": 0.5},
    {"factor": 8.0, "original_max_position_embeddings": 64, "attention_factor": 1.3},
], ids=["untruncated", "truncated", "mscale", "attention_factor"])
def test_yarn_frequencies_and_scaling_equal_transformers(params):
    hf = transformers.GptOssConfig(head_dim=64, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                                                 **params})
    want_inv, want_scaling = ROPE_INIT_FUNCTIONS["yarn"](hf)
    rope = from_hf_config(hf.to_dict()).rope
    np.testing.assert_allclose(rope.inv_freq(64), want_inv.numpy(), rtol=1e-6)
    assert rope.attention_scaling == pytest.approx(want_scaling, rel=1e-6) and want_scaling != 1.0
    assert rope.inv_freq(64).tolist() != RopeConfig(theta=150000.0).inv_freq(64).tolist()


def test_yarn_without_its_original_context_falls_back_as_transformers_does():
    """A dense family's YaRN scaling with no original_max_position_embeddings: transformers takes the config's
    max_position_embeddings."""
    hf = transformers.LlamaConfig(head_dim=32, num_attention_heads=4, hidden_size=128, max_position_embeddings=512,
                                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    raw = {**hf.to_dict(), "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}
    rope = from_hf_config(raw).rope
    want_inv, want_scaling = ROPE_INIT_FUNCTIONS["yarn"](hf)
    assert rope.original_max_position_embeddings == 512
    np.testing.assert_allclose(rope.inv_freq(32), want_inv.numpy(), rtol=1e-6)
    assert rope.attention_scaling == pytest.approx(want_scaling, rel=1e-6)


def test_experts_quantised_other_than_mxfp4_are_refused_in_one_line():
    hf = {**transformers.GptOssConfig().to_dict(), "quantization_config": {"quant_method": "bitsandbytes"}}
    with pytest.raises(ValueError, match=re.escape("quantization_config: bitsandbytes experts are not supported")):
        from_hf_config(hf)


@pytest.fixture(scope="module")
def mxfp4_pair(tmp_path_factory):
    """(transformers' model with the experts an MXFP4 checkpoint holds, dequantized by transformers' own
    converter, and that checkpoint: the published layout, `_blocks` and `_scales` beside unquantized biases)."""
    from safetensors.numpy import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dense = write_tiny_gpt_oss(str(tmp_path_factory.mktemp("dense")), intermediate_size=32)  # X % 32 == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(dense, attn_implementation="eager").eval()
    rng, tensors = np.random.default_rng(0), {}
    for name, w in read_safetensors(os.path.join(dense, "model.safetensors")).items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = w
            continue
        experts, x, y = w.shape
        blocks = rng.integers(0, 256, (experts, y, x // 32, 16), dtype=np.uint8)
        scales = rng.integers(121, 125, (experts, y, x // 32), dtype=np.uint8)  # 2^-6..2^-3: weights below 0.75
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        with torch.no_grad():
            model.get_parameter(name).copy_(convert_moe_packed_tensors(
                torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32))
    folder = tmp_path_factory.mktemp("mxfp4")
    save_file(tensors, str(folder / "model.safetensors"))
    config = {**json.load(open(os.path.join(dense, "config.json"))), "quantization_config": {"quant_method": "mxfp4"}}
    (folder / "config.json").write_text(json.dumps(config))
    return model, str(folder)


def test_mxfp4_experts_dequantize_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (3, 8, 2, 16), dtype=np.uint8)  # every one of the 16 values, both nibbles
    scales = rng.integers(100, 150, (3, 8, 2), dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(mxfp4.dequantize(blocks, scales), want.numpy())
    with pytest.raises(ValueError, match=r"mxfp4: blocks uint8\[3, 8, 2, 16\] and scales uint8\[3, 8\]"):
        mxfp4.dequantize(blocks, scales[..., 0])


def test_an_mxfp4_checkpoint_loads_with_transformers_logits_and_saves_unquantized(mxfp4_pair, tmp_path):
    model, folder = mxfp4_pair
    ids = _ids(5, (2, 19))
    ours = from_pretrained(folder)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids))), hf_logits(model, ids), atol=TOL, rtol=0)
    save_pretrained(ours, str(tmp_path))  # what the trainer pushes and publishes: plain float experts
    assert "quantization_config" not in json.load(open(tmp_path / "config.json"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    np.testing.assert_allclose(hf_logits(reloaded, ids), hf_logits(model, ids), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- grouped matmuls against the dense reference


def dense_gpt_oss_mlp(x_MD, p, k, alpha, limit):
    """Every expert on every token, as transformers' GptOssMLP writes it (router logits plus bias, top k, softmax
    over them; gate and up with biases, clamped SwiGLU, down with its bias), masked by the routing weights."""
    logits_Me = x_MD @ p["router"] + p["router_bias"][None]
    top_Mk, experts_Mk = jax.lax.top_k(logits_Me, k)
    share_Me = jnp.einsum("mk,mke->me", jax.nn.softmax(top_Mk, axis=-1), jax.nn.one_hot(experts_Mk, logits_Me.shape[1]))
    gate_eMf = jnp.einsum("md,edf->emf", x_MD, p["expert_gate"]) + p["expert_gate_bias"][:, None]
    up_eMf = jnp.einsum("md,edf->emf", x_MD, p["expert_up"]) + p["expert_up_bias"][:, None]
    gate_eMf = jnp.minimum(gate_eMf, limit)
    hidden_eMf = (jnp.clip(up_eMf, -limit, limit) + 1) * gate_eMf * jax.nn.sigmoid(alpha * gate_eMf)
    out_eMD = jnp.einsum("emf,efd->emd", hidden_eMf, p["expert_down"]) + p["expert_down_bias"][:, None]
    return jnp.einsum("emd,me->md", out_eMD, share_Me)


def test_grouped_experts_with_biases_and_clamp_equal_the_dense_reference_in_value_and_gradient():
    M, D, e, f, k, alpha, limit = 48, 8, 5, 6, 2, 1.702, 2.0
    rng = np.random.default_rng(3)

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.normal(scale=scale, size=shape), jnp.float32)

    x_MD = normal(M, D) + 0.5
    p = {"router": normal(D, e, scale=0.5), "router_bias": jnp.asarray([0.8, 0.3, 0.0, -0.3, -3.0], jnp.float32),
         "expert_gate": normal(e, D, f), "expert_up": normal(e, D, f), "expert_down": normal(e, f, D, scale=0.3),
         "expert_gate_bias": normal(e, f), "expert_up_bias": normal(e, f), "expert_down_bias": normal(e, D)}
    experts_Mk = np.asarray(jax.lax.top_k(x_MD @ p["router"] + p["router_bias"][None], k)[1])
    loads = np.bincount(experts_Mk.ravel(), minlength=e)
    assert loads.max() >= 2 * loads.min() + 8, loads  # uneven
    gate = np.asarray(jnp.einsum("md,edf->emf", x_MD, p["expert_gate"]))
    assert (gate > limit).mean() > 0.1 and (np.abs(gate) > limit).mean() < 0.9  # the clamp cuts, not everywhere

    def loss(fn, x_MD, p):
        return jnp.sum(jnp.sin(fn(x_MD, p)))

    ours = jax.jit(jax.value_and_grad(functools.partial(
        loss, lambda x, p: moe_mlp(x, p, k, True, clamped_swiglu(alpha, limit), topk_first=True)[0]), argnums=(0, 1))
    )(x_MD, p)
    oracle = jax.jit(jax.value_and_grad(functools.partial(
        loss, lambda x, p: dense_gpt_oss_mlp(x, p, k, alpha, limit)), argnums=(0, 1)))(x_MD, p)
    np.testing.assert_allclose(ours[0], oracle[0], rtol=1e-5)
    for (path, g), d in zip(jax.tree_util.tree_leaves_with_path(ours[1]), jax.tree.leaves(oracle[1])):
        np.testing.assert_allclose(g, d, atol=1e-5, rtol=1e-5, err_msg=jax.tree_util.keystr(path))
    for name in ("router_bias", "expert_gate_bias", "expert_up_bias", "expert_down_bias"):
        assert np.abs(np.asarray(ours[1][1][name])).max() > 0, name


def test_a_model_built_from_config_has_the_family_parameters():
    config = from_hf_config(transformers.GptOssConfig(
        vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2).to_dict())
    specs = param_specs(config)
    assert specs["blocks/sinks"] == ((2, 4), ("layers", "q_heads"))
    assert specs["blocks/expert_gate_bias"] == ((2, 4, 8), ("layers", "expert", "mlp"))
    assert specs["blocks/router_bias"] == ((2, 4), ("layers", None))
