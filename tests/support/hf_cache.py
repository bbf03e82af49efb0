"""A temporary Hugging Face cache in the layout huggingface_hub writes (`models--org--name/`,
`datasets--org--name/`, each with blobs/<sha256>, refs/<branch> and snapshots/<commit>/ linking into blobs/), and
the settings that make one process read it alone, offline."""

from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def commit(cache: pathlib.Path, repo_type: str, repo_id: str, sha: str, refs: Sequence[str],
           write: Callable[[str], Any]) -> str:
    """Writes one commit of a repo into `cache` (HF_HUB_CACHE): `write(folder)` fills a staging folder whose
    files become blobs/<sha256> with snapshots/<sha>/<path> symlinks to them; each ref names the commit. Returns
    the snapshot folder."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    staging = repo / "staging" / sha
    staging.mkdir(parents=True)
    write(str(staging))
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / sha / path.relative_to(staging)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(sha)
    for path in sorted(staging.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    staging.rmdir()
    (repo / "staging").rmdir()
    return str(repo / "snapshots" / sha)


def write_parquet_dataset(folder: str, rows: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]]) -> None:
    """`rows[subset][split]` as <subset>/<split>-00000-of-00001.parquet files, and the README's `configs:` that the
    Hub and `datasets` read (how datasets converted to Parquet on the Hub are laid out)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    card = ["---", "configs:"]
    for subset, splits in rows.items():
        card += [f"- config_name: {subset}", "  data_files:"]
        os.makedirs(os.path.join(folder, subset), exist_ok=True)
        for split, split_rows in splits.items():
            pq.write_table(pa.Table.from_pylist(list(split_rows)),
                           os.path.join(folder, subset, f"{split}-00000-of-00001.parquet"))
            card += [f"  - split: {split}", f"    path: {subset}/{split}-*"]
    pathlib.Path(folder, "README.md").write_text("\n".join(card + ["---", ""]))


def read_only_offline(monkeypatch, home: str) -> None:
    """This process reads only the cache under `home` (HF_HOME), offline; huggingface_hub and datasets read
    their settings at import, so their constants are set too."""
    import datasets.config
    import huggingface_hub.constants

    hub = os.path.join(home, "hub")
    for name, value in [("HF_HOME", home), ("HF_HUB_CACHE", hub), ("HF_HUB_OFFLINE", "1"),
                        ("HF_DATASETS_CACHE", os.path.join(home, "datasets"))]:
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", hub)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", pathlib.Path(home, "datasets"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
