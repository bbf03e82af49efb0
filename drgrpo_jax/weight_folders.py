"""Weight folders on local disk, a shared mount or a bucket: copies through etils.epath (orbax's own dependency).

A path with a scheme (`gs://bucket/run/v3`) is remote; gs:// needs `gcsfs` installed where it is
read or written. `file://PATH` is the local folder PATH taken through the remote code path (a
copy), which is how the tests exercise it without a bucket.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

from etils import epath

__all__ = ["copy_folder", "is_remote", "local_folder", "remove_folder", "versions_in"]


def is_remote(path: str) -> bool:
    """Whether `path` is a URI (gs://, file://, ...) rather than a plain local path."""
    return "://" in os.fspath(path)


def _epath(path: str) -> epath.Path:
    path = os.fspath(path)
    return epath.Path(path[len("file://"):] if path.startswith("file://") else path)


def copy_folder(src: str, dst: str) -> None:
    """Copies folder `src` into `dst` (created; files overwritten), either side local or remote."""
    source, target = _epath(src), _epath(dst)
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_dir():
            copy_folder(os.fspath(item), os.fspath(target / item.name))
        else:
            item.copy(target / item.name, overwrite=True)


def remove_folder(path: str) -> None:
    """Deletes a folder and everything in it; nothing when it does not exist."""
    _epath(path).rmtree(missing_ok=True)


def versions_in(root: str) -> list[int]:
    """The N of every v{N} folder under `root`, sorted ([] when root does not exist)."""
    folder = _epath(root)
    if not folder.exists():
        return []
    return sorted(int(p.name[1:]) for p in folder.iterdir() if p.name.startswith("v") and p.name[1:].isdigit())


@contextlib.contextmanager
def local_folder(path: str) -> Iterator[str]:
    """`path` itself when local; else a temporary local copy of the remote folder, removed on exit."""
    if not is_remote(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="drgrpo_weights_") as tmp:
        copy_folder(path, tmp)
        yield tmp
