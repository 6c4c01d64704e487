"""The benchmark's arithmetic and prompt selection: percentiles, per-position acceptance,
run summaries, Spec-Bench task grouping, and the CLI's one-line errors."""

import json
import random
from collections import Counter

import numpy as np
import pytest

from bench.__main__ import main
from bench.report import round_time_table
from bench.summarize import acceptance_by_position, identical_count, percentile, round_time, summarize
from bench.summarize import main as summarize_main
from bench.systems import Kind, parse_variant, resolve_systems
from bench.tasks import TASKS, select_per_task, spec_bench_path, task_of
from edge.prompts import Prompt, read_prompts
from shared.errors import ConfigError


def test_percentile_matches_numpy_linear() -> None:
    rng = random.Random(0)
    for size in (1, 2, 3, 7, 50):
        values = [rng.uniform(0, 10) for _ in range(size)]
        for q in (0, 5, 50, 95, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None


def test_acceptance_by_position_counts_rounds_that_drafted_each_position() -> None:
    rounds = [
        {"k": 3, "accepted_len": 1},
        {"k": 2, "accepted_len": 2},
        {"k": 1, "accepted_len": 0},
        {"k": 4, "accepted_len": 4, "local": True},
    ]  # a local (lossy) block never reached the cloud
    assert acceptance_by_position(rounds) == pytest.approx([2 / 3, 1 / 2, 0 / 1])
    assert acceptance_by_position([]) == []


def test_round_time_splits_a_round_into_drafting_verifier_and_wire() -> None:
    rounds = [
        {"k": 4, "accepted_len": 2, "edge_time_ms": 300.0, "cloud_verify_ms": 900.0, "rtt_ms": 960.0},
        {"k": 2, "accepted_len": 2, "edge_time_ms": 100.0, "cloud_verify_ms": 500.0, "rtt_ms": 600.0},
        {"k": 8, "accepted_len": 8, "local": True, "edge_time_ms": 1.0, "cloud_verify_ms": 0.0, "rtt_ms": 0.0},
        {"k": 3, "accepted_len": 1},
    ]  # hf-assisted's rounds carry no times
    profile = round_time(rounds)
    assert profile["round_draft_ms"] == pytest.approx(200.0)
    assert profile["round_verify_ms"] == pytest.approx(700.0)
    assert profile["round_wire_ms"] == pytest.approx(80.0)
    assert profile["verify_ms_per_position"] == pytest.approx(1400.0 / 8)  # (4 + 1) + (2 + 1) rows verified
    assert profile["draft_ms_per_token"] == pytest.approx(400.0 / 6)  # 4 + 2 tokens drafted
    assert set(round_time([{"k": 3, "accepted_len": 1}]).values()) == {None}
    assert summarize([_record(4, 2, 6, 4, 2, 1.0, 0.1)], rounds)["round_verify_ms"] == pytest.approx(700.0)


def test_round_time_table_sets_a_position_beside_cloud_only_on_the_same_link() -> None:
    def run(system: str, rtt: float, **summary: float | None) -> dict[str, object]:
        return {"system": system, "placement": "unpinned", "rtt_ms": rtt, "kind": "wire", "summary": summary}

    runs = [
        run("cloud_only", 0.0, decode_tokens_per_s=4.0, round_verify_ms=None),
        run("cloud_only", 50.0, decode_tokens_per_s=2.0, round_verify_ms=None),
        run(
            "speculative",
            50.0,
            tau=3.0,
            round_draft_ms=300.0,
            round_verify_ms=1000.0,
            round_wire_ms=60.0,
            verify_ms_per_position=250.0,
            draft_ms_per_token=50.0,
        ),
    ]
    rows = [line for line in round_time_table(runs).splitlines() if line.startswith("| speculative")]
    # the +50 ms cloud_only step (500 ms), not +0's: a position costs 0.5 steps, a drafted token c = 0.1
    assert len(rows) == 1 and rows[0].endswith("| 250 | 500 | 0.50 | 50.0 | 0.10 |")
    assert "No timed rounds" in round_time_table(runs[:2])


def _record(
    tokens: int,
    rounds: int,
    drafted: int,
    accepted: int,
    passes: int,
    elapsed: float,
    ttft: float,
    verify_up: int = 0,
    **extra: object,
) -> dict[str, object]:
    return {
        "id": str(extra.pop("id", "x")),
        "token_ids": list(range(tokens)),
        "rounds": rounds,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "target_forward_passes": passes,
        "elapsed_s": elapsed,
        "ttft_s": ttft,
        "bytes_up": 100,
        "bytes_down": 50,
        "verify_bytes_up": verify_up,
        **extra,
    }


def test_summary_rates_come_from_totals_not_means_of_ratios() -> None:
    records = [
        _record(10, 4, 12, 6, 5, 2.0, 0.5, verify_up=60, ahead_drafted=5, ahead_used=1),
        _record(30, 6, 18, 24, 7, 4.0, 1.5, verify_up=90),
    ]
    s = summarize(records)
    assert s["output_tokens"] == 40
    assert s["tokens_per_s"] == pytest.approx(40 / 6.0)  # not the mean of 5 and 7.5
    assert s["decode_tokens_per_s"] == pytest.approx(38 / 4.0)
    assert s["tau"] == pytest.approx(40 / 10)
    assert s["acceptance_rate"] == pytest.approx(30 / 30)
    assert s["target_passes_per_token"] == pytest.approx(12 / 40)
    assert s["cloud_call_ratio"] == pytest.approx(10 / 40)
    assert s["verify_bytes_up_per_drafted_token"] == pytest.approx(150 / 30)
    assert s["bytes_up_per_token"] == pytest.approx(200 / 40)
    assert s["thrown_away_per_token"] == pytest.approx(4 / 40)
    assert s["ttft_s_p50"] == pytest.approx(1.0) and s["latency_s_p95"] == pytest.approx(3.9)
    no_rounds = summarize([_record(5, 0, 0, 0, 5, 1.0, 0.2)])
    assert no_rounds["tau"] is None and no_rounds["acceptance_rate"] is None


def test_auto_modes_round_figures_are_its_speculative_rounds_alone() -> None:
    """An auto-mode generation: 50 of its 64 tokens from the target's stretches, 14 from 6
    rounds. tau is 14 / 6, and the stretches' records stay out of the round time."""
    records = [_record(64, 6, 14, 8, 57, 4.0, 0.5, tokens_by_mode={"cloud_only": 50, "speculative": 14})]
    stretch = {"mode": "cloud_only", "k": 0, "accepted_len": 0, "edge_time_ms": 0.0, "cloud_verify_ms": 900.0, "rtt_ms": 905.0}
    rounds = [{"mode": "speculative", "k": 3, "accepted_len": 2, "edge_time_ms": 60.0, "cloud_verify_ms": 100.0, "rtt_ms": 104.0}]
    s = summarize(records, [stretch, *rounds * 6])
    assert s["tau"] == pytest.approx(14 / 6)
    assert s["round_verify_ms"] == pytest.approx(100.0) and s["round_wire_ms"] == pytest.approx(4.0)
    assert s["acceptance_by_position"] == [1.0, 1.0, 0.0]


def test_the_summarize_command_tables_each_run_against_the_reference(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    runs = {"cloud_only": [_record(4, 0, 0, 0, 4, 1.0, 0.1, id="a")], "speculative": [_record(3, 1, 2, 2, 1, 1.0, 0.1, id="a")]}
    for mode, records in runs.items():
        (tmp_path / f"{mode}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    flags = [f"--run={mode}={tmp_path / mode}.jsonl" for mode in runs]
    assert summarize_main([*flags, "--output", str(tmp_path / "result.json")]) == 0
    modes = json.loads((tmp_path / "result.json").read_text())["modes"]
    assert modes["speculative"]["identical_to_reference"] == 0 and modes["cloud_only"]["output_tokens"] == 4
    assert capsys.readouterr().out.count("| speculative |") == 1


def test_identical_count_is_token_for_token() -> None:
    records = [{"id": "a", "token_ids": [1, 2, 3]}, {"id": "b", "token_ids": [1, 2]}, {"id": "c", "token_ids": [4]}]
    assert identical_count(records, {"a": [1, 2, 3], "b": [1, 2, 4]}) == 1


def test_spec_bench_labels_group_into_six_tasks_of_eighty() -> None:
    prompts = read_prompts(spec_bench_path())
    assert Counter(task_of(p.category) for p in prompts) == dict.fromkeys(TASKS, 80)


def test_per_task_selection_is_the_shortest_round_robin_over_labels() -> None:
    prompts = read_prompts(spec_bench_path())
    chosen = select_per_task(prompts, 3)
    assert [task_of(p.category) for p in chosen] == [t for t in TASKS for _ in range(3)]
    conversation = chosen[:3]
    assert len({p.category for p in conversation}) == 3  # three labels, not three math questions
    for prompt in conversation:  # each is its label's shortest
        assert len(prompt.text) == min(len(p.text) for p in prompts if p.category == prompt.category)
    for task in TASKS[1:]:  # single-label tasks: nothing left out is shorter than what was taken
        taken = [p for p in chosen if task_of(p.category) == task]
        left = [p for p in prompts if task_of(p.category) == task and p not in taken]
        assert max(len(p.text) for p in taken) <= min(len(p.text) for p in left)
    assert select_per_task(prompts, 3) == chosen  # deterministic


def test_selection_keeps_a_short_task_whole_and_puts_unknown_labels_last() -> None:
    prompts = [Prompt("u", "zz", "poetry"), Prompt("q1", "long question", "qa"), Prompt("q2", "short", "qa")]
    assert [p.id for p in select_per_task(prompts, 5)] == ["q2", "q1", "u"]


def test_variants_and_systems() -> None:
    assert parse_variant("solo=--mode edge_only --k 2", [0.0]).kind is Kind.EDGE_LOCAL
    assert parse_variant("k8=--k 8 --k-policy fixed", [0.0]).edge_flags == ("--k", "8", "--k-policy", "fixed")
    assert parse_variant("k8=--k 8", [0.0, 50.0]).runs_at(50.0)
    at_zero = parse_variant("loose@0=--drafter hybrid --hybrid-min-count 1", [0.0, 50.0])
    assert at_zero.name == "loose" and at_zero.runs_at(0.0) and not at_zero.runs_at(50.0)
    for bad in ("noflags", "=--k 2", "speculative=--k 2", "@0=--k 2", "k8@20=--k 8", "solo@0=--mode edge_only"):
        with pytest.raises(ConfigError):
            parse_variant(bad, [0.0, 50.0])
    with pytest.raises(ConfigError, match="^--variant k8@20: RTT 20 ms is not in --rtt-ms"):
        parse_variant("k8@20=--k 8", [0.0, 50.0])
    with pytest.raises(ConfigError, match="unknown"):
        resolve_systems(["speculative", "nope"], [], [0.0])


def test_a_wire_system_can_be_limited_to_some_rtts() -> None:
    cloud, ngram = resolve_systems(["cloud_only", "ngram@0"], [], [0.0, 50.0])
    assert cloud.only_rtts_ms is None and cloud.runs_at(0.0) and cloud.runs_at(50.0)
    assert ngram.only_rtts_ms == (0.0,) and ngram.runs_at(0.0) and not ngram.runs_at(50.0)
    assert ngram.edge_flags == ("--mode", "speculative", "--drafter", "ngram", "--filler-top-k", "1")
    for bad, why in (("target-only@0", "has no RTT"), ("ngram@20", "not in --rtt-ms"), ("ngram@fast", "expected")):
        with pytest.raises(ConfigError, match=why):
            resolve_systems([bad], [], [0.0, 50.0])


def test_cli_errors_are_one_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--quick", "--systems", "nope", "--output", str(tmp_path / "r.json")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench: error: --systems: unknown nope")
    assert main(["--quick", "--rtt-ms", "0,fast", "--output", str(tmp_path / "r.json")]) == 1
    assert "expected comma-separated numbers" in capsys.readouterr().err
