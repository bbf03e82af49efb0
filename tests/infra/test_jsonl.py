"""The one JSON Lines reader (datasets, evaluation suites and metrics.jsonl) and its atomic writer (data prepare)."""

import os

import pytest

from drgrpo_jax.jsonl import check_output_file, read_jsonl, write_jsonl


def test_objects_a_line_blank_lines_skipped_and_bad_lines_named(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n  \n{"b": "é"}\n')
    assert list(read_jsonl(path)) == [{"a": 1}, {"b": "é"}]
    for text, words in [('{"a": 1}\nnot json\n', "line 2 is not JSON"), ('[1, 2]\n', "line 1 is not a JSON object")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=words):
            list(read_jsonl(path))


def test_a_byte_order_mark_before_the_first_line_is_skipped(tmp_path):
    """Issue #64: a file saved with a BOM (Windows editors, Excel) was refused with 'Unexpected UTF-8 BOM'."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n{"b": "\xc3\xa9"}\n')
    assert list(read_jsonl(path)) == [{"a": 1}, {"b": "é"}]
    path.write_bytes(b'\xef\xbb\xbf\n{"a": 1}\n')  # a mark on a line of its own: a blank line
    assert list(read_jsonl(path)) == [{"a": 1}]
    path.write_bytes(b'{"a": 1}\n\xef\xbb\xbf{"b": 2}\n')  # a mark inside the file is not a file's mark
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        list(read_jsonl(path))


@pytest.mark.parametrize("line, words", [
    (b"5", "line 2 is not a JSON object (got int)"),
    (b'"text"', "line 2 is not a JSON object (got str)"),
    (b"null", "line 2 is not a JSON object (got NoneType)"),
    (b"[" * 100_000 + b"]" * 100_000, "line 2 is nested too deep"),
    (b'{"problem": "\xff\xfe"}', "line 2 is not UTF-8"),
    (b'{"answer": ' + b"9" * 5000 + b"}", "line 2 is not JSON: Exceeds the limit"),
])
def test_hostile_lines_are_one_line_naming_the_file_and_line(tmp_path, line, words):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"a": 1}\n' + line + b"\n")
    with pytest.raises(ValueError) as info:
        list(read_jsonl(path))
    assert str(info.value).startswith(f"{path} {words}") and "\n" not in str(info.value)


def test_write_replaces_a_regular_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out" / "rows.jsonl"
    write_jsonl([{"a": 1}], str(path))
    path.chmod(0o640)
    write_jsonl([{"b": "é"}, {"c": 2}], str(path))
    assert list(read_jsonl(path)) == [{"b": "é"}, {"c": 2}]
    assert os.listdir(path.parent) == ["rows.jsonl"]
    with pytest.raises(TypeError):  # a row that cannot be written: the old file stays, no temporary is left
        write_jsonl([{"d": object()}], str(path))
    assert list(read_jsonl(path)) == [{"b": "é"}, {"c": 2}] and os.listdir(path.parent) == ["rows.jsonl"]


@pytest.mark.parametrize("kind", ["symlink", "fifo", "folder"])
def test_write_never_replaces_a_link_a_fifo_or_a_folder(tmp_path, kind):
    target, path = tmp_path / "target.txt", tmp_path / "out.jsonl"
    target.write_text("keep")
    {"symlink": lambda: path.symlink_to(target), "fifo": lambda: os.mkfifo(path), "folder": path.mkdir}[kind]()
    with pytest.raises(ValueError, match=f"{path} exists and is"):
        write_jsonl([{"a": 1}], str(path))
    assert target.read_text() == "keep" and sorted(os.listdir(tmp_path)) == ["out.jsonl", "target.txt"]


def test_write_refuses_a_device():
    with pytest.raises(ValueError, match="/dev/full exists and is not a regular file"):
        check_output_file("/dev/full")
