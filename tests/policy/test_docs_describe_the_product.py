"""README, docs, --help texts and code describe the product as it is: no issue numbers, no
development stops, no design-seed names (history lives in git)."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HISTORY = re.compile(r"\bissues? #?\d+\b|\bstops? \d+\b|\bseed 00\d", re.IGNORECASE)


def test_no_history_in_user_facing_text() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "README.md", "docs", "*.py", "*.md", "*.sh", "*.toml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    files = [REPO / name for name in tracked if not name.startswith("tests/")]
    assert len(files) > 50  # the listing found the tree
    hits = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()[:80]}"
        for path in files
        if path.is_file()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1)
        if HISTORY.search(line)
    ]
    assert not hits, "\n".join(hits)
