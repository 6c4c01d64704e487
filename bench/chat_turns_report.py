"""What `python -m bench.chat_turns` measured: the per-turn summary over its repeats (medians)
and its Markdown report."""

from __future__ import annotations

import statistics
from typing import Any

from bench.environment import machine_line


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def max_over_first(ttfts: list[float | None]) -> float | None:
    """The largest TTFT of turns 2 and after over turn 1's: how much a longer history costs."""
    later = [t for t in ttfts[1:] if t is not None]
    return _ratio(max(later), ttfts[0]) if later and ttfts else None


def summarize(conversations: list[dict[str, Any]]) -> dict[str, Any]:
    """Per turn, medians over the repeats; the headline from those medians and per repeat."""
    rows = []
    for index in range(len(conversations[0]["turns"]) if conversations else 0):
        turns = [c["turns"][index] for c in conversations]
        rows.append(
            {
                "turn": index + 1,
                "prompt_tokens": _median([t["prompt_tokens"] for t in turns]),
                "ttft_s": _median([t["ttft_s"] for t in turns]),
                "total_s": _median([t["total_s"] for t in turns]),
                "completion_tokens": _median([t["completion_tokens"] for t in turns]),
                "decode_tokens_per_s": _median([t["decode_tokens_per_s"] for t in turns]),
            }
        )
    first = rows[0]["ttft_s"] if rows else None
    for row in rows:
        row["ttft_over_turn1"] = _ratio(row["ttft_s"], first)
    return {
        "turns": rows,
        "max_ttft_over_turn1": max_over_first([row["ttft_s"] for row in rows]),
        "max_ttft_over_turn1_by_repeat": [max_over_first([t["ttft_s"] for t in c["turns"]]) for c in conversations],
    }


def _cell(value: float | None, digits: int = 0, scale: float = 1.0) -> str:
    return "–" if value is None else f"{value * scale:,.{digits}f}"


def _counter_lines(conversations: list[dict[str, Any]]) -> list[str]:
    """The reuse counters' increase per turn, of the first repeat, where any was read."""
    turns = conversations[0]["turns"] if conversations else []
    series = sorted({f"{side}: {name}" for t in turns for side, found in t["counters"].items() for name in found or {}})
    if not series:
        return ["No `reused` or `prefilled` counters were read (no /metrics address, or none exposes them).", ""]
    lines = [
        "Reuse counters, increase over each turn (first repeat):",
        "",
        "| turn | " + " | ".join(f"`{s}`" for s in series) + " |",
        "|---|" + "---|" * len(series),
    ]
    for t in turns:
        cells = []
        for entry in series:
            side, name = entry.split(": ", 1)
            cells.append(_cell((t["counters"].get(side) or {}).get(name)))
        lines.append(f"| {t['turn']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def markdown(result: dict[str, Any]) -> str:
    s, summary = result["settings"], result["summary"]
    where = (
        f"against `{s['serve']}`" if s["serve"] != "started" else f"mode {s['mode']}, verifier engine {s['engine'] or s['cloud']}"
    )
    lines = [
        "# Multi-turn chat: time to first token as the history grows",
        "",
        f"{s['turns']} turns x {s['repeats']} repeats, max_tokens {s['max_new_tokens']}, temperature {s['temperature']}, "
        f"{where}; each turn resends the whole conversation. {machine_line(result['machine'])}, {result['date']}.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"**Max TTFT of turns >= 2 over turn 1's: {_cell(summary['max_ttft_over_turn1'], 2)}x** "
        f"(per repeat: {', '.join(_cell(r, 2) for r in summary['max_ttft_over_turn1_by_repeat'])}).",
        "",
        "| turn | prompt tokens | TTFT (ms) | TTFT / turn 1 | total (ms) | tokens | tok/s after the first |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in summary["turns"]:
        lines.append(
            f"| {row['turn']} | {_cell(row['prompt_tokens'])} | {_cell(row['ttft_s'], 0, 1000)} | "
            f"{_cell(row['ttft_over_turn1'], 2)} | {_cell(row['total_s'], 0, 1000)} | {_cell(row['completion_tokens'])} | "
            f"{_cell(row['decode_tokens_per_s'], 1)} |"
        )
    medians = " (medians over the repeats)" if s["repeats"] > 1 else ""
    return "\n".join([*lines, "", f"Times{medians}.", "", *_counter_lines(result["repeats"])])
