"""Weight and run folders on local disk, a shared mount or a bucket, through etils.epath (orbax's own dependency).

A path with a scheme (`gs://bucket/run/v3`) is remote; gs:// needs `gcsfs` installed where it is
read or written. `file://PATH` is the local folder PATH taken through the remote code path (a
copy), which is how the tests exercise it without a bucket. A remote run folder (run.output_dir=gs://...) has a
local scratch folder beside it for what must be a local file: the weight versions the trainer exports, the
child service's log, W&B's files.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator

from etils import epath

__all__ = ["absolute", "as_epath", "copy_folder", "is_remote", "local_folder", "read_text", "remove_folder",
           "scratch_folder", "versions_in", "write_text"]


def is_remote(path: str) -> bool:
    """Whether `path` is a URI (gs://, file://, ...) rather than a plain local path."""
    return "://" in os.fspath(path)


def as_epath(path: str | os.PathLike[str]) -> epath.Path:
    """`path` as an etils Path (`file://PATH` as the local PATH)."""
    path = os.fspath(path)
    return epath.Path(path[len("file://"):] if path.startswith("file://") else path)


def absolute(path: str | os.PathLike[str]) -> str:
    """A local path made absolute; a URI as it is (os.path.abspath would read gs://b as a relative folder)."""
    return os.fspath(path) if is_remote(os.fspath(path)) else os.path.abspath(path)


def scratch_folder(run_dir: str) -> str:
    """The local folder for a run's local-only files: `run_dir` itself when local, else one under the temporary
    folder named after the URI (the same on every launch, so a relaunch finds its service log)."""
    if not is_remote(run_dir):
        return run_dir
    return os.path.join(tempfile.gettempdir(), "drgrpo_jax_runs", re.sub(r"[^A-Za-z0-9._-]+", "_", run_dir))


def read_text(path: str) -> str | None:
    """The text of file `path`, local or remote; None when there is none."""
    file = as_epath(path)
    return file.read_text() if file.is_file() else None


def write_text(path: str, text: str) -> None:
    """Writes file `path` whole, local or remote (a bucket object is replaced at once: no appends there)."""
    as_epath(path).write_text(text)


def copy_folder(src: str, dst: str) -> None:
    """Copies folder `src` into `dst` (created; files overwritten), either side local or remote."""
    source, target = as_epath(src), as_epath(dst)
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_dir():
            copy_folder(os.fspath(item), os.fspath(target / item.name))
        else:
            item.copy(target / item.name, overwrite=True)


def remove_folder(path: str) -> None:
    """Deletes a folder and everything in it; nothing when it does not exist."""
    as_epath(path).rmtree(missing_ok=True)


def versions_in(root: str) -> list[int]:
    """The N of every v{N} folder under `root`, sorted ([] when root does not exist)."""
    folder = as_epath(root)
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
