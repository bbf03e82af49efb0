"""Named tensors in one shared-memory file: the trainer writes a flat buffer and a small JSON index, its child
generation service maps the buffer and reads the tensors back, with no disk write and no safetensors encode.

A segment is a file in SEGMENT_DIR (/dev/shm: memory-backed on Linux) named `drgrpo_weights_<pid>_<version>`,
<pid> being the writer's, so a segment left behind by a writer that died mid-push (SIGKILL) is recognised and
removed by the next one (`remove_orphans`). The index holds one entry per tensor: its name, dtype (numpy's
name), shape and byte offset in the buffer; each tensor starts 64-byte aligned. Both sides import this module,
so the format lives in one place; it knows no model, trainer or service.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["SEGMENT_DIR", "TensorEntry", "available", "free_bytes", "parse_index", "read_segment", "remove_orphans",
           "remove_segment", "segment_name", "write_segment"]

SEGMENT_DIR = "/dev/shm"
_PREFIX = "drgrpo_weights_"
_NAME = re.compile(r"drgrpo_weights_(\d+)_[A-Za-z0-9._+:-]{1,64}")  # the pid, then the weight version
_ALIGN = 64
# The segment's wire format, not models.precision.DTYPES (a layer above, and only the dtypes a run names): the
# numpy types a reader maps without JAX, float16 included.
_DTYPES: dict[str, Any] = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
MAX_DIMS = 8


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a segment."""

    name: str
    dtype: str  # a key of _DTYPES
    shape: tuple[int, ...]
    offset: int  # bytes from the segment's start

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(_DTYPES[self.dtype]).itemsize

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset}


def available() -> bool:
    """Whether this machine has a writable shared-memory folder (Linux's /dev/shm)."""
    return os.path.isdir(SEGMENT_DIR) and os.access(SEGMENT_DIR, os.W_OK)


def free_bytes() -> int:
    """Bytes the shared-memory folder can still take (a container's /dev/shm is often only 64 MB)."""
    stats = os.statvfs(SEGMENT_DIR)
    return stats.f_bavail * stats.f_frsize


def segment_name(version: str | int, pid: int | None = None) -> str:
    """The segment name of weight version `version` written by process `pid` (this one by default)."""
    name = f"{_PREFIX}{os.getpid() if pid is None else pid}_{version}"
    _path(name)  # a version with characters a name may not hold fails here
    return name


def _path(name: str) -> str:
    """The file of segment `name`; ValueError unless the name has the segment form (no path separators)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"segment: {name!r} is not a weight segment name ({_PREFIX}<pid>_<version>)")
    return os.path.join(SEGMENT_DIR, name)


def write_segment(name: str, tensors: Mapping[str, np.ndarray]) -> list[TensorEntry]:
    """Writes `tensors` into a new segment `name`; its index. A failed write leaves no file behind."""
    entries, offset = [], 0
    for tensor_name, array in tensors.items():
        dtype = np.dtype(array.dtype).name
        if dtype not in _DTYPES:
            raise ValueError(f"tensors: {tensor_name} has dtype {dtype}; a segment holds {sorted(_DTYPES)}")
        offset = -(-offset // _ALIGN) * _ALIGN
        entries.append(TensorEntry(tensor_name, dtype, tuple(int(d) for d in array.shape), offset))
        offset += array.nbytes
    path = _path(name)
    try:
        with open(path, "wb") as f:  # reserved up front: a full tmpfs fails here (OSError), not later by SIGBUS
            os.posix_fallocate(f.fileno(), 0, max(offset, 1))
        buffer = np.memmap(path, dtype=np.uint8, mode="r+", shape=(max(offset, 1),))
        for entry, array in zip(entries, tensors.values()):
            buffer[entry.offset:entry.offset + entry.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        del buffer  # unmapped; the file (in memory) stays for the reader
    except BaseException:
        remove_segment(name)
        raise
    return entries


def parse_index(index: list[dict[str, Any]]) -> list[TensorEntry]:
    """The index as sent over HTTP, checked; ValueError naming the first bad entry."""
    entries = []
    for i, item in enumerate(index):
        try:
            entry = TensorEntry(str(item["name"]), str(item["dtype"]), tuple(int(d) for d in item["shape"]),
                                int(item["offset"]))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensors[{i}]: needs name, dtype, shape (a list of ints) and offset") from None
        if entry.dtype not in _DTYPES:
            raise ValueError(f"tensors[{i}].dtype: {entry.dtype!r} is not one of {sorted(_DTYPES)}")
        if len(entry.shape) > MAX_DIMS or any(d < 0 for d in entry.shape) or entry.offset < 0:
            raise ValueError(f"tensors[{i}]: shape {list(entry.shape)} or offset {entry.offset} out of range")
        entries.append(entry)
    return entries


def read_segment(name: str, entries: list[TensorEntry]) -> dict[str, np.ndarray]:
    """Read-only views of every tensor of segment `name` (mapped, not copied); ValueError if one overruns it."""
    buffer = np.memmap(_path(name), dtype=np.uint8, mode="r")
    out = {}
    for entry in entries:
        end = entry.offset + entry.nbytes
        if end > buffer.size:
            raise ValueError(f"tensors: {entry.name} ends at byte {end}, past the segment's {buffer.size}")
        out[entry.name] = buffer[entry.offset:end].view(_DTYPES[entry.dtype]).reshape(entry.shape)
    return out


def remove_segment(name: str) -> None:
    """Deletes segment `name` (no error when it is already gone)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(_path(name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_orphans() -> list[str]:
    """Deletes the segments whose writer has died (a SIGKILL mid-push leaves one); their names."""
    if not available():
        return []
    removed = []
    for name in os.listdir(SEGMENT_DIR):
        match = _NAME.fullmatch(name)
        if match and not _alive(int(match.group(1))):
            remove_segment(name)
            removed.append(name)
    return removed
