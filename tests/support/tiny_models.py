"""The tests' tiny random models: a transformers Llama saved offline with a character-level tokenizer (the
service, trainer and conversion tests load it from disk), a transformers Qwen3-MoE (tests/models/test_moe.py)
and GPT-OSS (tests/models/test_gpt_oss.py), the step tests' DecoderConfig and the sampler's in-memory
Transformer; and `hf_logits`, a transformers model's logits, which the parity tests compare with ours."""

from __future__ import annotations


def hf_logits(model, ids, **arrays):
    """float32 logits of a transformers model (numpy out); `arrays`: attention_mask, position_ids, ... as numpy."""
    import numpy as np
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids)), **{k: torch.tensor(np.asarray(v)) for k, v in arrays.items()
                                                        if v is not None}).logits.float().numpy()


# ---------------------------------------------------------------------------------------------
# The tiny random Llama (transformers, saved offline) with a character-level tokenizer
# ---------------------------------------------------------------------------------------------

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?+-=*/()ABCDEFGHIJKLMNOPQRSTU"
TINY_VOCAB = 3 + 48  # <unk>, <s>, </s>, then lowercase, digits, space and punctuation


def save_char_tokenizer(path: str, chars: str) -> dict[str, int]:
    """Saves a HF tokenizer, built offline, with <unk>=0, <s>=1, </s>=2 and one id per character; returns its
    vocabulary."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{ch: 3 + i for i, ch in enumerate(chars)}}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(path)
    return vocab


def write_tiny_llama(path: str, seed: int = 0, *, vocab_size: int = TINY_VOCAB, hidden_size: int = 32,
                     initializer_range: float = 0.3, max_position_embeddings: int = 128, intermediate_size: int = 64,
                     num_attention_heads: int = 4, num_key_value_heads: int = 2) -> str:
    """A random 2-layer Llama saved by transformers, with a character-level tokenizer of the first
    vocab_size - 3 characters of CHARS; <s> = 1, </s> = 2 (EOS). A larger initializer_range gives
    peaked, seed-dependent continuations."""
    import torch
    import transformers

    vocab = save_char_tokenizer(path, CHARS[:vocab_size - 3])
    assert len(vocab) == vocab_size, (len(vocab), vocab_size)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=2,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, initializer_range=initializer_range)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def write_tiny_qwen3_moe(path: str, seed: int = 0, *, norm_topk_prob: bool = True, vocab_size: int = 96,
                         num_experts: int = 8) -> str:
    """A random 2-layer Qwen3-MoE saved by transformers (its per-expert layout): `num_experts` experts of hidden
    16, 2 per token, q/k norms; every weight (norms and router too) perturbed so that each one shows in the logits.
    No tokenizer: the tests feed ids."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=num_experts, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False)
    return _save_perturbed(config, path, scale=lambda name: 0.1)


def write_tiny_mixtral(path: str, seed: int = 0, sliding_window: int | None = None, *, vocab_size: int = 96) -> str:
    """A random 2-layer Mixtral saved by transformers (the Hub's `block_sparse_moe.experts.{j}.w1` layout): 4
    experts of hidden 16, 2 per token; every weight (norms and router too) perturbed so each one shows."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=sliding_window,
        max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return _save_perturbed(config, path, scale=lambda name: 0.1)


def write_tiny_gpt_oss(path: str, seed: int = 0, *, vocab_size: int = 96, num_experts: int = 4,
                      sliding_window: int = 4, intermediate_size: int = 16) -> str:
    """A random 3-layer GPT-OSS saved by transformers: sliding, full, sliding attention (window `sliding_window`),
    sinks, q/k/v/o biases, `num_experts` experts of hidden `intermediate_size` with biases, 2 per token, and YaRN
    scaling that starts within the tests' lengths (original context 16, factor 4). Every weight (norms, sinks, router
    and biases too) is perturbed so that each one shows in the logits, the experts enough that their projections pass
    the SwiGLU clamp (limit 7). No tokenizer: the tests feed ids."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.GptOssConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=intermediate_size, num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=num_experts, num_experts_per_tok=2,
        sliding_window=sliding_window, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 16})
    return _save_perturbed(config, path, scale=lambda name: 2.0 if "experts" in name else 0.1)


def _save_perturbed(config, path: str, scale) -> str:
    """A transformers model of `config` (eager attention), each parameter plus scale(name) x N(0, 1) noise from
    torch's current seed, saved to `path`."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(scale(name) * torch.randn_like(p))
    model.save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------
# In-memory tiny Transformers: the training step's and the sampler's
# ---------------------------------------------------------------------------------------------


def tiny_decoder_config():
    """The step tests' 2-layer Llama-shaped DecoderConfig (vocab 64)."""
    from drgrpo_jax.models.config import DecoderConfig

    return DecoderConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)


SAMPLER_VOCAB = 97


def tiny_sampler_model():
    """A tiny random Llama-family Transformer (GQA, untied head, EOS = vocab - 1); weights scaled up x10 so
    logits are peaked and continuations differ by prompt."""
    import jax
    from flax import nnx

    from drgrpo_jax.models.config import DecoderConfig
    from drgrpo_jax.models.transformer import Transformer

    config = DecoderConfig(family="llama", vocab_size=SAMPLER_VOCAB, hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                           eos_token_ids=(SAMPLER_VOCAB - 1,))
    graphdef, state = nnx.split(Transformer(config, rngs=nnx.Rngs(0)))
    return nnx.merge(graphdef, jax.tree.map(lambda x: x * 10.0 if x.ndim > 1 else x, state))
