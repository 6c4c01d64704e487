"""One report of a parity run (tools/parity.sh): the verifier's vLLM engine against vLLM alone, from
the studies' results under OUT_DIR, each beside its goal.

- streams/SYSTEM-tT-N/stream_parity.json: target-only streams on one server (vllm_alone or
  cloud_only) at temperature T, the Nth time it was up; a level's tokens/s is the median of every
  run of it, its TTFT and TPOT the median of each time's median run;
- served_rounds/served_rounds.json, step_overhead/vllm_step_overhead.json and
  live_rounds/vllm_live_rounds.json as those studies wrote them.

Writes OUT_DIR/parity.json and OUT_DIR/report.md.

    python -m bench.studies.parity_report OUT_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.environment import machine_line, provenance, write_result
from shared.cli import run_cli
from shared.errors import ConfigError

SYSTEMS = ("vllm_alone", "cloud_only")
GOALS = {  # what each comparison should reach
    "tok_s": 0.95,  # cloud_only / vllm_alone, at least
    "ttft": 1.2,  # cloud_only / vllm_alone, at most
    "step": 1.1,  # the live step / a plain vLLM step, at most
    "round_one_ms": 1.0,  # a served round at one session: the engine's round + this, at most
    "round_many": 1.2,  # a served round at more sessions / the engine's round, at most
}


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def streams(out: Path) -> dict[str, dict[int, dict[str, dict[str, float]]]]:
    """temperature -> streams -> system -> tok/s, TTFT and TPOT (medians over every time it was up)."""
    pooled: dict[str, dict[int, dict[str, list[dict[str, Any]]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for path in sorted((out / "streams").glob("*/stream_parity.json")):
        system, _, rest = path.parent.name.partition("-t")
        temperature = rest.rpartition("-")[0]
        result = json.loads(path.read_text())
        for row in result["rows"]:
            for name in result["systems"]:
                pooled[temperature][row["streams"]][system].append(row[name])
    found: dict[str, dict[int, dict[str, dict[str, float]]]] = {}
    for temperature, levels in pooled.items():
        found[temperature] = {}
        for count, systems in sorted(levels.items()):
            found[temperature][count] = {
                system: {
                    "tok_s": statistics.median(t for run in runs for t in run["tok_s_runs"]),
                    "ttft_ms": statistics.median(run["ttft_ms_median"] for run in runs),
                    "tpot_ms": statistics.median(run["tpot_ms_median"] for run in runs),
                    "times_up": len(runs),
                }
                for system, runs in systems.items()
            }
    return found


def _rows(rows: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A study's rows as build() kept them, in the shape its JSON has (None: the study did not run)."""
    return None if rows is None else {"rows": rows}


def _mark(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _stream_lines(found: dict[str, dict[int, dict[str, dict[str, float]]]]) -> list[str]:
    lines = []
    for temperature, levels in sorted(found.items()):
        label = "greedy" if float(temperature) == 0 else f"temperature {temperature}, top-p 0.95"
        lines += [
            f"### Target-only streams, {label}",
            "",
            "| streams | vLLM alone tok/s | cloud_only tok/s | ratio (goal ≥ 0.95x) | TTFT vLLM alone / cloud_only, ms "
            "| TTFT ratio (goal ≤ 1.2x) | TPOT vLLM alone / cloud_only, ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for count, systems in levels.items():
            if not all(s in systems for s in SYSTEMS):
                continue
            alone, ours = systems["vllm_alone"], systems["cloud_only"]
            ratio, ttft = ours["tok_s"] / alone["tok_s"], ours["ttft_ms"] / alone["ttft_ms"]
            lines.append(
                f"| {count} | {alone['tok_s']:,.0f} | {ours['tok_s']:,.0f} | {ratio:.2f}x {_mark(ratio >= GOALS['tok_s'])} "
                f"| {alone['ttft_ms']:.0f} / {ours['ttft_ms']:.0f} | {ttft:.2f}x {_mark(ttft <= GOALS['ttft'])} "
                f"| {alone['tpot_ms']:.2f} / {ours['tpot_ms']:.2f} |"
            )
        lines.append("")
    return lines


def _step_lines(result: dict[str, Any] | None) -> list[str]:
    if result is None:
        return []
    lines = [
        "### A vLLM step with nothing served",
        "",
        "| requests | plain vLLM step, ms | the verifier's live step, ms | live / plain (goal ≤ 1.1x) |",
        "|---|---|---|---|",
    ]
    for row in result["rows"]:
        ratio = row["live_over_plain"]
        met = _mark(ratio <= GOALS["step"])
        lines.append(f"| {row['requests']} | {row['plain_ms']:.2f} | {row['live_ms']:.2f} | {ratio:.2f}x {met} |")
    return [*lines, ""]


def _round_lines(served: dict[str, Any] | None, live: dict[str, Any] | None) -> list[str]:
    lines = []
    if served is not None:
        lines += [
            "### A served k = 4 round from the edge's side",
            "",
            "| sessions | round trip over gRPC, ms | the engine's round, ms | serving, ms | the transport alone, ms "
            "| goal | met |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in served["rows"]:
            one = row["sessions"] == 1
            goal = f"≤ engine + {GOALS['round_one_ms']:g} ms" if one else f"≤ {GOALS['round_many']:g}x engine"
            ok = row["serving_ms"] <= GOALS["round_one_ms"] if one else row["trip_over_engine"] <= GOALS["round_many"]
            transport = f"{row['transport_ms']:.2f}" if "transport_ms" in row else "–"
            lines.append(
                f"| {row['sessions']} | {row['round_trip_ms']:.2f} | {row['engine_ms']:.2f} | {row['serving_ms']:.2f} "
                f"| {transport} | {goal} | {_mark(ok)} |"
            )
        lines += [
            "",
            "The transport alone: a message's round trip on an open gRPC call to an echo process, after a pause "
            "as long as the engine's round: the floor under the serving on this machine.",
            "",
        ]
    if live is not None:
        lines += [
            "### A k = 4 round on the live sessions against a decode step (in process)",
            "",
            "| sessions | decode step, ms | k = 4 round, ms | round / step |",
            "|---|---|---|---|",
        ]
        for row in live["rows"]:
            lines.append(f"| {row['sessions']} | {row['step_ms']:.2f} | {row['round_ms']:.2f} | {row['round_over_step']:.2f}x |")
        lines.append("")
    return lines


def build(out: Path) -> dict[str, Any]:
    found = streams(out)
    served = _read(out / "served_rounds" / "served_rounds.json")
    step = _read(out / "step_overhead" / "vllm_step_overhead.json")
    live = _read(out / "live_rounds" / "vllm_live_rounds.json")
    if not found and served is None and step is None and live is None:
        raise ConfigError(f"{out} holds no parity results (tools/parity.sh writes them)")
    return {
        "provenance": provenance(f"python -m bench.studies.parity_report {out}"),
        "goals": GOALS,
        "streams": {t: {str(n): s for n, s in levels.items()} for t, levels in found.items()},
        "served_rounds": served["rows"] if served else None,
        "step_overhead": step["rows"] if step else None,
        "live_rounds": live["rows"] if live else None,
    }


def report(result: dict[str, Any]) -> str:
    found = {t: {int(n): s for n, s in levels.items()} for t, levels in result["streams"].items()}
    lines = [
        "# The verifier's vLLM engine against vLLM alone",
        "",
        f"{machine_line(result['provenance']['machine'])}; vLLM {result['provenance']['versions']['vllm']}. "
        "Each server measured alone (the others stopped), the two taking turns.",
        "",
        *_stream_lines(found),
        *_round_lines(_rows(result["served_rounds"]), _rows(result["live_rounds"])),
        *_step_lines(_rows(result["step_overhead"])),
    ]
    return "\n".join([*lines, "Each study's own report and command: the folders beside this file.", ""])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise ConfigError("usage: python -m bench.studies.parity_report OUT_DIR")
    out = Path(args[0])
    result = build(out)
    write_result(out, "parity", result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("python -m bench.studies.parity_report", main))
