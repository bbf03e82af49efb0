"""Final answers read out of text, one parser for both sides: data preparation reads a dataset's reference answer
(data/prepare.py, data/sources.py), the rewards read a completion's (rewards/functions.py), so a reference is cut
and wrapped exactly as the reward that scores against it reads it."""

from __future__ import annotations

from typing import Any

__all__ = ["GSM8K_MARKER", "MAX_REFERENCE_CHARS", "boxed_content", "parse_reference", "text_after"]

GSM8K_MARKER = "####"  # GSM8K's solutions end in '#### 42'
# The longest reference answer math_verify is given: its parse grows steeply with nesting (40 KB of parentheses
# took 274 s and 1.7 GB, 1,000 characters take under 2 s), and signal.alarm, its own time bound, cannot interrupt a
# regex. Real references are a few dozen characters.
MAX_REFERENCE_CHARS = 1000


def boxed_content(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None when there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    begin, depth = text.index("{", start) + 1, 0
    for position in range(begin, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            if depth == 0:
                return text[begin:position].strip()
            depth -= 1
    return None


def text_after(text: str, marker: str) -> str:
    """The text after the last `marker`, stripped; all of it, stripped, when `marker` is empty or absent."""
    if marker and marker in text:
        text = text.rsplit(marker, 1)[1]
    return text.strip()


def parse_reference(answer: str) -> list[Any]:
    """math_verify's parse of a reference answer, a bare one wrapped in `$...$` (empty when it cannot read it);
    ValueError for one longer than MAX_REFERENCE_CHARS."""
    # start-up: math_verify costs ~0.5 s; only reward workers (which preload it) and `data prepare` parse answers.
    from math_verify import parse

    if len(answer) > MAX_REFERENCE_CHARS:
        raise ValueError(f"a reference answer of {len(answer)} characters; math_verify is given at most "
                         f"{MAX_REFERENCE_CHARS}")
    return parse(answer if ("$" in answer or "\\boxed" in answer) else f"${answer}$")
