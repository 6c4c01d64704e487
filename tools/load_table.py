"""Tabulate tools/load_sweep.sh's results: one row per configuration and session count, with
batched against unbatched and speculative against cloud_only (all from the same sweep).

    python -m tools.load_table --out OUT_DIR      # writes OUT_DIR/table.md and prints it
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.cli import settings_parser
from shared.cli import run_cli, settings_from_args


class LoadTableSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_LOAD_TABLE_")

    out: Path = Field(description="tools/load_sweep.sh's output folder (NAME.nN.json); table.md is written there")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {"the sweep": ("out",)}


def parser() -> argparse.ArgumentParser:
    return settings_parser("python -m tools.load_table", __doc__, LoadTableSettings)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run_cli("python -m tools.load_table", lambda: write_table(settings_from_args(LoadTableSettings, args).out))


def write_table(out: Path) -> int:
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    for path in sorted(out.glob("*.n*.json")):
        match = re.fullmatch(r"(.+)\.n(\d+)\.json", path.name)
        if match:
            runs[(match.group(1), int(match.group(2)))] = json.loads(path.read_text())
    header = (
        "| configuration | sessions | completed | errors | verified tok/s | rounds/s | latency p50 / p95 ms "
        "| p95 / p95 at 1 | TTFT p50 s | tau | × cloud_only (same n) | batched / unbatched |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for (name, n), r in sorted(runs.items(), key=lambda item: (item[0][0], item[0][1])):
        lat = r["verify_latency_ms"]
        single = runs.get((name, 1))
        p95_ratio = f"{lat['p95'] / single['verify_latency_ms']['p95']:.2f}" if single and lat.get("p95") else "–"
        cloud = runs.get(("cloud_only_batched", n))
        vs_cloud = (
            f"{r['verified_tokens_per_s'] / cloud['verified_tokens_per_s']:.2f}"
            if cloud and name != "cloud_only_batched" and cloud["verified_tokens_per_s"]
            else "–"
        )
        unbatched = runs.get((name.replace("_batched", "_unbatched"), n)) if name.endswith("_batched") else None
        vs_unbatched = (
            f"{r['verified_tokens_per_s'] / unbatched['verified_tokens_per_s']:.2f}"
            if unbatched and unbatched["verified_tokens_per_s"]
            else "–"
        )
        errors = ", ".join(f"{k} {v}" for k, v in r["errors_by_code"].items()) or "none"
        lines.append(
            f"| {name} | {n} | {r['sessions_completed']}/{r['sessions_planned']} | {errors} "
            f"| {r['verified_tokens_per_s']:.2f} | {r['rounds_per_s']:.2f} | {lat['p50']:.0f} / {lat['p95']:.0f} "
            f"| {p95_ratio} | {r['ttft_ms']['p50'] / 1000:.1f} | {r['tau']} | {vs_cloud} | {vs_unbatched} |"
        )
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
