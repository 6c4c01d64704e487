"""Numbers from per-prompt records: per-request metrics, percentiles, and a run's summary.

Records are edge-agent's `--prompts` output lines (or bench.hf_runner's, same shape); round
logs are `--log-rounds` lines (k and accepted_len per round). The CLI writes one table from
several JSONL files, one per mode.

    python -m bench.summarize --output result.json --run speculative=spec.jsonl --run cloud_only=cloud.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.cli import settings_parser
from shared.cli import run_cli, settings_from_args


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def _speculative_tokens(record: dict[str, Any]) -> int:
    """The tokens a generation's speculative rounds committed (all of them outside auto mode)."""
    by_mode = record.get("tokens_by_mode")
    return int(by_mode.get("speculative", 0)) if by_mode else len(record["token_ids"])


def acceptance_by_position(rounds: Sequence[dict[str, Any]]) -> list[float]:
    """Rate at draft position i = rounds that accepted position i / rounds that drafted it
    (k > i), the verifier's live-page definition. Locally committed blocks (lossy) never
    reached the cloud and are left out."""
    verified = [r for r in rounds if not r.get("local", False)]
    longest = max((int(r["k"]) for r in verified), default=0)
    rates = []
    for position in range(longest):
        drafted = sum(1 for r in verified if int(r["k"]) > position)
        accepted = sum(1 for r in verified if int(r["accepted_len"]) > position)
        rates.append(accepted / drafted)
    return rates


ROUND_TIME_FIELDS = ("round_draft_ms", "round_verify_ms", "round_wire_ms", "verify_ms_per_position", "draft_ms_per_token")


def round_time(rounds: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Where a verified round's time goes (the profile behind the speedups), mean ms per round:
    drafting on the edge, the verifier's own time (queue, forward, accept) and the rest of the
    Verify call (wire, serialization, added RTT). Per position: the verifier's ms over the rows
    it verified (block + the last committed token), to set beside one decode step; per drafted
    token: the edge's drafting time over the tokens it drafted (the draft cost c, over a step)."""
    timed = [r for r in rounds if not r.get("local", False) and "cloud_verify_ms" in r]
    if not timed:
        return dict.fromkeys(ROUND_TIME_FIELDS)
    verify_ms = sum(r["cloud_verify_ms"] for r in timed)
    return {
        "round_draft_ms": sum(r["edge_time_ms"] for r in timed) / len(timed),
        "round_verify_ms": verify_ms / len(timed),
        "round_wire_ms": sum(r["rtt_ms"] - r["cloud_verify_ms"] for r in timed) / len(timed),
        "verify_ms_per_position": verify_ms / sum(int(r["k"]) + 1 for r in timed),
        "draft_ms_per_token": ratio(sum(r["edge_time_ms"] for r in timed), sum(int(r["k"]) for r in timed)),
    }


def summarize(records: Sequence[dict[str, Any]], rounds: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """One run (or one task of it): totals-based rates, p50/p95 of the latencies. In auto mode
    the round figures (tau, acceptance, round time) are the speculative rounds' alone: the
    target's own stretches are records of the round log too."""
    rounds = [r for r in rounds if r.get("mode") != "cloud_only"]
    tokens = sum(len(r["token_ids"]) for r in records)
    elapsed = sum(r["elapsed_s"] for r in records)
    round_count = sum(r.get("rounds", 0) for r in records)
    drafted = sum(r.get("draft_tokens", 0) for r in records)
    ttfts = [r["ttft_s"] for r in records]
    latencies = [r["elapsed_s"] for r in records]
    per_request_rate = [len(r["token_ids"]) / r["elapsed_s"] for r in records if r["elapsed_s"] > 0]
    thrown = sum(r.get("ahead_drafted", 0) - r.get("ahead_used", 0) for r in records)
    return {
        "requests": len(records),
        "output_tokens": tokens,
        "elapsed_s": elapsed,
        "tokens_per_s": ratio(tokens, elapsed),
        # After the first token: prefill (TTFT) is the same work in every system and dominates
        # short answers on a CPU, so the decode rate shows the decoding loop itself.
        "decode_tokens_per_s": ratio(
            sum(max(len(r["token_ids"]) - 1, 0) for r in records), sum(r["elapsed_s"] - r["ttft_s"] for r in records)
        ),
        "tokens_per_s_p50": percentile(per_request_rate, 50),
        "ttft_s_p50": percentile(ttfts, 50),
        "ttft_s_p95": percentile(ttfts, 95),
        "latency_s_p50": percentile(latencies, 50),
        "latency_s_p95": percentile(latencies, 95),
        "tau": ratio(sum(_speculative_tokens(r) for r in records), round_count),
        "mean_k": ratio(drafted, round_count),  # drafts per Verify round: the k the policy chose
        "acceptance_rate": ratio(sum(r.get("accepted_tokens", 0) for r in records), drafted),
        "acceptance_by_position": acceptance_by_position(rounds),
        "target_passes_per_token": ratio(sum(r["target_forward_passes"] for r in records), tokens),
        "cloud_call_ratio": ratio(round_count, tokens),
        "bytes_up_per_token": ratio(sum(r.get("bytes_up", 0) for r in records), tokens),
        "bytes_down_per_token": ratio(sum(r.get("bytes_down", 0) for r in records), tokens),
        # Verify payloads only; the prompt upload is in bytes_up_per_token.
        "verify_bytes_up_per_drafted_token": ratio(sum(r.get("verify_bytes_up", 0) for r in records), drafted),
        "thrown_away_per_token": ratio(thrown, tokens),
        "kv_peak_bytes": max((r["kv_peak_bytes"] for r in records if r.get("kv_peak_bytes") is not None), default=None),
    } | round_time(rounds)


def identical_count(records: Sequence[dict[str, Any]], reference: dict[str, list[int]]) -> int:
    """Requests whose tokens equal the reference's, token for token."""
    return sum(reference.get(r["id"]) == r["token_ids"] for r in records)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's end where one goes
    on past the other), or None where they are equal."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class SummarizeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_SUMMARIZE_")

    run: list[str] = Field(min_length=1, description="MODE=FILE.jsonl, one per mode (repeat the flag)")
    reference: str = Field("cloud_only", description="mode whose tokens the others are compared to")
    output: Path = Field(description="the table as JSON")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "the runs": ("run", "reference"),
        "output": ("output",),
    }


def parser() -> argparse.ArgumentParser:
    return settings_parser("python -m bench.summarize", __doc__, SummarizeSettings)


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items() if k != "acceptance_by_position"}


def _table(args: SummarizeSettings) -> int:
    runs = {spec.split("=", 1)[0]: load_jsonl(Path(spec.split("=", 1)[1])) for spec in args.run}
    reference = {r["id"]: r["token_ids"] for r in runs.get(args.reference, [])}
    result: dict[str, Any] = {"machine": {"platform": platform.platform(), "processor": platform.processor()}, "modes": {}}
    for mode, records in runs.items():
        row = _rounded(summarize(records))
        if reference and mode != args.reference:
            row["identical_to_reference"] = identical_count(records, reference)
        result["modes"][mode] = row
    args.output.write_text(json.dumps(result, indent=2))
    columns = list(next(iter(result["modes"].values())).keys())
    out = sys.stdout
    out.write("| mode | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns) + "\n")
    for mode, row in result["modes"].items():
        out.write(f"| {mode} | " + " | ".join(str(row.get(c, "")) for c in columns) + " |\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run_cli("python -m bench.summarize", lambda: _table(settings_from_args(SummarizeSettings, args)))


if __name__ == "__main__":
    sys.exit(main())
