"""Models by their Hugging Face Hub id: `org/name`, `org/name@revision`, or for a GGUF repo
`org/name-GGUF:pattern` (the file to take, as llama-server's `-hf repo:quant`).

An id resolves through `huggingface_hub` into its cache (`HF_HOME`, `HF_HUB_CACHE`), with the
token of `HF_TOKEN` or `hf auth login`, from `HF_ENDPOINT` when it names a mirror, and offline from the cache alone when
`HF_HUB_OFFLINE=1`. The folder it resolves to is a snapshot named by its commit, so the commit a
run used is known and printed (`describe`). Every failure a user meets is one line naming the
id and what to do: an unknown id or revision, a gated repository without a token, no network and
not in the cache, a full disk.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

from shared.models.catalog import ModelFetchError

# org/name[@revision][:file-pattern]; the org and name as the Hub allows them.
_HUB_ID = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})"
    r"(?:@(?P<rev>[\w./-]{1,100}))?(?::(?P<file>[\w.*-]{1,100}))?$"
)
# What a transformers model folder needs; weights only as safetensors (no pickles are loaded).
HF_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"]
_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class HubId:
    repo: str
    revision: str | None = None
    file_pattern: str | None = None  # GGUF repos: which file (e.g. q4_k_m)

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.repo}{rev}" + (f":{self.file_pattern}" if self.file_pattern else "")


def parse_hub_id(text: str) -> HubId | None:
    """The Hub id in `text`, or None when it does not read as one (a path, a packaged name)."""
    if text.startswith((".", "/", "~")):
        return None
    match = _HUB_ID.match(text)
    if match is None:
        return None
    return HubId(match["repo"], match["rev"], match["file"])


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hub_cache_dir() -> Path:
    """huggingface_hub's cache, read when called (so a changed environment counts)."""
    if explicit := os.environ.get("HF_HUB_CACHE"):
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def _patterns(hub_id: HubId) -> list[str]:
    if hub_id.file_pattern is None:
        return HF_FILES
    pattern = hub_id.file_pattern
    pattern = pattern if pattern.endswith(".gguf") else f"*{pattern}*.gguf"
    return sorted({pattern, pattern.lower(), pattern.upper().replace(".GGUF", ".gguf")})


def resolve(text: str) -> Path:
    """The local snapshot folder of the Hub id `text`, downloaded into the cache when needed."""
    hub_id = parse_hub_id(text)
    if hub_id is None:
        raise ModelFetchError(f"{text!r} is not a Hub id (org/name[@revision]) nor a folder")
    from huggingface_hub import snapshot_download  # imported on use: a folder path never needs it

    try:
        folder = snapshot_download(
            hub_id.repo,
            revision=hub_id.revision,
            cache_dir=hub_cache_dir(),
            local_files_only=offline(),
            allow_patterns=_patterns(hub_id),
            token=os.environ.get("HF_TOKEN") or None,
            endpoint=os.environ.get("HF_ENDPOINT") or None,  # a mirror
        )
    except Exception as err:  # every failure of the Hub client becomes one line
        raise ModelFetchError(explain(hub_id, err)) from err
    path = Path(str(folder))
    if hub_id.file_pattern is not None and not any(path.glob("*.gguf")):
        raise ModelFetchError(f"{hub_id}: no .gguf file in {hub_id.repo} matches {hub_id.file_pattern!r}")
    return path


def explain(hub_id: HubId, err: BaseException) -> str:
    """One line for a failed download: which id, what went wrong, what to do."""
    from huggingface_hub import errors

    name = str(hub_id)
    if isinstance(err, errors.GatedRepoError):
        return f"{name}: the repository is gated; accept its terms on the Hub and set HF_TOKEN (or run `hf auth login`)"
    if isinstance(err, errors.RevisionNotFoundError):
        return f"{name}: no revision {hub_id.revision!r} in {hub_id.repo}"
    if isinstance(err, errors.RepositoryNotFoundError):
        return f"{name}: no such folder here and no such model on the Hub (or it is private: set HF_TOKEN)"
    if isinstance(err, errors.LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE is set" if offline() else "the Hub cannot be reached"
        return f"{name}: not in the cache ({hub_cache_dir()}) and {why}; fetch it once where the Hub is reachable"
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return f"{name}: the disk is full under {hub_cache_dir()}; free space or set HF_HUB_CACHE elsewhere"
    detail = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
    return f"{name}: download failed: {detail}"


def describe(folder: str | Path) -> str:
    """How a model folder is named to people: `org/name@commit` for a Hub snapshot (the commit
    pins what ran), else the folder's name."""
    path = Path(folder)
    parts = path.resolve().parts if path.exists() else path.parts
    for i in range(len(parts) - 2):
        if parts[i].startswith("models--") and parts[i + 1] == "snapshots":
            repo = parts[i][len("models--") :].replace("--", "/", 1)
            return f"{repo}@{parts[i + 2][:12]}"
    return path.name
