"""The Markdown report and its PNG plots, from a result document alone (so a saved result
can be re-reported)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a server or in CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from bench.systems import CLOUD_ONLY  # noqa: E402
from bench.tasks import sampling_label  # noqa: E402


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def where(run: dict[str, Any]) -> str:
    """The network a run saw; in-process and edge-local systems never cross it."""
    return "no network" if run["rtt_ms"] is None else f"+{run['rtt_ms']:g} ms"


def label(run: dict[str, Any], placements: int) -> str:
    base = f"{run['system']} ({where(run)})"
    return f"{base} [{run['placement']}]" if placements > 1 else base


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _mib(value: int | None) -> str:
    if value is None:
        return "–"
    return fmt(value / 2**20, 1 if value >= 2**20 else 4)


def overall_table(runs: Sequence[dict[str, Any]]) -> str:
    header = [
        "system",
        "placement",
        "link",
        "tok/s",
        "decode tok/s",
        "TTFT p50 / p95 s",
        "latency p50 / p95 s",
        "tau",
        "mean k",
        "accept",
        "target passes / tok",
        "cloud calls / tok",
        "bytes up / tok",
        "bytes down / tok",
        "Verify bytes up / drafted",
        "thrown away / tok",
        "peak RSS MiB (proc / verifier)",
        "peak KV MiB",
        "same as target-only",
    ]
    rows = []
    for run in runs:
        s, p = run["summary"], run["process"]
        identical = run["identical_to_target_only"]
        rows.append(
            [
                run["system"],
                run["placement"],
                where(run),
                fmt(s["tokens_per_s"]),
                fmt(s["decode_tokens_per_s"]),
                f"{fmt(s['ttft_s_p50'])} / {fmt(s['ttft_s_p95'])}",
                f"{fmt(s['latency_s_p50'])} / {fmt(s['latency_s_p95'])}",
                fmt(s["tau"]),
                fmt(s.get("mean_k")),
                fmt(s["acceptance_rate"]),
                fmt(s["target_passes_per_token"], 3),
                fmt(s["cloud_call_ratio"], 3),
                fmt(s["bytes_up_per_token"], 1),
                fmt(s["bytes_down_per_token"], 1),
                fmt(s["verify_bytes_up_per_drafted_token"], 1),
                fmt(s["thrown_away_per_token"]),
                f"{fmt(p['peak_rss_mib'], 0)} / {fmt(p['verifier_peak_rss_mib'], 0)}",
                _mib(s["kv_peak_bytes"]),
                "–" if identical is None else f"{identical}/{s['requests']}",
            ]
        )
    return _table(header, rows)


def ratio_table(runs: Sequence[dict[str, Any]]) -> str:
    header = ["system", "placement", "link", "tok/s", "× target-only", "× hf-assisted", "× cloud_only (same link)"]
    rows = []
    for run in runs:
        r = run["ratios"]
        if not r:
            continue
        rows.append(
            [
                run["system"],
                run["placement"],
                where(run),
                fmt(run["summary"]["tokens_per_s"]),
                fmt(r.get("vs_target_only")),
                fmt(r.get("vs_hf_assisted")),
                fmt(r.get("vs_cloud_only")),
            ]
        )
    return _table(header, rows) if rows else "(no reference system in this run)\n"


def task_table(runs: Sequence[dict[str, Any]]) -> str:
    header = ["system", "placement", "link", "task", "prompts", "tok/s", "tau", "accept", "target passes / tok"]
    rows = []
    for run in runs:
        for task, s in run["per_task"].items():
            rows.append(
                [
                    run["system"],
                    run["placement"],
                    where(run),
                    task,
                    str(s["requests"]),
                    fmt(s["tokens_per_s"]),
                    fmt(s["tau"]),
                    fmt(s["acceptance_rate"]),
                    fmt(s["target_passes_per_token"], 3),
                ]
            )
    return _table(header, rows)


def round_time_table(runs: Sequence[dict[str, Any]]) -> str:
    """The profile of a round beside cloud_only's decode step on the same link: when verifying a
    position costs about one decode step, a round of k drafts costs about k + 1 steps."""
    step_ms = {
        (r["placement"], r["rtt_ms"]): 1000 / r["summary"]["decode_tokens_per_s"]
        for r in runs
        if r["system"] == CLOUD_ONLY and r["summary"]["decode_tokens_per_s"]
    }
    header = [
        "system",
        "placement",
        "link",
        "tau",
        "draft ms / round",
        "verifier ms / round",
        "wire ms / round",
        "verifier ms / position",
        "cloud_only ms / token",
        "position / cloud_only token",
        "draft ms / token",
        "c = draft token / cloud_only token",
    ]
    rows = []
    for run in runs:
        s = run["summary"]
        if s.get("round_verify_ms") is None:
            continue
        step = step_ms.get((run["placement"], run["rtt_ms"]))
        per_position, per_draft = s["verify_ms_per_position"], s.get("draft_ms_per_token")
        rows.append(
            [
                run["system"],
                run["placement"],
                where(run),
                fmt(s["tau"]),
                fmt(s["round_draft_ms"], 0),
                fmt(s["round_verify_ms"], 0),
                fmt(s["round_wire_ms"], 0),
                fmt(per_position, 0),
                fmt(step, 0),
                fmt(per_position / step if step else None),
                fmt(per_draft, 1),
                fmt(per_draft / step if step and per_draft is not None else None),
            ]
        )
    return _table(header, rows) if rows else "No timed rounds in this run.\n"


def position_table(runs: Sequence[dict[str, Any]]) -> str:
    with_rates = [r for r in runs if r["summary"]["acceptance_by_position"]]
    if not with_rates:
        return "(no drafting system in this run)\n"
    width = max(len(r["summary"]["acceptance_by_position"]) for r in with_rates)
    header = ["system", "placement", "link", *[f"pos {i}" for i in range(width)]]
    rows = []
    for run in with_rates:
        rates = run["summary"]["acceptance_by_position"]
        rows.append([run["system"], run["placement"], where(run), *[fmt(x) for x in rates], *["–"] * (width - len(rates))])
    return _table(header, rows)


def _titled(fig: Any, title: str, machine: str) -> None:
    """The figure's title and, wrapped to the figure's width, the machine it was measured on."""
    width_chars = int(fig.get_figwidth() * 14)  # about 14 characters of 9-point text per inch
    fig.suptitle("\n".join([title, *textwrap.wrap(machine, width_chars)]), fontsize=9)


def _legend_beside(ax: Any, **kwargs: Any) -> None:
    """The legend right of the axes, where it covers no bar and no line."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=7, **kwargs)


def _save(fig: Any, path: Path) -> None:
    """Saved with every title, tick label and outside legend inside the image."""
    fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)


def _line_looks(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run's line: its own colour (20 before one repeats) and one dash per link (no network
    and the first RTT solid), so rows at another RTT read apart even where colours are close."""
    links = sorted({r["rtt_ms"] for r in runs if r["rtt_ms"] is not None})
    dashes = ["-", "--", ":", "-."]
    style = {None: "-", **{rtt: dashes[i % len(dashes)] for i, rtt in enumerate(links)}}
    colors = [plt.get_cmap("tab20")(i) for i in range(20)]  # its 20 distinct colours
    return [{"color": colors[i % len(colors)], "linestyle": style[run["rtt_ms"]]} for i, run in enumerate(runs)]


def plot_tokens_per_s(runs: Sequence[dict[str, Any]], placements: int, path: Path, machine: str) -> None:
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(runs) + 2), 4.2))
    names = [label(r, placements) for r in runs]
    values = [r["summary"]["tokens_per_s"] or 0.0 for r in runs]
    # One colour per link (grey: no network), so +0 and +50 ms rows are told apart at a glance.
    links = sorted({r["rtt_ms"] for r in runs if r["rtt_ms"] is not None})
    colors = ["#888888" if r["rtt_ms"] is None else f"C{links.index(r['rtt_ms']) % 10}" for r in runs]
    ax.bar(range(len(runs)), values, color=colors)
    handles = [Patch(color=f"C{i % 10}", label=f"+{rtt:g} ms RTT") for i, rtt in enumerate(links)]
    if any(r["rtt_ms"] is None for r in runs):
        handles.insert(0, Patch(color="#888888", label="no network"))
    _legend_beside(ax, handles=handles)
    ax.set_xticks(range(len(runs)), names, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("output tokens / s (end to end)")
    _titled(fig, "tokens/s by system and RTT", machine)
    _save(fig, path)


def plot_acceptance(runs: Sequence[dict[str, Any]], placements: int, path: Path, machine: str) -> None:
    drafting = [r for r in runs if r["summary"]["tau"] is not None]
    fig, (tau_ax, pos_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    tau_ax.bar(range(len(drafting)), [r["summary"]["tau"] for r in drafting], color="C0")
    tau_ax.set_xticks(range(len(drafting)), [label(r, placements) for r in drafting], rotation=60, ha="right", fontsize=8)
    tau_ax.set_ylabel("tau: output tokens per target round")
    for run, look in zip(drafting, _line_looks(drafting), strict=True):
        rates = run["summary"]["acceptance_by_position"]
        if rates:
            pos_ax.plot(range(len(rates)), rates, marker="o", label=label(run, placements), **look)
    pos_ax.set_xlabel("draft position")
    pos_ax.set_ylabel("acceptance rate")
    pos_ax.set_ylim(0, 1.05)
    if pos_ax.lines:
        _legend_beside(pos_ax)
    _titled(fig, "tau and acceptance per draft position", machine)
    _save(fig, path)


def plot_latency_cdf(runs: Sequence[dict[str, Any]], placements: int, path: Path, machine: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run, look in zip(runs, _line_looks(runs), strict=True):
        latencies = sorted(r["elapsed_s"] for r in run["requests"])
        fractions = [(i + 1) / len(latencies) for i in range(len(latencies))]
        ax.step(latencies, fractions, where="post", label=label(run, placements), **look)
    ax.set_xlabel("request latency, s")
    ax.set_ylabel("fraction of requests")
    _legend_beside(ax)
    _titled(fig, "latency CDF", machine)
    _save(fig, path)


def write_report(result: dict[str, Any], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    runs, m = result["runs"], result["machine"]
    placements = len(result["settings"]["placements"])
    flags = f" ({m['cpu_flags']})" if m.get("cpu_flags") else ""
    machine = f"{m['cpu_model']}{flags}, {m['cores']} cores, {fmt(m['memory_gib'], 0)} GiB"
    plot_tokens_per_s(runs, placements, folder / "tokens_per_s.png", machine)
    plot_acceptance(runs, placements, folder / "acceptance.png", machine)
    plot_latency_cdf(runs, placements, folder / "latency_cdf.png", machine)
    text = [
        *_setup_lines(result, machine),
        "## Overall\n",
        overall_table(runs),
        "\nPeak RSS: the measured process (edge-agent or the in-process runner) by wait4, and the verifier's "
        "VmHWM over that run. Peak KV: the target's cache.\n",
        "## Speedups (tokens/s ratios, same run)\n",
        ratio_table(runs),
        "## Where a round's time goes\n",
        "Mean per verified round, from the edge's round log: drafting, the verifier's own time (queue, one "
        "forward, accept) and the rest of the Verify call (wire, serialization, added RTT). The last columns "
        "set the verifier's time per verified position beside one cloud_only decode step on the same link.\n",
        round_time_table(runs),
        "## Acceptance per draft position\n",
        position_table(runs),
        "## Per task\n",
        task_table(runs),
        "## Plots\n",
        "![tokens/s](tokens_per_s.png)\n",
        "![tau and acceptance](acceptance.png)\n",
        "![latency CDF](latency_cdf.png)\n",
    ]
    path = folder / "report.md"
    path.write_text("\n".join(text))
    return path


def _setup_lines(result: dict[str, Any], machine: str) -> list[str]:
    """The report's opening: where, with what, on which models and prompts, over which links."""
    m, v, st, git = result["machine"], result["versions"], result["settings"], result["git"]
    sampling = sampling_label(st["temperature"], st.get("top_p", 1.0))  # results from before --top-p have none
    k = st["k"] if st["k"] is not None else "edge default"
    cap = f", bandwidth cap {st['bandwidth_kbps']:g} kbit/s" if st["bandwidth_kbps"] else ""
    pinned = (
        "pinned: verifier on core 0, edge on core 1, one torch thread each; in-process systems on core 0, one thread"
        if "pinned" in st["placements"]
        else ""
    )
    return [
        "# Benchmark report\n",
        f"**Measured on**: {machine} ({m['platform']}). All absolute times below are from this machine; "
        "every ratio compares systems measured in this same run.\n",
        f"Versions: python {v['python']}, torch {v['torch']}, transformers {v['transformers']}; "
        f"git {git['commit'] or 'unknown'}{' (dirty tree)' if git['dirty'] else ''}.\n",
        f"Models: draft `{result['models']['draft']}`, target `{result['models']['target']}`; "
        f"dtype {st['dtype']} ({st.get('dtype_reason', 'set by --dtype')}); "
        f"{sampling}, seed {st['seed']}; "
        f"max {st['max_new_tokens']} new tokens; k {k}; "
        f"{result['prompts']['count']} prompts (`{result['prompts']['file']}`).\n",
        f"Placements: {', '.join(st['placements'])}. {pinned}\n"
        if pinned
        else f"Placement: {', '.join(st['placements'])} (processes share all cores).\n",
        "Links: wire systems (edge ↔ verifier) run once per added RTT through the loopback proxy"
        f"{cap}; in-process systems "
        "(target-only, hf-assisted) and edge_only never cross the wire: they run once and appear as their own "
        "rows marked *no network*.\n",
    ]
