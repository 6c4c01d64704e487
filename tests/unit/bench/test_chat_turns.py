"""bench.chat_turns without servers: its command line, the shipped script, the reuse counters
read from a /metrics text, the per-turn summary and the report's headline."""

import contextlib
import io
import json
from collections import Counter
from pathlib import Path

import pytest

from bench import chat_turns
from bench.chat_turns import ChatTurnsSettings, read_counters, read_script
from bench.chat_turns_report import markdown, max_over_first, summarize

METRICS = """# HELP specdec_prefix_reused_tokens_total prompt tokens found in a kept prefix
# TYPE specdec_prefix_reused_tokens_total counter
specdec_prefix_reused_tokens_total 120.0
specdec_prefix_reused_tokens_created 1.7e9
# HELP specdec_prefix_prefilled_tokens_total prompt tokens computed
# TYPE specdec_prefix_prefilled_tokens_total counter
specdec_prefix_prefilled_tokens_total{engine="transformers"} 30.0
# HELP specdec_rounds_total rounds
# TYPE specdec_rounds_total counter
specdec_rounds_total 7.0
"""


def test_every_flag_is_in_one_help_group_and_help_exits_zero() -> None:
    grouped = Counter(name for names in ChatTurnsSettings.help_groups.values() for name in names)
    assert set(grouped) == set(ChatTurnsSettings.model_fields) and max(grouped.values()) == 1
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit) as exited:
        chat_turns.parser().parse_args(["--help"])
    assert exited.value.code == 0 and "running servers:" in shown.getvalue()


def test_quick_defaults_and_one_of_cloud_or_serve(tmp_path: Path) -> None:
    quick = ChatTurnsSettings(quick=True, out=tmp_path)
    assert (quick.turns, quick.max_new_tokens, quick.dtype) == (3, 8, "float32")
    full = ChatTurnsSettings(out=tmp_path)
    assert (full.turns, full.max_new_tokens, full.dtype) == (0, 96, "auto")
    with pytest.raises(ValueError, match="give one"):
        ChatTurnsSettings(cloud="127.0.0.1:1", serve="http://127.0.0.1:2", out=tmp_path)


def test_shipped_script_has_eight_turns_with_code_pastes() -> None:
    script = read_script(chat_turns.DEFAULT_SCRIPT, 0)
    assert len(script.turns) == 8 and script.system
    assert sum("```" in turn for turn in script.turns) >= 3
    assert len(read_script(chat_turns.DEFAULT_SCRIPT, 3).turns) == 3
    with pytest.raises(ValueError, match="has 8"):
        read_script(chat_turns.DEFAULT_SCRIPT, 9)


def test_reuse_counters_are_read_by_series(tmp_path: Path) -> None:
    page = tmp_path / "metrics"
    page.write_text(METRICS)
    assert read_counters(page.as_uri()) == {
        "specdec_prefix_reused_tokens_total": 120.0,
        'specdec_prefix_prefilled_tokens_total{engine="transformers"}': 30.0,
    }
    assert read_counters(None) is None
    assert read_counters((tmp_path / "missing").as_uri()) is None


def test_conversation_tags_differ_for_the_tiny_tokenizer_too() -> None:
    assert chat_turns.conversation_tag(0, False) == "Conversation 1."
    assert chat_turns.conversation_tag(1, False, "run-b") == "Conversation 2 of run-b."
    assert chat_turns.conversation_tag(0, True).split()[-1] != chat_turns.conversation_tag(1, True).split()[-1]


def test_keys_are_left_out_of_the_recorded_command() -> None:
    given = ["--serve", "http://h:1", "--serve-api-key", "k1", "--api-key=k2", "--out", "d"]
    assert chat_turns._redacted(given) == ["--serve", "http://h:1", "--serve-api-key", "***", "--api-key=***", "--out", "d"]


def _turn(number: int, prompt: int, ttft: float) -> dict[str, object]:
    return {
        "turn": number,
        "prompt_tokens": prompt,
        "ttft_s": ttft,
        "total_s": ttft + 0.5,
        "completion_tokens": 11,
        "decode_tokens_per_s": 20.0,
        "counters": {"verifier": {"specdec_prefix_reused_tokens_total": float(prompt // 2)}, "edge": None},
    }


def test_summary_takes_medians_and_the_headline_max_over_turn_one() -> None:
    conversations = [
        {"repeat": 1, "turns": [_turn(1, 100, 0.2), _turn(2, 400, 0.3), _turn(3, 900, 0.5)]},
        {"repeat": 2, "turns": [_turn(1, 100, 0.4), _turn(2, 400, 0.3), _turn(3, 900, 0.3)]},
    ]
    summary = summarize(conversations)
    assert [row["ttft_s"] for row in summary["turns"]] == pytest.approx([0.3, 0.3, 0.4])
    assert summary["turns"][2]["ttft_over_turn1"] == pytest.approx(4 / 3)
    assert summary["max_ttft_over_turn1"] == pytest.approx(4 / 3)
    assert summary["max_ttft_over_turn1_by_repeat"] == pytest.approx([2.5, 0.75])
    assert max_over_first([None, 0.1]) is None and max_over_first([0.2]) is None

    machine = {"cpu_model": "cpu", "cpu_flags": "avx2", "cores": 2, "memory_gib": 8}
    settings = {"serve": "started", "mode": "auto", "engine": "transformers", "cloud": "started"}
    settings |= {"turns": 3, "repeats": 2, "max_new_tokens": 96, "temperature": 0.0}
    result = {"settings": settings, "summary": summary, "machine": machine, "date": "d", "command": "c"}
    report = markdown(result | {"repeats": conversations})
    assert "Max TTFT of turns >= 2 over turn 1's: 1.33x" in report
    assert "| 3 | 900 | 400 | 1.33 | 900 | 11 | 20.0 |" in report
    assert "`verifier: specdec_prefix_reused_tokens_total`" in report
    json.dumps(result)  # the result is plain JSON
