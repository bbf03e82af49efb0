"""The multi-turn tests' tiny chat model (a character tokenizer that can write JSON, ChatML's special tokens and
template) and an environment that always answers (importable by a trainer child as support.chat_models:Chatty)."""

from __future__ import annotations

from drgrpo_jax.environments.protocol import Observation

from support.tiny_models import write_tiny_llama

CHAT_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?+-=*/()<>{}\":_\n|"
SPECIALS = ("<|im_start|>", "<|im_end|>")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_chat_tokenizer(path: str, chat_template: str = CHATML):
    """The character tokenizer that can write JSON, with ChatML's two special tokens and `chat_template`; returns
    it (saved to `path`)."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{ch: 3 + i for i, ch in enumerate(CHAT_CHARS)}}
    vocab.update({token: len(vocab) + i for i, token in enumerate(SPECIALS)})
    assert max(vocab.values()) < 64
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", additional_special_tokens=list(SPECIALS))
    fast.chat_template = chat_template
    fast.save_pretrained(path)
    return fast


def write_chat_model(path: str, max_position_embeddings: int = 1024) -> str:
    """The tiny random Llama (vocab 64) with save_chat_tokenizer's tokenizer and a ChatML template (no tools: the
    driver describes them itself)."""
    write_tiny_llama(path, vocab_size=64, initializer_range=0.3, max_position_embeddings=max_position_embeddings)
    save_chat_tokenizer(path)
    return path


class Chatty:
    """An environment that always answers, `turns` times: episodes as long as the limits allow."""

    tools = ()

    def __init__(self, turns: int = 3):
        self.left = turns

    def reset(self, example):
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, text):
        self.left -= 1
        return Observation([{"role": "user", "content": f"go on {self.left}"}], done=self.left <= 0,
                           rewards={"turn": 0.5})
