"""The Grafana dashboard drawn without Grafana: every panel's queries from the dashboard JSON,
run as range queries against a real Prometheus, plotted with matplotlib in the dashboard's own
grid (gridPos: 24 columns). What a user sees in Grafana, from the same PromQL.

    python -m bench.dashboard_render --prometheus http://127.0.0.1:9090 \\
        --dashboard deploy/grafana/specdec.json --out docs/fleet/dashboard.png --since-s 600
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.cli import settings_parser
from bench.prometheus import Prometheus, PrometheusError
from shared.cli import settings_from_args

GRID_COLUMNS = 24  # Grafana's grid width
# Grafana's built-in interval variables; $__rate_interval is at least four scrape intervals.
_INTERVAL_VARIABLES = re.compile(r"\$__(rate_interval|interval)\b|\$\{__(rate_interval|interval)\}")


@dataclass(frozen=True)
class Query:
    panel: str
    ref: str
    expr: str  # as written in the dashboard, Grafana variables included
    legend: str

    def promql(self, rate_interval: str) -> str:
        """The expression Prometheus runs: Grafana's interval variables filled in. A variable
        left over (a dashboard variable this file cannot know) is an error, not a silent gap."""
        expr = _INTERVAL_VARIABLES.sub(rate_interval, self.expr)
        if leftover := re.search(r"\$__\w+|\$\{?[A-Za-z_]\w*", expr):
            raise ValueError(f"panel {self.panel!r} query {self.ref}: unknown variable {leftover.group(0)}")
        return expr

    def label(self, metric: dict[str, str]) -> str:
        """legendFormat with {{label}} filled in from the series' labels."""
        text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), self.legend)
        return text or ",".join(f"{k}={v}" for k, v in sorted(metric.items())) or self.ref


def load_dashboard(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[dict[str, Any], list[Query]]]:
    """Each panel with its queries, in the dashboard's order."""
    return [
        (panel, [Query(panel["title"], t["refId"], t["expr"], t.get("legendFormat", "")) for t in panel.get("targets", [])])
        for panel in dashboard["panels"]
    ]


def _human_bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _formatter(unit: str) -> Callable[[float, Any], str]:
    """Axis labels in the panel's Grafana unit."""
    formats: dict[str, Callable[[float], str]] = {
        "percentunit": lambda v: f"{v * 100:.0f}%",
        "s": lambda v: f"{v * 1000:.3g} ms" if abs(v) < 1 else f"{v:.3g} s",
        "bytes": _human_bytes,
        "ops": lambda v: f"{v:g}/s",
        "reqps": lambda v: f"{v:g}/s",
    }
    plain = formats.get(unit, lambda v: f"{v:g}")
    return lambda value, _position: plain(value)


def _series(prometheus: Prometheus, query: Query, start: float, end: float, step_s: float, rate_interval: str) -> list[Any]:
    """[(label, times relative to start, values)] of one query. A step without a finite value
    (no data, 0/0) is NaN, so the line breaks there as Grafana's does, rather than bridging it."""
    out = []
    for series in prometheus.query_range(query.promql(rate_interval), start, end, step_s):
        found = {round(float(t) - start, 3): float(v) for t, v in series["values"]}
        if not any(math.isfinite(v) for v in found.values()):
            continue
        times = [round(i * step_s, 3) for i in range(int((end - start) / step_s) + 1)]
        values = [found.get(t, math.nan) for t in times]
        out.append((query.label(series["metric"]), times, [v if math.isfinite(v) else math.nan for v in values]))
    return out


def render(
    prometheus: Prometheus,
    dashboard: dict[str, Any],
    out: Path,
    window: tuple[float, float],
    step_s: float = 1.0,
    rate_interval: str = "15s",
    caption: str = "",
) -> list[str]:
    """Draw every panel of `dashboard` over `window` (unix seconds) into the PNG `out`; the
    titles of the panels that had no data (none, when every query found its metrics)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    panels = panel_queries(dashboard)
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p, _ in panels)
    fig = plt.figure(figsize=(16, rows * 0.42 + 1.2))
    grid = fig.add_gridspec(rows, GRID_COLUMNS, hspace=2.2, wspace=1.2, top=0.95, bottom=0.03)
    start, end, empty = window[0], window[1], []
    for panel, queries in panels:
        pos = panel["gridPos"]
        ax = fig.add_subplot(grid[pos["y"] : pos["y"] + pos["h"] - 1, pos["x"] : pos["x"] + pos["w"]])
        for query in queries:
            for label, times, values in _series(prometheus, query, start, end, step_s, rate_interval):
                ax.plot(times, values, linewidth=1.2, label=label)
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "none")
        ax.yaxis.set_major_formatter(FuncFormatter(_formatter(unit)))
        ax.set_title(panel["title"], fontsize=10, loc="left")
        ax.set_xlim(0, end - start)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if ax.lines:
            # Above the axes, right of the title: inside, it covered the lines near the top.
            ax.legend(fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3, frameon=False, borderaxespad=0.2)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
            empty.append(panel["title"])
    title = dashboard.get("title", "dashboard") + "  (x: seconds since the window's start)" + (f"\n{caption}" if caption else "")
    fig.suptitle(title, fontsize=11, x=0.01, y=0.99, ha="left")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return empty


class DashboardRenderSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_DASHBOARD_")

    prometheus: str = Field(description="Prometheus base URL, e.g. http://127.0.0.1:9090")
    dashboard: Path = Field(Path("deploy/grafana/specdec.json"), description="the Grafana dashboard JSON to draw")
    since_s: float = Field(600.0, gt=0, description="the window: this many seconds up to now")
    step_s: float = Field(1.0, gt=0, description="seconds between the points of a series")
    rate_interval: str = Field("15s", description="what $__rate_interval stands for")
    out: Path = Field(description="the PNG to write")
    caption: str = Field("", description="appended to the figure's title (what ran, where)")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "what to draw": ("prometheus", "dashboard", "since_s", "step_s", "rate_interval"),
        "the image": ("out", "caption"),
    }


def parser() -> argparse.ArgumentParser:
    return settings_parser("python -m bench.dashboard_render", __doc__, DashboardRenderSettings)


def main(argv: Sequence[str] | None = None) -> int:
    args = settings_from_args(DashboardRenderSettings, parser().parse_args(argv))
    end = time.time()
    try:
        empty = render(
            Prometheus(args.prometheus.rstrip("/")),
            load_dashboard(args.dashboard),
            args.out,
            (end - args.since_s, end),
            args.step_s,
            args.rate_interval,
            args.caption,
        )
    except (PrometheusError, ValueError, OSError) as err:
        sys.stderr.write(f"dashboard_render: {err}\n")
        return 1
    sys.stdout.write(f"{args.out}\n" + "".join(f"no data: {title}\n" for title in empty))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
