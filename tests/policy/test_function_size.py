"""Functions stay short enough to read in one sitting: none over 60 lines, in every package of
the product and its tools (generated shared/pb aside). A module is a concept and may be long;
a function does one thing."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("edge", "cloud", "shared", "bench", "tools")
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    files = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    return [path for path in files if (ROOT / "shared" / "pb") not in path.parents]


def test_the_packages_are_scanned() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in _modules()}
    assert {"edge/round/session.py", "cloud/verifier.py", "shared/models/store.py"} <= names
    assert not any(name.startswith("shared/pb/") for name in names)


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
