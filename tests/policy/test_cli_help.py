"""edge-agent and python -m bench --help group their flags by concern: every setting in exactly one group;
bench's flags come from its settings class like the other commands'."""

import argparse
from collections import Counter

import pytest

from bench.__main__ import _parser as bench_parser
from bench.config import BenchFlags
from bench.dashboard_render import DashboardRenderSettings
from bench.dashboard_render import parser as dashboard_parser
from bench.fleet import FleetSettings
from bench.fleet import parser as fleet_parser
from bench.loadtest import LoadtestSettings
from bench.loadtest import parser as loadtest_parser
from edge.config import EdgeSettings
from shared.cli import add_settings_flags, settings_from_args
from tests.policy.test_docs_describe_the_product import BOOKKEEPING, HISTORY
from tools.netproxy import NetproxySettings
from tools.netproxy import parser as netproxy_parser


def test_every_edge_setting_is_in_one_help_group() -> None:
    grouped = Counter(name for names in EdgeSettings.help_groups.values() for name in names)
    assert set(grouped) == set(EdgeSettings.model_fields)
    assert max(grouped.values()) == 1


def test_help_lists_each_flag_under_its_group() -> None:
    parser = argparse.ArgumentParser()
    add_settings_flags(parser, EdgeSettings)
    titles = {group.title: [a.dest for a in group._group_actions] for group in parser._action_groups}
    for title, names in EdgeSettings.help_groups.items():
        assert titles[title] == list(names) or set(titles[title]) == set(names)


def test_every_bench_flag_is_in_one_help_group() -> None:
    grouped = Counter(name for names in BenchFlags.help_groups.values() for name in names)
    assert set(grouped) == set(BenchFlags.model_fields)
    assert max(grouped.values()) == 1


def test_bench_flags_parse_into_its_settings() -> None:
    args = bench_parser().parse_args(
        ["--output", "r.json", "--variant", "k8=--k 8", "--variant", "cost@0=--k-policy cost", "--placement", "both", "--pin"]
    )
    flags = settings_from_args(BenchFlags, args)
    assert str(flags.output) == "r.json" and flags.variant == ["k8=--k 8", "cost@0=--k-policy cost"]
    assert flags.placement == "both" and flags.pin and flags.report is None and flags.temperature == 0.0


# Every command built from a settings class: its parser and the class behind it.
SETTINGS_COMMANDS = {
    "python -m bench": (bench_parser, BenchFlags),
    "python -m bench.loadtest": (loadtest_parser, LoadtestSettings),
    "python -m bench.fleet": (fleet_parser, FleetSettings),
    "python -m bench.dashboard_render": (dashboard_parser, DashboardRenderSettings),
    "python -m tools.netproxy": (netproxy_parser, NetproxySettings),
}


@pytest.mark.parametrize("command", sorted(SETTINGS_COMMANDS))
def test_each_command_groups_every_flag_once(command: str) -> None:
    make_parser, settings_cls = SETTINGS_COMMANDS[command]
    grouped = Counter(name for names in settings_cls.help_groups.values() for name in names)
    assert set(grouped) == set(settings_cls.model_fields) and max(grouped.values()) == 1
    parser = make_parser()
    assert parser.prog == command
    titles = {group.title: {a.dest for a in group._group_actions} for group in parser._action_groups}
    for title, names in settings_cls.help_groups.items():
        assert titles[title] == set(names), title


@pytest.mark.parametrize("command", sorted(SETTINGS_COMMANDS))
def test_help_texts_describe_the_product(command: str) -> None:
    make_parser, _ = SETTINGS_COMMANDS[command]
    text = make_parser().format_help()
    assert not BOOKKEEPING.search(text) and not HISTORY.search(text), text
