"""The Grafana dashboard's queries against a real Prometheus (Debian's `prometheus`, marker
`fleet`) that scraped a real cloud-verifier process while real edge-agent runs went through it:
every panel's PromQL must parse and return at least one finite number, so a typo or a metric
name the verifier does not export fails here. The same queries then draw the dashboard
(bench/dashboard_render.py) into a PNG."""

from __future__ import annotations

import math
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.dashboard_render import Query, load_dashboard, panel_queries, render
from bench.prometheus import Prometheus, PrometheusError, running_prometheus
from tests.integration.test_outage import ENV, _edge_cmd, _write_prompts, verifier_process
from tests.tiny_models import save_pair

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "specdec.json"
RATE_WINDOW = "10m"  # longer than the whole run: every rate sees the traffic


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Prometheus, tuple[float, float]]]:
    """A verifier scraped every second from before the first edge run to after the last; the
    Prometheus, and the window (unix seconds) the traffic fell in."""
    folder = tmp_path_factory.mktemp("dashboard")
    draft, target = save_pair(folder / "models")
    prompts = _write_prompts(folder / "prompts.jsonl", ["w2 w15 w28 w41", "w9 w22 w35 w48 w61", "w16 w29"])
    with verifier_process(target) as verifier, running_prometheus([f"127.0.0.1:{verifier.http_port}"], folder / "prom") as prom:
        seen = prom.wait_for_scrapes(1)  # the counters' starting values are in
        start = time.time()
        for run in range(2):  # two edge processes, one after the other: sessions open, verify, close
            done = subprocess.run(
                _edge_cmd(draft, verifier.address, prompts, folder / f"out{run}.jsonl", "--max-new-tokens", "48", "--k", "4"),
                capture_output=True,
                text=True,
                env=ENV,
                timeout=300,
            )
            assert done.returncode == 0, done.stderr[-2000:]
        prom.wait_for_scrapes(prom.scrapes() + 1)  # the final values are in too
        assert seen >= 1
        yield prom, (start, time.time())


def _finite_values(prom: Prometheus, query: Query) -> list[float]:
    values = [float(sample["value"][1]) for sample in prom.query(query.promql(RATE_WINDOW))]
    return [v for v in values if math.isfinite(v)]


def _all_queries() -> list[Query]:
    return [query for _, queries in panel_queries(load_dashboard(DASHBOARD)) for query in queries]


@pytest.mark.fleet
@pytest.mark.parametrize("query", _all_queries(), ids=lambda q: f"{q.panel} {q.ref}")
def test_every_panel_query_returns_numbers(scraped: tuple[Prometheus, tuple[float, float]], query: Query) -> None:
    prom, _ = scraped
    assert _finite_values(prom, query), f"{query.panel} {query.ref}: no finite value for {query.promql(RATE_WINDOW)}"


@pytest.mark.fleet
def test_what_the_panels_say_about_the_run(scraped: tuple[Prometheus, tuple[float, float]]) -> None:
    """The figures are the run's: acceptance in [0, 1] per position, tau between 1 and k + 1,
    a positive Verify latency, every session closed at the end."""
    prom, _ = scraped
    by_title = {q.panel + " " + q.ref: q for q in _all_queries()}
    acceptance = _finite_values(prom, by_title["Acceptance rate by draft position A"])
    assert len(acceptance) == 4 and all(0 <= a <= 1 for a in acceptance)  # --k 4: positions 0..3
    (tau,) = _finite_values(prom, by_title["Tokens per round (tau) A"])
    assert 1 <= tau <= 5
    assert all(v > 0 for v in _finite_values(prom, by_title["Verify latency (server, queue included) B"]))
    assert _finite_values(prom, by_title["Open sessions by replica A"]) == [0.0]


@pytest.mark.fleet
def test_a_wrong_metric_name_or_a_typo_fails(scraped: tuple[Prometheus, tuple[float, float]]) -> None:
    """What the check above catches: a metric the verifier does not export returns nothing; a
    syntax error is Prometheus' error."""
    prom, _ = scraped
    tau = next(q for q in _all_queries() if q.panel.startswith("Tokens per round"))
    misspelt = Query(tau.panel, "X", tau.expr.replace("specdec_rounds_total", "specdec_round_total"), "")
    assert not _finite_values(prom, misspelt)
    with pytest.raises(PrometheusError, match="bad_data"):
        prom.query(tau.promql(RATE_WINDOW).replace("sum(", "sum((", 1))


@pytest.mark.fleet
def test_the_dashboard_renders_from_the_same_queries(scraped: tuple[Prometheus, tuple[float, float]], tmp_path: Path) -> None:
    prom, window = scraped
    out = tmp_path / "dashboard.png"
    assert render(prom, load_dashboard(DASHBOARD), out, window, 1.0, "15s", "test") == []  # every panel drew a line
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
