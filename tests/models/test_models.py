"""Model parity with transformers (PyTorch, CPU) on tiny random configs of each family, plus invariances."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from drgrpo_jax.models.config import DecoderConfig, RuntimeOptions, from_hf_config
from drgrpo_jax.models.families import FAMILIES, family_of_model_type
from drgrpo_jax.models.hf_io import SafetensorsIndex, save_pretrained
from drgrpo_jax.models.kv_cache import init_cache, split_cache, stack_cache, write_slots
from drgrpo_jax.models.pretrained import from_pretrained
from drgrpo_jax.models.transformer import Transformer, layer_params, rope_for_layers

from support.tiny_models import hf_logits

# Every family's forward against transformers runs in the inner loop; the decode, bfloat16, gradient and remat
# checks compile more programs per family and are `heavy`.

VOCAB = 96
TOL = 1e-4
SLOTS = 20  # decode cache slots in these tests: no family's head_dim, so a key layout shows in the shapes


def _hf_config(family: str):
    """A tiny HF config exercising the family's distinctive features."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":  # Llama 3 RoPE scaling, untied output
        return transformers.LlamaConfig(
            **common, head_dim=8, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 16}, rope_theta=500.0)
    if family == "qwen2":  # q/k/v biases, tied embeddings
        return transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000.0)
    if family == "qwen3":  # q/k norm, head_dim != hidden/heads
        return transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
    if family == "gemma3":  # sliding + global layers, two RoPE bases, soft-caps, sandwich norms
        return transformers.Gemma3TextConfig(
            **common, head_dim=16, sliding_window=4, query_pre_attn_scalar=12,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=10_000.0, rope_local_base_freq=100.0,
            final_logit_softcapping=3.0)
    raise ValueError(family)


# Every dense family of the table (a new one fails here until `_hf_config` gives it a checkpoint).
DENSE_FAMILIES = tuple(name for name, family in FAMILIES.items() if not family.sparse)


@pytest.fixture(scope="module", params=DENSE_FAMILIES)
def hf_pair(request, tmp_path_factory):
    """(family, HF torch model with perturbed weights, folder it was saved to)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(request.param), attn_implementation="eager")
    with torch.no_grad():  # random norms and biases too, so every parameter is exercised
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.eval()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, model, str(folder)


def _ids(seed: int, shape) -> np.ndarray:
    """Random token ids avoiding the special ids."""
    return np.random.RandomState(seed).randint(3, VOCAB, shape)


def test_config_roundtrip(hf_pair):
    family, model, _ = hf_pair
    config = from_hf_config(model.config.to_dict())
    assert config.family == family
    assert config.eos_token_ids == (2,)
    if family == "gemma3":
        assert config.sliding_layers == (True, False, True)
        assert config.local_rope.theta == 100.0 and config.rope.rope_type == "linear"


def test_unpadded_parity(hf_pair):
    _, model, folder = hf_pair
    ours = from_pretrained(folder)
    ids = _ids(0, (2, 12))
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids))), hf_logits(model, ids), atol=TOL, rtol=0)


def test_left_padded_parity(hf_pair):
    _, model, folder = hf_pair
    ours = from_pretrained(folder)
    ids = _ids(1, (3, 10))
    lengths = np.array([10, 7, 3])
    real = np.arange(10)[None, :] >= (10 - lengths)[:, None]
    ids = np.where(real, ids, 0)
    positions = np.maximum(np.cumsum(real, axis=1) - 1, 0)
    ref = hf_logits(model, ids, attention_mask=real.astype(np.int64), position_ids=positions)
    got = np.asarray(ours(jnp.asarray(ids), jnp.asarray(positions, jnp.int32), jnp.asarray(real, jnp.int32)))
    np.testing.assert_allclose(got[real], ref[real], atol=TOL, rtol=0)


def test_packed_parity(hf_pair):
    _, model, folder = hf_pair
    ours = from_pretrained(folder)
    a, b = _ids(2, (1, 7)), _ids(3, (1, 6))
    packed = np.concatenate([a, b, np.zeros((1, 2), np.int64)], axis=1)  # two sequences + 2 pad tokens
    segments = np.array([[1] * 7 + [2] * 6 + [0] * 2], np.int32)
    positions = np.array([list(range(7)) + list(range(6)) + [0, 0]], np.int32)
    got = np.asarray(ours(jnp.asarray(packed), jnp.asarray(positions), jnp.asarray(segments)))
    np.testing.assert_allclose(got[0, :7], hf_logits(model, a)[0], atol=TOL, rtol=0)
    np.testing.assert_allclose(got[0, 7:13], hf_logits(model, b)[0], atol=TOL, rtol=0)


@pytest.mark.heavy
def test_roundtrip_through_save_pretrained(hf_pair, tmp_path):
    _, model, folder = hf_pair
    ours = from_pretrained(folder)
    save_pretrained(ours, tmp_path, max_shard_bytes=20_000)  # forces several shards + an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = _ids(4, (2, 9))
    np.testing.assert_allclose(hf_logits(reloaded, ids), hf_logits(model, ids), atol=TOL, rtol=0)
    again = from_pretrained(str(tmp_path))
    assert again.config == ours.config
    np.testing.assert_array_equal(np.asarray(again(jnp.asarray(ids))), np.asarray(ours(jnp.asarray(ids))))


def _prefill_then_decode(model, ids, positions, prompt_len, *, split, cache_dtype=jnp.float32):
    """Logits of a prefill of `prompt_len` columns then one cached step per remaining column, and the cache.

    split=True is the sampler's path: per-layer weights, RoPE tables and cache (the unrolled layers for the
    prefill too); split=False the stacked cache (prefill through the layer scan).
    """
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids_BT, pos_BT, cache):
        m = nnx.merge(graphdef, state)
        if not split:
            return m.decode(ids_BT, pos_BT, cache)
        layers = layer_params(m.blocks.arrays(), m.config.num_layers)
        return m.decode(ids_BT, pos_BT, cache, layers, rope_for_layers(m.config, pos_BT))

    cache = init_cache(model.config, ids.shape[0], SLOTS, dtype=cache_dtype)
    cache = split_cache(cache) if split else cache
    logits, cache = step(state, jnp.asarray(ids[:, :prompt_len]), jnp.asarray(positions[:, :prompt_len]), cache)
    got = [np.asarray(logits)]
    for t in range(prompt_len, ids.shape[1]):
        logits, cache = step(state, jnp.asarray(ids[:, t:t + 1]), jnp.asarray(positions[:, t:t + 1]), cache)
        got.append(np.asarray(logits))
    return np.concatenate(got, axis=1), cache


def _left_padded_batch(prompt_len: int, new: int):
    """Token ids [2, prompt_len + new], row 1 left-padded by 3, and positions (-1 on padding)."""
    ids = _ids(5, (2, prompt_len + new))
    real = np.ones_like(ids, bool)
    real[1, :3] = False
    return ids, real, np.where(real, np.cumsum(real, axis=1) - 1, -1).astype(np.int32)


@pytest.mark.heavy
@pytest.mark.parametrize("split", [False, True], ids=["stacked_cache", "split_cache"])
def test_prefill_and_decode_match_full_forward(hf_pair, split):
    _, _, folder = hf_pair
    model = from_pretrained(folder)
    ids, real, positions = _left_padded_batch(prompt_len=6, new=4)
    full = np.asarray(model(jnp.asarray(ids), jnp.asarray(np.maximum(positions, 0)), jnp.asarray(real, jnp.int32)))
    got, cache = _prefill_then_decode(model, ids, positions, 6, split=split)
    assert int(cache.length) == ids.shape[1]
    np.testing.assert_allclose(got[real], full[real], atol=1e-5, rtol=0)
    config = model.config
    if split:  # per layer, in attention order (keys [B, C, H, S], values [B, C, S, H]); stack_cache inverts it
        C, H = config.num_kv_heads, config.head_dim
        assert len(cache.k) == config.num_layers and cache.k[0].shape == (2, C, H, SLOTS)  # float32: keys transposed
        assert cache.v[0].shape == (2, C, SLOTS, H)
        stacked = stack_cache(cache)
        assert stacked.k.shape == (config.num_layers, 2, SLOTS, config.num_kv_heads, config.head_dim)
        for a, b in zip(split_cache(stacked).k + split_cache(stacked).v, cache.k + cache.v):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.heavy
def test_bfloat16_split_cache_decode_close_to_float32(hf_pair):
    """The bf16 sampler path (bf16 weights and cache, uint16 cache writes, f32 gate) against the f32 forward."""
    _, _, folder = hf_pair
    ids, real, positions = _left_padded_batch(prompt_len=6, new=4)
    ref = np.asarray(from_pretrained(folder)(jnp.asarray(ids), jnp.asarray(np.maximum(positions, 0)),
                                             jnp.asarray(real, jnp.int32)))
    got, cache = _prefill_then_decode(from_pretrained(folder, dtype=jnp.bfloat16), ids, positions, 6, split=True,
                                      cache_dtype=jnp.bfloat16)
    assert cache.k[0].dtype == jnp.bfloat16 and got.dtype == np.float32
    _, C, _, H = cache.v[0].shape  # 16-bit keys stay [B, C, S, H] (kv_cache.key_order)
    assert cache.k[0].shape == cache.v[0].shape == (2, C, SLOTS, H)
    assert np.abs(got[real] - ref[real]).max() < 0.1 * np.abs(ref[real]).max()


def test_bfloat16_cache_writes_are_exact():
    """write_slots goes through a uint16 view for bf16 (XLA CPU would round-trip the cache via f32)."""
    buffer = jax.random.normal(jax.random.key(0), (2, 3, 8, 4)).astype(jnp.bfloat16)
    update = jax.random.normal(jax.random.key(1), (2, 3, 2, 4))
    got = jax.jit(write_slots, static_argnums=2)(buffer, update, (0, 0, 5, 0))
    want = buffer.at[:, :, 5:7].set(update.astype(jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


@pytest.mark.heavy
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_causal_by_gradient(family):
    config = dataclasses.replace(from_hf_config(_hf_config(family).to_dict()), tie_word_embeddings=False)
    model = Transformer(config, rngs=nnx.Rngs(0))
    T = 10
    ids = jnp.asarray(np.random.RandomState(0).permutation(np.arange(3, VOCAB))[:T][None])  # distinct tokens
    graphdef, state = nnx.split(model)

    @jax.jit
    @jax.grad
    def grad_of_logits_at(state, t):
        return nnx.merge(graphdef, state)(ids)[0, t].sum()

    for t in (0, 4, T - 1):
        grad_embed = grad_of_logits_at(state, t)["embed"][...]
        row_norms = np.abs(np.asarray(grad_embed)[np.asarray(ids[0])]).sum(axis=1)
        assert np.all(row_norms[:t + 1] > 0), (t, row_norms)
        assert np.all(row_norms[t + 1:] == 0), (t, row_norms)


@pytest.mark.heavy
def test_bfloat16_params_close_to_float32(hf_pair):
    _, _, folder = hf_pair
    ids = jnp.asarray(_ids(6, (1, 8)))
    ref = np.asarray(from_pretrained(folder)(ids))
    model = from_pretrained(folder, dtype=jnp.bfloat16)
    assert model.blocks.q_proj[...].dtype == jnp.bfloat16
    got = model(ids)
    assert got.dtype == jnp.float32
    assert np.abs(np.asarray(got) - ref).max() < 0.1 * np.abs(ref).max()


@pytest.mark.heavy
@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_every_remat_policy_gives_the_same_loss_and_gradients(impl, monkeypatch):
    """Each policy of models/remat.py only changes what the backward recomputes, never the values."""
    from drgrpo_jax.models import attention
    from drgrpo_jax.models.remat import REMAT_POLICIES

    monkeypatch.setattr(attention, "DEFAULT_BLOCK_SIZE", 2)  # blockwise: 4 query and 2 key blocks per row
    config = from_hf_config(_hf_config("qwen3").to_dict())
    ids = jnp.asarray(_ids(7, (2, 8)))
    segments = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0], [1] * 8])  # two packed sequences and a padding slot
    positions = jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 0], list(range(8))])
    results = {}
    for policy in REMAT_POLICIES:
        runtime = RuntimeOptions(remat=policy, attention_impl=impl)
        graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0), runtime=runtime))

        def loss(s, graphdef=graphdef):
            return (nnx.merge(graphdef, s)(ids, positions, segments) * (segments > 0)[..., None]).mean()

        results[policy] = jax.jit(jax.value_and_grad(loss))(state)
    for policy, (value, grads) in results.items():
        np.testing.assert_allclose(value, results["none"][0], rtol=1e-6, err_msg=policy)
        jax.tree.map(lambda a, b, p=policy: np.testing.assert_allclose(a, b, atol=1e-6, err_msg=p), grads,
                     results["none"][1])
    for former_flag in (True, False):  # the old boolean is no policy
        with pytest.raises(ValueError, match="is not a policy"):
            RuntimeOptions(remat=former_flag)
    with pytest.raises(ValueError, match="remat: 'some' is not a policy"):
        RuntimeOptions(remat="some")


def test_each_model_type_reads_as_one_family_and_no_other():
    types = [t for family in FAMILIES.values() for t in family.hf_model_types]
    assert len(types) == len(set(types))
    assert all(family_of_model_type(t) is family for family in FAMILIES.values() for t in family.hf_model_types)
    assert from_hf_config({**_hf_config("gemma3").to_dict(), "model_type": "gemma3_text"}).family == "gemma3"
    with pytest.raises(ValueError, match=r"model_type: 'gpt2' is not supported \(supported: \['gemma3', "):
        family_of_model_type("gpt2")


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_kv_heads"):
        DecoderConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="family"):
        DecoderConfig(family="gpt2")
    with pytest.raises(ValueError, match="layer_types"):
        DecoderConfig(num_layers=2, layer_types=("full_attention",))
    with pytest.raises(ValueError, match="rope_type"):
        from_hf_config({**_hf_config("llama").to_dict(), "rope_parameters": None,
                        "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})


def test_load_errors_name_the_tensor(tmp_path):
    config = from_hf_config(_hf_config("llama").to_dict())
    save_pretrained(Transformer(config, rngs=nnx.Rngs(0)), tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "intermediate_size": 40}))
    with pytest.raises(ValueError, match=r"weights: model.layers.0.mlp.(down|gate|up)_proj.weight has shape"):
        from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 4}))
    with pytest.raises(ValueError, match="num_hidden_layers: config.json says 4, the weights hold 3 layers"):
        from_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="path"):
        from_pretrained(str(tmp_path / "nowhere"))



@pytest.mark.parametrize("content", [b"", b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]", b"\xff" * 8 + b"{}"])
def test_a_file_that_is_not_safetensors_is_one_line_naming_it(tmp_path, content):
    """An empty safetensors file in a cached Hub repo gave struct's "unpack requires a buffer of 8 bytes"."""
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match=f"^{tmp_path / 'model.safetensors'} is not a safetensors file"):
        SafetensorsIndex(str(tmp_path))


def test_bfloat16_save_is_bit_exact_in_transformers(tmp_path):
    config = from_hf_config(_hf_config("qwen2").to_dict())
    model = Transformer(config, rngs=nnx.Rngs(1), dtype=jnp.bfloat16)
    save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    q_hf = reloaded.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()
    q_ours = np.asarray(model.blocks.q_proj[...][1].astype(jnp.float32))  # [D, N, H]
    np.testing.assert_array_equal(q_hf, q_ours.reshape(config.hidden_size, -1).T)
    np.testing.assert_array_equal(reloaded.model.embed_tokens.weight.detach().float().numpy(),
                                  np.asarray(model.embed[...].astype(jnp.float32)))
    again = from_pretrained(str(tmp_path), dtype=jnp.bfloat16)  # and our reader reads BF16 back bit-exactly
    jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(model))


def test_multimodal_gemma3_config_reads_its_text_config():
    text = _hf_config("gemma3").to_dict()
    del text["eos_token_id"]
    config = from_hf_config({"model_type": "gemma3", "text_config": text, "eos_token_id": [1, 106]},
                            generation={"eos_token_id": [1, 106, 107]})
    assert config.family == "gemma3" and config.eos_token_ids == (1, 106, 107)
    assert config.sliding_layers == (True, False, True)
