"""The one answer parser of data preparation and the rewards: boxed answers, GSM8K's marker, reference answers."""

import pytest

from drgrpo_jax.data.answers import GSM8K_MARKER, MAX_REFERENCE_CHARS, boxed_content, parse_reference, text_after


def test_boxed_content_balances_braces():
    assert boxed_content("so $\\boxed{\\frac{1}{2}}$ and later \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.") == \
        "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert boxed_content("\\fbox{7}") == "7"
    assert boxed_content("no answer") is None and boxed_content("\\boxed{cut off") is None


def test_text_after_the_last_marker():
    assert text_after("3 + 4 = 7\n#### 7 ", GSM8K_MARKER) == "7"
    assert text_after("#### 1 #### 2", GSM8K_MARKER) == "2"
    assert text_after(" 42\n", GSM8K_MARKER) == "42" and text_after(" a #### b", "") == "a #### b"


def test_parse_reference_wraps_a_bare_answer():
    assert parse_reference("\\frac{1}{2}") and parse_reference("$2$") and parse_reference("\\boxed{3}")
    assert not parse_reference("")


def test_parse_reference_refuses_a_reference_math_verify_could_take_minutes_over():
    with pytest.raises(ValueError, match=f"of {2 * MAX_REFERENCE_CHARS} characters"):
        parse_reference("(" * MAX_REFERENCE_CHARS + ")" * MAX_REFERENCE_CHARS)
