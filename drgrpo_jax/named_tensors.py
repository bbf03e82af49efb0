"""Named tensors in one shared-memory file: the trainer writes a flat buffer and a small JSON index, its child
generation service maps the buffer and reads the tensors back, with no disk write and no safetensors encode.

Any local process may create files in SEGMENT_DIR (/dev/shm: memory-backed on Linux, world-writable), so a segment
is never written where another process could be first: the writer makes a private folder there (`make_folder`:
mode 0700, a fresh name from mkdtemp, `drgrpo_weights_<pid>_<8 random>`) and creates each segment in it anew
(O_CREAT|O_EXCL|O_NOFOLLOW) under an unpredictable name, `<folder>/v<version>_<16 random hex>`. A name already taken
(a planted link or folder) fails the write; nothing is written through it. The reader opens the same way without
following links and maps a segment only when its folder and file are this user's, the folder private and the file
a regular one nobody else may write (`UnsafeSegment` otherwise). <pid> is the writer's, so the folder of a writer
that died mid-push (SIGKILL) is recognised and removed by the next one (`remove_orphans`).

The index holds one entry per tensor: its name, dtype (numpy's name), shape and byte offset in the buffer; each
tensor starts 64-byte aligned. Both sides import this module, so the format lives in one place; it knows no
model, trainer or service.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import mmap
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from drgrpo_jax.errors import UnsafeSegment

__all__ = ["NAME_FORM", "SEGMENT_DIR", "SEGMENT_NAME", "TensorEntry", "available", "free_bytes", "make_folder",
           "parse_index", "read_segment", "remove_folder", "remove_orphans", "remove_segment", "segment_name",
           "write_segment"]

SEGMENT_DIR = "/dev/shm"
_PREFIX = "drgrpo_weights_"
_FOLDER = re.compile(r"drgrpo_weights_(\d+)_[a-z0-9_]{8}")  # the writer's pid, then mkdtemp's random characters
SEGMENT_NAME = re.compile(rf"(?P<folder>{_FOLDER.pattern})/(?P<file>v[A-Za-z0-9._+:-]{{1,64}}_[0-9a-f]{{16}})")
NAME_FORM = "drgrpo_weights_<pid>_<random>/v<version>_<random>"
_ALIGN = 64
# The segment's wire format, not models.precision.DTYPES (a layer above, and only the dtypes a run names): the
# numpy types a reader maps without JAX, float16 included.
_DTYPES: dict[str, Any] = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
MAX_DIMS = 8
_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


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


def make_folder() -> str:
    """A new private folder (0700) in SEGMENT_DIR for this process's segments; its name."""
    return os.path.basename(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}_", dir=SEGMENT_DIR))


def segment_name(folder: str, version: str | int) -> str:
    """A fresh, unpredictable name for weight version `version` in `folder` (`make_folder`)."""
    name = f"{folder}/v{version}_{secrets.token_hex(8)}"
    _parts(name)  # a version with characters a name may not hold fails here
    return name


def _parts(name: str) -> tuple[str, str]:
    """(folder, file) of segment `name`; ValueError unless the name has the segment form."""
    match = SEGMENT_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(f"segment: {name!r} is not a weight segment name ({NAME_FORM})")
    return match["folder"], match["file"]


def _check_private(info: os.stat_result, kind: str, is_kind: Any, others: int, what: str) -> None:
    """UnsafeSegment unless `info` is a `kind` this user owns with none of the `others` mode bits."""
    if not is_kind(info.st_mode):
        raise UnsafeSegment(f"{what}: not a {kind}")
    if info.st_uid != os.geteuid() or info.st_mode & others:
        raise UnsafeSegment(f"{what}: owned by another user or open to others (a segment is this user's alone)")


def _open(name: str, flags: int) -> int:
    """A descriptor of segment `name`, reached without following a link, in a private folder of this user's and
    checked to be a regular file only this user may write. FileNotFoundError when it does not exist."""
    folder, file = _parts(name)
    try:
        folder_fd = os.open(os.path.join(SEGMENT_DIR, folder), os.O_RDONLY | os.O_DIRECTORY | _NO_FOLLOW)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeSegment(f"segment {name}: its folder is a link or not a folder") from None
        raise
    try:
        _check_private(os.fstat(folder_fd), "folder", stat.S_ISDIR, 0o077, f"segment {name}: its folder")
        try:
            fd = os.open(file, flags | _NO_FOLLOW, 0o600, dir_fd=folder_fd)
        except FileExistsError:
            raise UnsafeSegment(f"segment {name}: the name is taken (a segment is only ever created new)") from None
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise UnsafeSegment(f"segment {name}: a symbolic link") from None
            raise
    finally:
        os.close(folder_fd)
    try:
        _check_private(os.fstat(fd), "regular file", stat.S_ISREG, 0o022, f"segment {name}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_segment(name: str, tensors: Mapping[str, np.ndarray]) -> list[TensorEntry]:
    """Writes `tensors` into segment `name`, created new; its index. A failed write leaves no file behind; a
    name that exists (a planted link or folder) is UnsafeSegment and is left as it is."""
    entries, offset = [], 0
    for tensor_name, array in tensors.items():
        dtype = np.dtype(array.dtype).name
        if dtype not in _DTYPES:
            raise ValueError(f"tensors: {tensor_name} has dtype {dtype}; a segment holds {sorted(_DTYPES)}")
        offset = -(-offset // _ALIGN) * _ALIGN
        entries.append(TensorEntry(tensor_name, dtype, tuple(int(d) for d in array.shape), offset))
        offset += array.nbytes
    fd = _open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        os.posix_fallocate(fd, 0, max(offset, 1))  # reserved up front: a full tmpfs fails here, not later by SIGBUS
        buffer = np.frombuffer(mmap.mmap(fd, max(offset, 1)), dtype=np.uint8)
        for entry, array in zip(entries, tensors.values()):
            buffer[entry.offset:entry.offset + entry.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        del buffer  # unmapped; the file (in memory) stays for the reader
    except BaseException:
        remove_segment(name)
        raise
    finally:
        os.close(fd)
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
    """Read-only views of every tensor of segment `name` (mapped, not copied); ValueError if one overruns it,
    UnsafeSegment unless the segment is a private file of this user's (`_open`)."""
    fd = _open(name, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:  # a segment holds at least one byte; mmap refuses an empty file
            raise ValueError(f"segment {name}: empty")
        buffer = np.frombuffer(mmap.mmap(fd, size, prot=mmap.PROT_READ), dtype=np.uint8)
    finally:
        os.close(fd)  # the map holds the pages
    out = {}
    for entry in entries:
        end = entry.offset + entry.nbytes
        if end > buffer.size:
            raise ValueError(f"tensors: {entry.name} ends at byte {end}, past the segment's {buffer.size}")
        out[entry.name] = buffer[entry.offset:end].view(_DTYPES[entry.dtype]).reshape(entry.shape)
    return out


def remove_segment(name: str) -> None:
    """Deletes segment `name` (no error when it is already gone); a link is removed, never followed."""
    folder, file = _parts(name)
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        os.unlink(os.path.join(SEGMENT_DIR, folder, file))


def remove_folder(folder: str) -> None:
    """Deletes this user's segment folder `folder` and the segments in it (nothing when it is gone)."""
    if not _FOLDER.fullmatch(folder):
        raise ValueError(f"segment folder: {folder!r} is not one ({_PREFIX}<pid>_<random>)")
    path = os.path.join(SEGMENT_DIR, folder)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():  # never another user's folder, nor a link
        shutil.rmtree(path, ignore_errors=True)  # fd-based on Linux: a link planted inside is removed, not followed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_orphans() -> list[str]:
    """Deletes this user's segment folders whose writer has died (a SIGKILL mid-push leaves one); their names."""
    if not available():
        return []
    removed = []
    for name in os.listdir(SEGMENT_DIR):
        match = _FOLDER.fullmatch(name)
        if match and not _alive(int(match.group(1))):
            remove_folder(name)
            if not os.path.lexists(os.path.join(SEGMENT_DIR, name)):
                removed.append(name)
    return removed
