"""`specedge-models gguf` failures that need no converter run: a full disk while the file is
written is one line naming the folder, and nothing partial stays behind."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from shared.models import make_gguf
from shared.models.catalog import ModelFetchError


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, model = tmp_path / "llama.cpp", tmp_path / "draft"
    source.mkdir()
    (source / "convert_hf_to_gguf.py").write_text("")
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setenv(make_gguf.SOURCE_ENV, str(source))

    def full(source: Path, folder: Path, outtype: str, out: Path) -> None:
        out.write_bytes(b"GGUF")  # part of the file made it
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(make_gguf, "_convert", full)
    with pytest.raises(ModelFetchError) as err:
        make_gguf.make_gguf(model, "f16", tmp_path / "cache")
    assert str(err.value) == f"the disk is full under {model}; free space for draft-f16.gguf"
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]
