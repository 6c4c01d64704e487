"""The dashboard renderer's reading of Grafana's JSON: interval variables filled in, any other
variable refused, legends from the series' labels, panels in the dashboard's order."""

import pytest

from bench.dashboard_render import Query, panel_queries


def test_interval_variables_are_filled_and_label_replace_groups_kept() -> None:
    query = Query("p", "A", 'label_replace(rate(x[$__rate_interval]), "a", "$1", "b", "(.*)") + rate(y[${__interval}])', "")
    assert query.promql("15s") == 'label_replace(rate(x[15s]), "a", "$1", "b", "(.*)") + rate(y[15s])'


@pytest.mark.parametrize("expr", ["rate(x[$__range])", 'x{instance="$instance"}', "rate(x[${window}])"])
def test_other_variables_are_refused(expr: str) -> None:
    with pytest.raises(ValueError, match="unknown variable"):
        Query("p", "A", expr, "").promql("15s")


def test_legends_and_panel_order() -> None:
    query = Query("p", "A", "x", "{{instance}} {{ code }}")
    assert query.label({"instance": "v1:8080", "code": "OK"}) == "v1:8080 OK"
    assert Query("p", "B", "x", "").label({"code": "OK"}) == "code=OK"
    dashboard = {"panels": [{"title": t, "targets": [{"refId": "A", "expr": "up"}]} for t in ("one", "two")]}
    assert [(panel["title"], [q.ref for q in queries]) for panel, queries in panel_queries(dashboard)] == [
        ("one", ["A"]),
        ("two", ["A"]),
    ]
