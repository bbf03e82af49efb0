"""Stop strings: a completion cut before the earliest of them, on its decoded text (the sampler stops on tokens
only). Shared by OpenAI's `stop` and SGLang's `sampling_params.stop`."""

from __future__ import annotations

import dataclasses
from typing import Any

from drgrpo_jax.serve.scheduler import RowResult
from drgrpo_jax.serve.service import decode

__all__ = ["Choice", "apply_stop", "first_stop"]


@dataclasses.dataclass(frozen=True)
class Choice:
    """One completion after its stop strings: the tokens kept, its text and why it ended."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, a stop token or a stop string), "length" or "abort" (the deadline)
    weight_version: str
    matched: str | None = None  # the stop string that ended it


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(index, string) of the earliest stop string in `text` (the longest of those starting there), or None."""
    found = [(text.find(stop), -len(stop), stop) for stop in stops if stop in text]
    if not found:
        return None
    index, _, stop = min(found)
    return index, stop


def _tokens_covering(tokenizer: Any, ids: list[int], num_chars: int) -> int:
    """The fewest leading tokens whose decoded text has at least `num_chars` characters (binary search)."""
    low, high = 1, len(ids)
    while low < high:
        middle = (low + high) // 2
        if len(decode(tokenizer, ids[:middle])) >= num_chars:
            high = middle
        else:
            low = middle + 1
    return low


def apply_stop(result: RowResult, tokenizer: Any, stops: list[str]) -> Choice:
    """The completion cut before its earliest stop string (unchanged when none occurs).

    The sampler stops on tokens, so a completion runs to its budget, EOS or a stop token before it is cut
    here. As OpenAI, the text leaves the stop string out; as vLLM, `token_ids` keep the tokens through the
    one that completed it.
    """
    text = decode(tokenizer, result.output_ids)
    reason = "abort" if result.aborted else "stop" if result.stopped else "length"
    found = first_stop(text, stops) if stops else None
    if found is None:
        return Choice(result.output_ids, text, reason, result.weight_version)
    index, stop = found
    keep = _tokens_covering(tokenizer, result.output_ids, index + len(stop))
    return Choice(result.output_ids[:keep], text[:index], "stop", result.weight_version, stop)
