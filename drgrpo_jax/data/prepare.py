"""The public math sets as the JSONL the configs read: one `{"problem": ..., "answer": ...}` object a line.

Each recipe names its Hub dataset (the default `--source`), subset and split, the field holding the problem and
how its reference answer is found: GSM8K's text after `####` (thousands separators dropped), MATH's `answer`
field or the last `\\boxed{}` of its `solution`, AIME's integer. The answer is written as the math_verify reward
reads it (both parse it with data/answers.py's `parse_reference`), and a row whose answer math_verify cannot parse
is left out and counted, since the reward could never score it. A reference longer than MAX_REFERENCE_CHARS stops
the run naming its row: math_verify could take minutes over it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from drgrpo_jax.data.answers import GSM8K_MARKER, MAX_REFERENCE_CHARS, boxed_content, parse_reference, text_after
from drgrpo_jax.errors import ConfigError

__all__ = ["RECIPES", "Prepared", "Recipe", "aime_answer", "gsm8k_answer", "math_answer", "prepare_rows"]


def _field(row: Mapping[str, Any], names: Iterable[str]) -> Any:
    """The first of `names` the row holds (None when it holds none)."""
    return next((row[name] for name in names if name in row and row[name] is not None), None)


def _strip_math(text: str) -> str:
    """An answer without surrounding whitespace or one pair of `$` delimiters."""
    text = text.strip()
    if len(text) > 1 and text.startswith("$") and text.endswith("$"):
        text = text[1:-1].strip()
    return text


def math_answer(row: Mapping[str, Any]) -> str | None:
    """MATH: the `answer` field (MATH500, math12k), else the last \\boxed{} of the `solution` (hendrycks MATH)."""
    answer = _field(row, ("answer",))
    if answer is not None and str(answer).strip():
        return _strip_math(str(answer))
    solution = _field(row, ("solution",))
    boxed = boxed_content(str(solution)) if solution is not None else None
    return None if boxed is None else _strip_math(boxed)


_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def gsm8k_answer(row: Mapping[str, Any]) -> str | None:
    """GSM8K: the text after the last `####` of the `answer` solution, without thousands separators."""
    text = str(_field(row, ("answer",)) or "")
    if GSM8K_MARKER not in text:
        return None
    return _THOUSANDS.sub("", text_after(text, GSM8K_MARKER)) or None


def aime_answer(row: Mapping[str, Any]) -> str | None:
    """AIME: an integer in [0, 999], written without leading zeros (`answer`, or `Answer` in some mirrors)."""
    answer = _field(row, ("answer", "Answer"))
    if answer is None:
        return None
    text = _strip_math(str(answer))
    digits = text.isascii() and text.isdigit()  # not int(): past 4300 digits it raises
    return (text.lstrip("0") or "0") if digits else text or None


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One public dataset: where it is on the Hub, and how its rows become problem/answer rows."""

    hub_id: str  # the default --source
    subset: str  # "" = the dataset's only configuration
    split: str
    problem_fields: tuple[str, ...]  # the first one a row holds is the problem
    answer: Callable[[Mapping[str, Any]], str | None]
    about: str


# Field names from the datasets' cards on the Hub (dataset_info features) and the code that reads them: see
# tests/data/test_prepare.py for each source.
RECIPES: dict[str, Recipe] = {
    "math12k": Recipe("hiyouga/math12k", "", "train", ("problem",), math_answer,
                      "MATH's 12k training problems (train + test minus MATH500), as Dr.GRPO trains; training"),
    "math500": Recipe("HuggingFaceH4/MATH-500", "", "test", ("problem",), math_answer,
                      "the 500 MATH test problems of Lightman et al.; evaluation"),
    "gsm8k": Recipe("openai/gsm8k", "main", "test", ("question",), gsm8k_answer,
                    "grade-school word problems, 1319 test rows (--split train: 7473 to train on)"),
    "aime24": Recipe("HuggingFaceH4/aime_2024", "", "train", ("problem", "Problem"), aime_answer,
                     "the 30 problems of AIME 2024 I and II; evaluation"),
}


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The rows written and the source rows left out (no answer found, or none math_verify can parse)."""

    rows: tuple[dict[str, str], ...]
    without_answer: int
    unparsable: int


def prepare_rows(recipe: Recipe, rows: Iterable[Mapping[str, Any]], key: str = "--source") -> Prepared:
    """Source rows -> problem/answer rows; ConfigError naming `key` when a row lacks every problem field or its
    answer is longer than MAX_REFERENCE_CHARS."""
    out: list[dict[str, str]] = []
    without_answer = unparsable = 0
    for index, row in enumerate(rows):
        problem = _field(row, recipe.problem_fields)
        if problem is None:
            wanted = " or ".join(repr(name) for name in recipe.problem_fields)
            raise ConfigError(key, f"row {index} has no {wanted} field (fields: {', '.join(map(str, row))}); is it "
                                   f"{recipe.hub_id}'s schema?")
        answer = recipe.answer(row)
        if answer is not None and len(answer) > MAX_REFERENCE_CHARS:
            raise ConfigError(key, f"row {index}'s answer has {len(answer)} characters, more than the "
                                   f"{MAX_REFERENCE_CHARS} math_verify is given (a reference is a short final answer)")
        if answer is None:
            without_answer += 1
        elif not parse_reference(answer):
            unparsable += 1
        else:
            out.append({"problem": str(problem).strip(), "answer": answer})
    return Prepared(tuple(out), without_answer, unparsable)

