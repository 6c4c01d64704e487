"""A GGUF for the edge's llama.cpp drafter, made from any Hugging Face model folder.

llama.cpp's own converter does the work: `convert_hf_to_gguf.py` with its `conversion` package
and `gguf-py`, from the llama.cpp source that llama-cpp-python's sdist carries, for exactly the
installed llama-cpp-python (so the file is one its llama.cpp loads). The source is fetched once
from PyPI with pip and cached beside the packaged models (`llama.cpp-convert-VERSION/`); on a
machine without PyPI, `SPECEDGE_LLAMA_CPP_SOURCE` names a llama.cpp checkout of that version.
The converter writes f16 or q8_0 itself; q4_k_m is llama.cpp's quantize (through
llama-cpp-python) applied to the f16 file. The result is written beside the model as
`NAME-TYPE.gguf` under a temporary name, loaded once by llama.cpp as a check, then renamed into
place, so a file with that name is always complete. The edge's auto runtime picks it up.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from shared import llamacpp
from shared.errors import ConfigError
from shared.models.catalog import ModelFetchError, log_progress

# What `--type` takes: the converter's own output types, and q4_k_m by llama.cpp's quantize.
GGUF_TYPES = ("f16", "q8_0", "q4_k_m")
CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
SOURCE_ENV = "SPECEDGE_LLAMA_CPP_SOURCE"


def gguf_path(folder: Path, gguf_type: str) -> Path:
    """Where the GGUF of `folder` in `gguf_type` goes: beside the weights."""
    return folder / f"{folder.name}-{gguf_type}.gguf"


def llama_cpp_version() -> str:
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError as err:
        raise ConfigError("making a GGUF needs llama-cpp-python (the edge extra: pip install '.[edge]')") from err


def converter_source(cache: Path) -> Path:
    """A folder holding llama.cpp's converter for the installed llama-cpp-python: the one
    SPECEDGE_LLAMA_CPP_SOURCE names, else the cached copy, fetched from PyPI on first use."""
    if explicit := os.environ.get(SOURCE_ENV):
        source = Path(explicit).expanduser()
        if not (source / "convert_hf_to_gguf.py").is_file():
            raise ConfigError(f"{SOURCE_ENV}={source}: no convert_hf_to_gguf.py there (a llama.cpp checkout is expected)")
        return source
    version = llama_cpp_version()
    final = cache / f"llama.cpp-convert-{version}"
    if all((final / name).exists() for name in CONVERTER_FILES):
        return final
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".convert-", dir=cache) as work:
        sdist = _download_sdist(version, Path(work))
        staging = Path(work) / "source"
        _extract_converter(sdist, staging)
        if not final.exists():  # else another process put it there meanwhile: the same files
            staging.replace(final)
    return final


def _download_sdist(version: str, dest: Path) -> Path:
    log_progress(f"fetching llama.cpp's converter: llama-cpp-python {version} source from PyPI (about 75 MB, once)")
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--no-binary", ":all:",
        "--disable-pip-version-check", "--quiet", "-d", str(dest), f"llama-cpp-python=={version}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    found = sorted(dest.glob(f"llama_cpp_python-{version}.tar.gz"))
    if result.returncode != 0 or not found:
        lines = (result.stderr or result.stdout).strip().splitlines()
        detail = lines[-1] if lines else f"exit code {result.returncode}"
        raise ModelFetchError(
            f"cannot fetch llama.cpp's converter (llama-cpp-python=={version} source from PyPI): {detail}; "
            f"without PyPI, set {SOURCE_ENV} to a llama.cpp checkout"
        )
    return found[0]


def _extract_converter(sdist: Path, out: Path) -> None:
    """The converter's files from the sdist's vendor/llama.cpp, nothing else (no path leaves `out`)."""
    with tarfile.open(sdist) as archive:
        members = []
        for member in archive.getmembers():
            parts = Path(member.name).parts
            if len(parts) > 3 and parts[1:3] == ("vendor", "llama.cpp") and parts[3] in CONVERTER_FILES:
                member.name = str(Path(*parts[3:]))
                members.append(member)
        if not any(m.name == "convert_hf_to_gguf.py" for m in members):
            raise ModelFetchError(f"{sdist.name} has no vendor/llama.cpp/convert_hf_to_gguf.py")
        archive.extractall(out, members=members, filter="data")


def make_gguf(folder: Path, gguf_type: str, cache: Path, replace: bool = False) -> Path:
    """The GGUF of the HF model in `folder` in `gguf_type`, made unless it is there already."""
    if gguf_type not in GGUF_TYPES:
        raise ConfigError(f"--type {gguf_type}: expected one of {', '.join(GGUF_TYPES)}")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder}: not a Hugging Face model folder (no config.json)")
    final = gguf_path(folder, gguf_type)
    if final.is_file() and not replace:
        return final
    source = converter_source(cache)
    with _staging(final) as staging:
        if gguf_type == "q4_k_m":
            f16 = staging.with_name(staging.name + ".f16")
            try:
                _convert(source, folder, "f16", f16)
                _quantize(f16, staging, gguf_type)
            finally:
                f16.unlink(missing_ok=True)
        else:
            _convert(source, folder, gguf_type, staging)
        _check_loads(staging, final)
        staging.replace(final)
    return final


@contextmanager
def _staging(final: Path) -> Iterator[Path]:
    staging = final.with_name(f".{final.name}.partial")
    try:
        yield staging
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise ModelFetchError(f"the disk is full under {final.parent}; free space for {final.name}") from err
        raise
    finally:
        staging.unlink(missing_ok=True)


def _convert(source: Path, folder: Path, outtype: str, out: Path) -> None:
    log_progress(f"{folder.name}: converting to {outtype} GGUF with llama.cpp's convert_hf_to_gguf.py")
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(source / "gguf-py"), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype, "--outfile", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, check=False, env=env, cwd=source)
    if result.returncode != 0:
        raise ModelFetchError(f"{folder.name}: llama.cpp's converter failed: {_last_error(result.stderr or result.stdout)}")


def _last_error(output: str) -> str:
    """The converter's own reason: its last line that names an error, else its last line."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def _quantize(f16: Path, out: Path, gguf_type: str) -> None:
    log_progress(f"{out.parent.name}: quantizing to {gguf_type} with llama.cpp")
    api = llamacpp.api("making a q4_k_m GGUF")
    params = api.llama_model_quantize_default_params()
    params.ftype = api.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = os.cpu_count() or 1
    if api.llama_model_quantize(str(f16).encode(), str(out).encode(), params) != 0:
        raise ModelFetchError(f"llama.cpp could not quantize {f16.name} to {gguf_type}")


def _check_loads(staging: Path, final: Path) -> None:
    api = llamacpp.api("checking a GGUF")
    try:
        model = llamacpp.load_model(api, staging)
    except ConfigError as err:
        raise ModelFetchError(f"llama.cpp cannot load the GGUF made for {final.name}: {err}") from None
    api.llama_model_free(model)
