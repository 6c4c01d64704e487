"""Summarise edge-agent batch outputs (one JSONL per mode) into a JSON result and a table.

    python tools/summarize.py --output result.json speculative=spec.jsonl cloud_only=cloud.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any


def _load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(records: list[dict[str, Any]]) -> dict[str, float]:
    tokens = sum(len(r["token_ids"]) for r in records)
    elapsed = sum(r["elapsed_s"] for r in records)
    rounds = sum(r["rounds"] for r in records)
    drafted = sum(r["draft_tokens"] for r in records)
    return {
        "prompts": len(records),
        "output_tokens": tokens,
        "elapsed_s": round(elapsed, 2),
        "tokens_per_s": round(tokens / elapsed, 3) if elapsed else 0.0,
        # After the first token: prefill (TTFT) is the same work in every mode and dominates
        # short answers on a CPU, so the decode rate shows the speculative loop itself.
        "decode_tokens_per_s": round(sum(len(r["token_ids"]) - 1 for r in records)
                                     / max(sum(r["elapsed_s"] - r["ttft_s"] for r in records), 1e-9), 3),
        "ttft_s_mean": round(sum(r["ttft_s"] for r in records) / len(records), 2),
        "tau": round(tokens / rounds, 3) if rounds else 0.0,
        "acceptance_rate": round(sum(r["accepted_tokens"] for r in records) / drafted, 3) if drafted else 0.0,
        "target_passes_per_token": round(sum(r["target_forward_passes"] for r in records) / tokens, 3),
        # Verify payloads only; the prompt upload is counted in bytes_up_per_token.
        "verify_bytes_up_per_drafted_token": round(sum(r.get("verify_bytes_up", 0) for r in records) / drafted, 2)
        if drafted else 0.0,
        "bytes_up_per_token": round(sum(r["bytes_up"] for r in records) / tokens, 2),
        "bytes_down_per_token": round(sum(r["bytes_down"] for r in records) / tokens, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="MODE=FILE.jsonl")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--reference", default="cloud_only", help="mode whose tokens the others are compared to")
    args = parser.parse_args()
    runs = {spec.split("=", 1)[0]: _load(Path(spec.split("=", 1)[1])) for spec in args.runs}
    reference = {r["id"]: r["token_ids"] for r in runs.get(args.reference, [])}
    result: dict[str, Any] = {"machine": {"platform": platform.platform(), "processor": platform.processor()},
                              "modes": {}}
    for mode, records in runs.items():
        row = summarize(records)
        if reference and mode != args.reference:
            row["identical_to_reference"] = sum(reference.get(r["id"]) == r["token_ids"] for r in records)
        result["modes"][mode] = row
    args.output.write_text(json.dumps(result, indent=2))
    columns = list(next(iter(result["modes"].values())).keys())
    out = sys.stdout
    out.write("| mode | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns) + "\n")
    for mode, row in result["modes"].items():
        out.write(f"| {mode} | " + " | ".join(str(row.get(c, "")) for c in columns) + " |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
