"""A character-level HF tokenizer built offline, for the tiny random models of the tests."""

import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers


def save_char_tokenizer(path: str, chars: str) -> dict[str, int]:
    """Saves a tokenizer with <unk>=0, <s>=1, </s>=2 and one id per character; returns its vocabulary."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{ch: 3 + i for i, ch in enumerate(chars)}}
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(path)
    return vocab
