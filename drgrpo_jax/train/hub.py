"""`run.push_to_hub`: the final policy (an HF folder) uploaded to a Hugging Face Hub model repo.

The token is huggingface_hub's own (HF_TOKEN, or `huggingface-cli login`); HF_ENDPOINT points it at
another Hub (a private mirror). The check runs at set-up, so an offline machine fails before training.
"""

from __future__ import annotations

import os
from typing import Any

from drgrpo_jax.errors import ConfigError

__all__ = ["check_hub", "push_folder"]


def check_hub(repo_id: str | None) -> None:
    """ConfigError naming run.push_to_hub when the upload could not happen at the end of the run."""
    if repo_id is None:
        return
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ConfigError("run.push_to_hub", "HF_HUB_OFFLINE is set, so the final policy could not be uploaded "
                                             "(unset it, or set run.push_to_hub=null)")
    import importlib.util

    if importlib.util.find_spec("huggingface_hub") is None:
        raise ConfigError("run.push_to_hub", "huggingface_hub is not installed: pip install 'huggingface_hub>=0.34'")


def push_folder(folder: str, repo_id: str, *, private: bool = True, commit_message: str = "", api: Any = None
                ) -> str:
    """Creates `repo_id` if needed and uploads `folder` as one commit; returns the commit's URL.

    `api`: an `huggingface_hub.HfApi` (None = a default one; tests pass a stand-in with the same methods).
    """
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"push_folder: {folder!r} is not an HF model folder (no config.json)")
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    commit = api.upload_folder(folder_path=folder, repo_id=repo_id, repo_type="model",
                               commit_message=commit_message or f"drgrpo_jax: {os.path.basename(folder)}")
    return str(getattr(commit, "commit_url", commit))
