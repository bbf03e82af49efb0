"""Mixtral: what its HF config cannot say, and upcycling a dense Llama into one (models/upcycle.py): the same
function at step 0, experts that diverge. Its parity with transformers is test_moe_families.py's."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import transformers
from flax import nnx

from drgrpo_jax.models.config import DecoderConfig, to_hf_config
from drgrpo_jax.models.kv_cache import init_cache
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.models.transformer import Transformer
from drgrpo_jax.models.upcycle import main as upcycle_main
from drgrpo_jax.models.upcycle import upcycle

from support.tiny_models import hf_logits, write_tiny_llama

VOCAB = 96


def _ids(seed: int, shape) -> np.ndarray:
    return np.random.RandomState(seed).randint(3, VOCAB, shape)


@pytest.mark.parametrize("fields, message", [
    (dict(qkv_bias=True, o_bias=True), "qkv_bias/o_bias: mixtral has no attention biases"),
    (dict(norm_topk_prob=False), "norm_topk_prob: mixtral always renormalises its top-k routing weights")])
def test_what_mixtrals_config_cannot_say_is_refused_in_one_line(fields, message):
    config = DecoderConfig(family="mixtral", num_experts=4, experts_per_token=2, moe_intermediate_size=8,
                           **{"norm_topk_prob": True, **fields})
    with pytest.raises(ValueError, match=message):
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
