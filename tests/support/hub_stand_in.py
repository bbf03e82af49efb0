"""A stand-in for the Hugging Face Hub's upload API, so pushes are tested without a network."""

import os


class StandInHub:
    """A local stand-in with HfApi's two methods push_folder calls: repos are folders under `root`."""

    def __init__(self, root):
        self.root, self.created = root, []

    def create_repo(self, *, repo_id, repo_type, private, exist_ok):
        self.created.append((repo_id, repo_type, private, exist_ok))
        os.makedirs(os.path.join(self.root, repo_id), exist_ok=exist_ok)

    def upload_folder(self, *, folder_path, repo_id, repo_type, commit_message):
        import shutil

        shutil.copytree(folder_path, os.path.join(self.root, repo_id), dirs_exist_ok=True)
        return type("CommitInfo", (), {"commit_url": f"local://{repo_id}/commit/1 {commit_message}"})()
