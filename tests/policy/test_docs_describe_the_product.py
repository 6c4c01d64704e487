"""README, docs, --help texts and code describe the product as it is: no issue numbers, no
development stops, no design-seed names, and no bookkeeping of how it came to be (before/after
figures, old and new defaults, goals met or not, the machines or documents of its making);
history lives in git."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HISTORY = re.compile(r"\bissues? #?\d+\b|\bstops? \d+\b|\bseed 00\d", re.IGNORECASE)
BOOKKEEPING = re.compile(
    r"\bbefore:|\b(old|new) default\b|\bnot met\b|\bour machines?\b|\bthe card\b|\bthe design document\b"
    r"|\bthis session\b|\bthe former\b|\bnow the default\b|\bis pending\b",
    re.IGNORECASE,
)


def _tracked(*patterns: str) -> list[Path]:
    listed = subprocess.run(["git", "ls-files", *patterns], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / name for name in listed.split() if not name.startswith("tests/") and (REPO / name).is_file()]


def _hits(pattern: re.Pattern[str], files: list[Path]) -> list[str]:
    return [
        f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path.name}:{number}: {line.strip()[:80]}"
        for path in files
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1)
        if pattern.search(line)
    ]


def test_no_history_in_user_facing_text() -> None:
    files = _tracked("README.md", "docs", "*.py", "*.md", "*.sh", "*.toml")
    assert len(files) > 50  # the listing found the tree
    hits = _hits(HISTORY, files)
    assert not hits, "\n".join(hits)


def test_readme_and_docs_keep_no_bookkeeping() -> None:
    files = [p for p in _tracked("README.md", "docs/*.md", "bench/*.md", "bench/data/README.md") if p.name.endswith(".md")]
    assert len(files) > 8
    hits = _hits(BOOKKEEPING, files)
    assert not hits, "\n".join(hits)


def test_bookkeeping_phrasings_are_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("fine text\nall served (before: 0 of 24)\n| hybrid, old default |\n**goal: not met**\nfrom our machines\n")
    assert [hit.split(":")[1] for hit in _hits(BOOKKEEPING, [page])] == ["2", "3", "4", "5"]
