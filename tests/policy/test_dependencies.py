"""Dependencies point one way: the product (edge, cloud, shared) imports nothing from the
repository's tools, benchmarks or tests, and the edge never imports the verifier."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported_packages(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _offenders(package: str, forbidden: set[str]) -> dict[str, set[str]]:
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _imported_packages(path) & forbidden
        if bad:
            found[path.relative_to(ROOT).as_posix()] = bad
    return found


def test_the_product_imports_no_tools_benchmarks_or_tests() -> None:
    for package in ("edge", "cloud", "shared"):
        assert not _offenders(package, {"tools", "bench", "tests"}), package


def test_the_edge_never_imports_the_verifier() -> None:
    assert not _offenders("edge", {"cloud"})


def test_shared_imports_neither_side() -> None:
    assert not _offenders("shared", {"edge", "cloud"})


def test_tools_import_no_tests() -> None:
    assert not _offenders("tools", {"tests"})
    assert not _offenders("bench", {"tests"})


def test_a_forbidden_import_is_found(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom tools.x import y\nfrom . import z\n")
    assert _imported_packages(module) == {"os", "tools"}
