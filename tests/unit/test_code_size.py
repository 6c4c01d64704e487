"""Hand-written modules stay small enough to read in one sitting: no module over 350 lines,
no function over 60, in every package of the product and its tools (generated shared/pb aside)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("edge", "cloud", "shared", "bench", "tools")
MAX_MODULE_LINES = 350
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    files = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    return [path for path in files if (ROOT / "shared" / "pb") not in path.parents]


def test_the_packages_are_scanned() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in _modules()}
    assert {"edge/rounds.py", "cloud/verifier.py", "shared/speculative.py", "tools/model_store.py"} <= names
    assert not any(name.startswith("shared/pb/") for name in names)


def test_no_module_is_too_long() -> None:
    long = {}
    for path in _modules():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            long[path.relative_to(ROOT).as_posix()] = lines
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them along a seam): {long}"


def test_no_function_is_too_long() -> None:
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT).as_posix()}:{node.lineno} {node.name}"] = length
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (extract the parts they do): {long}"
