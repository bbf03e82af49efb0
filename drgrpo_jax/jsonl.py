"""JSON Lines files, one object a line: read for the datasets and evaluation suites (data/sources.py) and a run's
metrics.jsonl (train/run_log.py); written whole, atomically, for `python -m drgrpo_jax.data prepare`."""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = ["check_output_file", "read_jsonl", "write_jsonl"]


def _row(path: str, number: int, line: bytes) -> dict[str, Any]:
    """The object on line `number`; ValueError naming the file and line for anything else."""
    where = f"{path} line {number}"
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"{where} is not UTF-8 (byte {error.start}: {error.reason})") from None
    except RecursionError:  # a row nested deeper than the interpreter's stack
        raise ValueError(f"{where} is nested too deep to read") from None
    except ValueError as error:  # JSONDecodeError, or an integer past Python's int-str digit limit
        raise ValueError(f"{where} is not JSON: {error}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where} is not a JSON object (got {type(row).__name__})")
    return row


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The object on each non-blank line of `path` (a UTF-8 byte order mark before the first is skipped, as editors
    on Windows write one); ValueError (one line, naming the file and line) for a line that is not UTF-8, not JSON,
    nested past the stack or not an object."""
    with open(path, "rb") as file:
        for number, line in enumerate(file, start=1):
            if number == 1:
                line = line.removeprefix(codecs.BOM_UTF8)
            if line.strip():
                yield _row(os.fspath(path), number, line)


def check_output_file(path: str) -> None:
    """ValueError when `path` exists and is not a regular file (a device, a FIFO, a folder, a symlink): an output
    replaces only a file, never what a link points to."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        kind = "a symlink" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise ValueError(f"{path} exists and is {kind}; name a new or regular file")


def write_jsonl(rows: Iterable[Mapping[str, Any]], path: str) -> None:
    """One JSON object a line, written whole or not at all: into a new file of the target's folder (created
    exclusively, never through a link) renamed over `path`; ValueError when `path` is not a regular file."""
    check_output_file(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".partial")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would make the output private
        with open(fd, "w", encoding="utf-8") as file:
            for row in rows:
                file.write(json.dumps(row, ensure_ascii=False) + "\n")
        check_output_file(path)  # again: the rename must not replace what appeared meanwhile
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
