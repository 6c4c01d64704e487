"""bench/studies/prefix_isolation.py end to end on a tiny random model in seconds: the probe finds
no reuse across keys or keys-off clients and finds it where the cache is shared; the flood
leaves key B's kept conversation whole; the report leads with the cross-scope count."""

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.studies.prefix_isolation import OPENERS, PAIRS, PrefixIsolationSettings
from tests.tiny_models import save_model, tiny_target

PROMPT, TURN, REPLY = 48, 6, 4


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[PrefixIsolationSettings, dict[str, Any]]:
    folder = save_model(tiny_target(), tmp_path_factory.mktemp("prefix_isolation") / "target")
    settings = PrefixIsolationSettings(
        model=str(folder),
        out=folder.parent / "out",
        dtype="float32",
        threads=torch.get_num_threads(),  # as it is: the study sets torch's threads for the whole process
        prompt_tokens=PROMPT,
        turn_tokens=TURN,
        reply_tokens=REPLY,
        flood_prompts=8,  # 4 kept prefixes, then 4 idle sessions: room for 4 prompts, so one is evicted
        repeats=1,
    )
    return settings, asyncio.run(settings.measure("python -m bench.studies.prefix_isolation ..."))


def test_every_flag_is_in_one_help_group() -> None:
    grouped = Counter(name for names in PrefixIsolationSettings.help_groups.values() for name in names)
    assert set(grouped) == set(PrefixIsolationSettings.model_fields) and max(grouped.values()) == 1


def test_no_open_reuses_another_clients_prefix_unless_the_cache_is_shared(
    measured: tuple[PrefixIsolationSettings, dict[str, Any]],
) -> None:
    probe = measured[1]["probe"]
    assert [(r["pair"], r["path"]) for r in probe["rows"]] == [(pair, path) for pair in PAIRS for path in OPENERS]
    assert probe["cross_scope_reuses"] == 0 and probe["isolated_opens"] == 6
    for row in probe["rows"]:
        assert row["own_reused"] >= PROMPT - 1  # its own prompt, all but (at most) the row the open feeds
        shared = PAIRS[row["pair"]][1]
        assert (row["other_reused"] >= PROMPT - 1) if shared else (row["other_reused"] == 0)


def test_the_flood_leaves_key_bs_conversation_kept(measured: tuple[PrefixIsolationSettings, dict[str, Any]]) -> None:
    flood = measured[1]["flood"]
    (run,) = flood["runs"]
    for side in ("no_flood", "flood"):
        assert run[side]["reused"] == PROMPT + REPLY - 1  # the history and the reply, less its last token
        assert run[side]["computed"] == TURN + 1 and flood["median"][side]["computed"] == TURN + 1
    assert run["flood"]["evictions"].get("kv_cap", 0) >= 1  # key A's own idle sessions made its room
    assert run["no_flood"]["evictions"] == {}
    assert flood["ttft_ratio"] > 0


def test_the_report_leads_with_the_cross_scope_count(measured: tuple[PrefixIsolationSettings, dict[str, Any]]) -> None:
    settings, result = measured
    report = settings.report(result)
    assert report.splitlines()[2].startswith("**Cross-scope reuses: 0** of 6")
    assert result["machine"]["cpu_flags"] in report and "| decode | keys-off shared |" in report
    assert Path(settings.model).name == result["model"]
