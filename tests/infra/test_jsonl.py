"""The one JSON Lines reader: datasets, evaluation suites and metrics.jsonl."""

import pytest

from drgrpo_jax.jsonl import read_jsonl


def test_objects_a_line_blank_lines_skipped_and_bad_lines_named(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n  \n{"b": "é"}\n')
    assert list(read_jsonl(path)) == [{"a": 1}, {"b": "é"}]
    for text, words in [('{"a": 1}\nnot json\n', "line 2 is not JSON"), ('[1, 2]\n', "line 1 is not a JSON object")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=words):
            list(read_jsonl(path))
