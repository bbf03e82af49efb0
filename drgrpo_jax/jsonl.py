"""JSON Lines files read one object a line: the datasets and evaluation suites (data/sources.py) and a run's
metrics.jsonl (train/run_log.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["read_jsonl"]


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The object on each non-blank line of `path`; ValueError naming the line that is not a JSON object."""
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{os.fspath(path)} line {number} is not JSON: {error}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{os.fspath(path)} line {number} is not a JSON object")
            yield row
