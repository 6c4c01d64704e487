"""bench/loadtest_capacity.py without a verifier: the search over levels and the ITL rules."""

import asyncio

import pytest

from bench.loadtest_capacity import CapacitySearch, _level, itl_as_seen, itl_smoothed, search_mode, steady
from bench.loadtest_replay import Delivery, LoadClock


def _search(threshold: int, cap: int, resolution: float = 0.0) -> tuple[int, list[int]]:
    async def measure(n: int) -> dict:  # type: ignore[type-arg]
        return {"sessions": n, "meets_slo": n <= threshold}

    found, levels = asyncio.run(search_mode(measure, cap, resolution=resolution))
    return found, [level["sessions"] for level in levels]


@pytest.mark.parametrize(
    ("threshold", "cap", "levels"),
    [
        (0, 64, [1]),  # one session already misses: capacity 0
        (1, 64, [1, 2]),
        (5, 64, [1, 2, 4, 5, 6, 8]),  # doubling to the first miss, then bisection
        (64, 64, [1, 2, 4, 8, 16, 32, 64]),
        (100, 20, [1, 2, 4, 8, 16, 20]),  # every doubling met it: the cap itself is tried
        (17, 20, [1, 2, 4, 8, 16, 17, 18, 20]),
    ],
)
def test_search_finds_the_largest_level_meeting_the_target(threshold: int, cap: int, levels: list[int]) -> None:
    found, measured = _search(threshold, cap)
    assert found == min(threshold, cap)
    assert measured == levels


def test_a_coarser_resolution_stops_the_bisection_within_that_fraction() -> None:
    found, measured = _search(100, 128, resolution=0.1)
    assert measured == [1, 2, 4, 8, 16, 32, 64, 96, 104, 112, 128]  # 96 met, 104 missed: within 10% of 96
    assert found == 96
    exact, _ = _search(100, 128)
    assert exact == 100


def test_levels_known_from_a_run_cut_short_are_not_measured_again() -> None:
    asked: list[int] = []

    async def measure(n: int) -> dict:  # type: ignore[type-arg]
        asked.append(n)
        return {"sessions": n, "meets_slo": n <= 5}

    known = {n: {"sessions": n, "meets_slo": n <= 5} for n in (1, 2, 4)}
    found, levels = asyncio.run(search_mode(measure, 64, known))
    assert found == 5 and asked == [8, 6, 5]
    assert [level["sessions"] for level in levels] == [1, 2, 4, 5, 6, 8]


def test_itl_as_seen_and_smoothed() -> None:
    deliveries = [Delivery(30.0, 3, 1.0), Delivery(10.0, 1, 2.0)]
    assert itl_as_seen(deliveries) == [30.0, 0.0, 0.0, 10.0]  # tokens of one reply arrive together
    assert itl_smoothed(deliveries) == [10.0, 10.0, 10.0, 10.0]
    search = CapacitySearch(slo_itl_p95_ms=50, step_s=10.0)
    timed = [Delivery(1.0, 1, 0.5), Delivery(2.0, 1, 5.0), Delivery(3.0, 1, 11.0)]
    assert steady(timed, search) == [timed[1]]  # the ramp and the tail are left out
    assert steady(timed[:1], search) == timed[:1]  # a level too short for a steady part keeps all


def _level_meets(sessions_delivering: list[int], n: int) -> bool:
    async def level() -> bool:
        clock = LoadClock()
        clock.deliveries = [Delivery(100.0, 2, 5.0, session) for session in sessions_delivering]
        search = CapacitySearch(slo_itl_p95_ms=500, step_s=10.0)
        return bool(_level(n, "cloud_only", clock, [], 10.0, None, 0.0, search)["meets_slo"])

    return asyncio.run(level())


def test_a_level_meets_the_target_only_when_every_worker_got_tokens() -> None:
    assert _level_meets([0, 1], n=2)
    assert _level_meets([0, 3], n=2)  # session 3 is worker 1's second session
    assert not _level_meets([0, 2], n=2)  # worker 1 never got tokens: a stall, not a fast level


def test_tpot_is_first_to_last_token_over_the_later_tokens_per_session() -> None:
    from bench.loadtest_capacity import tpot_per_session

    # session 0: first 2 tokens at 1 s, 3 more at 2 s and 4 at 3.5 s: 2.5 s over 7 tokens
    deliveries = [Delivery(0.0, 2, 1.0, 0), Delivery(0.0, 3, 2.0, 0), Delivery(0.0, 4, 3.5, 0), Delivery(0.0, 5, 1.0, 1)]
    assert tpot_per_session(deliveries) == [2500.0 / 7]  # session 1 has no tokens after its first ones


def test_a_tpot_target_judges_the_rate_a_reader_sees_where_the_itl_target_judges_the_gaps() -> None:
    """3 tokens every 900 ms: ITL p95 900 ms, TPOT 300 ms."""

    def meets(search: CapacitySearch) -> bool:
        async def level() -> bool:
            clock = LoadClock()
            clock.deliveries = [Delivery(900.0, 3, 0.9 * (i + 1), 0) for i in range(10)]
            return bool(_level(1, "speculative", clock, [], 10.0, None, 0.0, search)["meets_slo"])

        return asyncio.run(level())

    assert not meets(CapacitySearch(slo_itl_p95_ms=500, step_s=100.0))
    assert meets(CapacitySearch(slo_itl_p95_ms=None, slo_tpot_p95_ms=500, step_s=100.0))
    assert not meets(CapacitySearch(slo_itl_p95_ms=None, slo_tpot_p95_ms=250, step_s=100.0))


def test_the_default_target_is_the_pace_a_reader_feels(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--find-capacity without a latency target: TPOT p95 <= 50 ms (20 tokens/s) and TTFT p95 <= 1 s;
    a target given is kept as given."""
    from bench.loadtest import LoadtestSettings

    plain = LoadtestSettings(cloud="127.0.0.1:1", output=str(tmp_path / "c.json"), find_capacity=True)
    assert (plain.slo_tpot_p95_ms, plain.slo_ttft_p95_ms, plain.slo_itl_p95_ms) == (50.0, 1000.0, None)
    itl = LoadtestSettings(cloud="127.0.0.1:1", output=str(tmp_path / "c.json"), find_capacity=True, slo_itl_p95_ms=80)
    assert (itl.slo_tpot_p95_ms, itl.slo_ttft_p95_ms, itl.slo_itl_p95_ms) == (None, None, 80)


def test_the_predicted_bound_reads_the_traces_drafting_and_the_baselines_step() -> None:
    """1 + gamma * t_draft / t_verify: the shipped laptop traces' drafts per round and think-time
    per drafted token (scaled as replayed), over vLLM alone's one-session step where measured."""
    from pathlib import Path

    from bench.loadtest_capacity import DraftCosts, draft_costs, predicted_bound
    from edge.trace import VerifyEvent, read_traces

    traces = read_traces(Path(__file__).resolve().parents[3] / "bench" / "data" / "traces" / "laptop")
    drafts = [len(e.request.draft_tokens) for t in traces for e in t.events if isinstance(e, VerifyEvent) and e.error is None]
    costs, scaled = draft_costs(traces, 1.0), draft_costs(traces, 0.5)
    assert costs is not None and scaled is not None
    assert costs.drafts_per_round == pytest.approx(sum(drafts) / len(drafts))
    assert scaled.draft_ms_per_token == pytest.approx(costs.draft_ms_per_token / 2)

    def level(ms: float) -> dict:  # type: ignore[type-arg]
        return {"sessions": 1, "tpot_ms": {"p50": ms}}

    points = {"cloud_only": [level(20.0)], "vllm_alone": [level(5.0)]}
    bound = predicted_bound(DraftCosts(4.0, 10.0), points)
    assert bound is not None and bound["over"] == "vllm_alone" and bound["sessions_ratio"] == 1 + 4 * 10 / 5
    assert predicted_bound(DraftCosts(4.0, 10.0), {"cloud_only": [level(20.0)]})["sessions_ratio"] == 3.0  # type: ignore[index]
    assert predicted_bound(None, points) is None and predicted_bound(DraftCosts(4.0, 10.0), {}) is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"systems": "speculative,vllm"}, "--systems: each one of"),
        ({"systems": " , "}, "--systems: each one of"),
        ({"systems": "cloud_only,vllm_alone"}, "vllm_alone needs --vllm-url"),
    ],
)
def test_bad_systems_are_refused_with_one_readable_reason(tmp_path, fields: dict, message: str) -> None:  # type: ignore[no-untyped-def,type-arg]
    from pydantic import ValidationError

    from bench.loadtest import LoadtestSettings

    with pytest.raises(ValidationError, match=message):
        LoadtestSettings(cloud="127.0.0.1:1", output=str(tmp_path / "c.json"), find_capacity=True, **fields)


@pytest.mark.parametrize("url", ["https://127.0.0.1:8000", "127.0.0.1:8000", "http://127.0.0.1", "http://:8000"])
def test_the_vllm_url_must_name_an_http_host_and_port(url: str) -> None:
    from bench.loadtest_vllm import PeerServer
    from shared.errors import ConfigError

    with pytest.raises(ConfigError, match="--vllm-url must be http://HOST:PORT"):
        PeerServer.from_url(url)
    assert PeerServer.from_url("http://127.0.0.1:8000").port == 8000


def test_a_vllm_url_off_this_machine_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from bench.loadtest import LoadtestSettings, check_targets
    from shared.errors import ConfigError

    settings = LoadtestSettings(
        cloud="127.0.0.1:1", output=str(tmp_path / "c.json"), systems="vllm_alone", vllm_url="http://10.0.0.1:8000"
    )
    with pytest.raises(ConfigError, match="--vllm-url must be on this machine"):
        check_targets(settings)
