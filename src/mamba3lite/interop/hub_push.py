"""`export --push-to-hub REPO`: upload an exported directory to the Hugging Face Hub.

    url = push_to_hub(Path("exported/tiny-hf"), "me/mamba3-tiny")

Through huggingface_hub's `HfApi` (its token: `HF_TOKEN` or `huggingface-cli login`): the model
repository is created when absent (private if asked), then the directory is uploaded as one commit.
A failure (no token, no network, no rights) is one CheckpointError carrying the hub's first line; the
local directory stays as written.
"""

from __future__ import annotations

from pathlib import Path

from mamba3lite.errors import CheckpointError, ConfigError


def push_to_hub(directory: Path, repo_id: str, *, private: bool = False) -> str:
    """Upload `directory` to model repository `repo_id` ("owner/name"); returns the commit's URL."""
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ConfigError(f"--push-to-hub takes a repository as OWNER/NAME, got {repo_id!r}")
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise ConfigError(
            "--push-to-hub needs the package huggingface_hub; fix: pip install 'mamba3lite[hf]'"
        ) from None
    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        info = api.upload_folder(
            folder_path=str(directory),
            repo_id=repo_id,
            repo_type="model",
            commit_message=f"mamba3lite export ({directory.name})",
        )
    except Exception as e:  # auth, network, rights: the hub's message says which
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot upload {directory} to hf:{repo_id} ({first})") from None
    return str(getattr(info, "commit_url", None) or f"https://huggingface.co/{repo_id}")
