"""Every command's --help groups its flags by concern: every setting in exactly one group, each
flag described; the flags come from the command's settings class (edge-agent's, cloud-verifier's,
the harness's and the tools')."""

import argparse
import contextlib
import io
from collections import Counter
from collections.abc import Callable

import pytest
from pydantic_settings import BaseSettings

from bench import chat_turns, hf_runner, random_weights, retarget_traces, summarize
from bench.__main__ import _parser as bench_parser
from bench.config import BenchFlags
from bench.dashboard_render import DashboardRenderSettings
from bench.dashboard_render import parser as dashboard_parser
from bench.fleet import FleetSettings
from bench.fleet import parser as fleet_parser
from bench.loadtest import LoadtestSettings
from bench.loadtest import parser as loadtest_parser
from bench.studies import (
    kpolicy_disturbance,
    kpolicy_replay,
    kv_layout_timing,
    prefill_stall,
    prefix_isolation,
    serve_overhead,
    structured_output,
    two_keys,
)
from edge import calibrate
from edge.config import EdgeSettings
from edge.serve import server
from shared.cli import add_settings_flags, settings_from_args
from shared.models import store
from tests.policy.test_docs_describe_the_product import BOOKKEEPING, HISTORY
from tools import check_tokenizer, gpu_probe, load_table
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


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


# Every command built from settings classes: its parser and the classes behind it.
SETTINGS_COMMANDS: dict[str, tuple[Callable[[], argparse.ArgumentParser], tuple[type[BaseSettings], ...]]] = {
    "python -m bench": (bench_parser, (BenchFlags,)),
    "python -m bench.loadtest": (loadtest_parser, (LoadtestSettings,)),
    "python -m bench.fleet": (fleet_parser, (FleetSettings,)),
    "python -m bench.dashboard_render": (dashboard_parser, (DashboardRenderSettings,)),
    "python -m bench.random_weights": (random_weights.parser, (random_weights.RandomWeightsSettings,)),
    "python -m bench.retarget_traces": (retarget_traces.parser, (retarget_traces.RetargetSettings,)),
    "python -m bench.summarize": (summarize.parser, (summarize.SummarizeSettings,)),
    "python -m bench.chat_turns": (chat_turns.parser, (chat_turns.ChatTurnsSettings,)),
    "python -m bench.hf_runner": (hf_runner.parser, (hf_runner.HfRunnerSettings,)),
    "python -m bench.studies.kv_layout_timing": (kv_layout_timing.parser, (kv_layout_timing.KvLayoutSettings,)),
    "python -m bench.studies.kpolicy_disturbance": (kpolicy_disturbance.parser, (kpolicy_disturbance.DisturbanceSettings,)),
    "python -m bench.studies.kpolicy_replay": (kpolicy_replay.parser, (kpolicy_replay.ReplaySettings,)),
    "python -m bench.studies.prefill_stall": (
        lambda: prefill_stall.PrefillStallSettings.parser(prefill_stall.__doc__),
        (prefill_stall.PrefillStallSettings,),
    ),
    "python -m bench.studies.two_keys": (lambda: two_keys.TwoKeysSettings.parser(two_keys.__doc__), (two_keys.TwoKeysSettings,)),
    "python -m bench.studies.prefix_isolation": (
        lambda: prefix_isolation.PrefixIsolationSettings.parser(prefix_isolation.__doc__),
        (prefix_isolation.PrefixIsolationSettings,),
    ),
    "python -m bench.studies.serve_overhead": (serve_overhead.parser, (serve_overhead.ServeOverheadSettings,)),
    "python -m bench.studies.structured_output": (structured_output.parser, (structured_output.StructuredOutputSettings,)),
    "python -m tools.netproxy": (netproxy_parser, (NetproxySettings,)),
    "python -m tools.check_tokenizer": (check_tokenizer.parser, (check_tokenizer.CheckTokenizerSettings,)),
    "python -m tools.gpu_probe": (gpu_probe.parser, (gpu_probe.GpuProbeSettings,)),
    "python -m tools.load_table": (load_table.parser, (load_table.LoadTableSettings,)),
    "edge-calibrate": (calibrate.parser, (calibrate.CalibrateSettings,)),
    "edge-agent serve": (server.parser, (server.ServeSettings, EdgeSettings)),
    "specedge-models fetch": (lambda: _subcommand(store.parser(), "fetch"), (store.FetchSettings,)),
    "specedge-models list": (lambda: _subcommand(store.parser(), "list"), (store.ModelsSettings,)),
}


def _groups(settings_classes: tuple[type[BaseSettings], ...]) -> dict[str, tuple[str, ...]]:
    groups: dict[str, tuple[str, ...]] = {}
    for settings_cls in settings_classes:
        groups.update(getattr(settings_cls, "help_groups", {}))
    return groups


@pytest.mark.parametrize("command", sorted(SETTINGS_COMMANDS))
def test_each_command_groups_every_flag_once(command: str) -> None:
    make_parser, settings_classes = SETTINGS_COMMANDS[command]
    groups = _groups(settings_classes)
    grouped = Counter(name for names in groups.values() for name in names)
    fields = {name for settings_cls in settings_classes for name in settings_cls.model_fields}
    assert set(grouped) == fields and max(grouped.values()) == 1
    parser = make_parser()
    assert parser.prog == command
    titles = {group.title: {a.dest for a in group._group_actions} for group in parser._action_groups}
    for title, names in groups.items():
        assert titles[title] == set(names), title


@pytest.mark.parametrize("command", sorted(SETTINGS_COMMANDS))
def test_help_exits_zero_shows_the_groups_and_describes_each_flag(command: str) -> None:
    make_parser, settings_classes = SETTINGS_COMMANDS[command]
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit) as exited:
        make_parser().parse_args(["--help"])
    assert exited.value.code == 0
    text = shown.getvalue()
    for title in _groups(settings_classes):
        assert f"\n{title}:\n" in text, title
    for settings_cls in settings_classes:
        for name, field in settings_cls.model_fields.items():
            assert field.description and len(field.description.split()) >= 2, f"{command}: --{name} has no description"
            assert "--" + name.replace("_", "-") in text, name


@pytest.mark.parametrize("command", sorted(SETTINGS_COMMANDS))
def test_help_texts_describe_the_product(command: str) -> None:
    make_parser, _ = SETTINGS_COMMANDS[command]
    text = make_parser().format_help()
    assert not BOOKKEEPING.search(text) and not HISTORY.search(text), text
