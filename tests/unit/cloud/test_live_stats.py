"""The live page's rolling window: per-second series, tau, acceptance by position, percentiles."""

from cloud.live import LiveStats


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_series_cover_complete_seconds_and_totals_the_window() -> None:
    clock = Clock()
    stats = LiveStats(max_draft_tokens=4, window_s=10, clock=clock)
    stats.record_round(k=4, accepted_len=4, verify_ms=10.0)  # second 1000
    stats.record_round(k=2, accepted_len=0, verify_ms=30.0)
    clock.now = 1002.5
    stats.record_round(k=3, accepted_len=1, verify_ms=20.0)  # second 1002, under way
    snap = stats.snapshot()
    assert snap["seconds_ago"][0] == -10 and snap["seconds_ago"][-1] == -1
    assert snap["rounds_per_s"][-2:] == [2, 0]  # seconds 1000, 1001; 1002 is not complete yet
    assert snap["tau"][-2] == 3.0 and snap["tau"][-1] is None  # (5 + 1) / 2 tokens per round
    window = snap["window"]
    assert window["rounds"] == 3 and window["tau"] == (5 + 1 + 2) / 3
    assert window["drafted_by_position"] == [3, 3, 2, 1]
    assert window["acceptance_by_position"] == [2 / 3, 1 / 3, 1 / 2, 1.0]
    assert window["latency_ms"] == {"p50": 20.0, "p90": 30.0, "p99": 30.0}


def test_old_seconds_leave_the_window() -> None:
    clock = Clock()
    stats = LiveStats(max_draft_tokens=2, window_s=5, clock=clock)
    stats.record_round(k=2, accepted_len=2, verify_ms=1.0)
    clock.now += 6
    snap = stats.snapshot()
    assert sum(snap["rounds_per_s"]) == 0 and snap["window"]["rounds"] == 0
    assert snap["window"]["tau"] is None and snap["window"]["acceptance_by_position"] == [None, None]


def test_latency_samples_stay_bounded_under_load() -> None:
    stats = LiveStats(max_draft_tokens=1, clock=Clock())
    for i in range(10_000):
        stats.record_round(k=1, accepted_len=1, verify_ms=float(i))
    bucket = next(iter(stats._seconds.values()))
    assert bucket.rounds == 10_000 and len(bucket.latencies_ms) == 256
    assert 2_000 < stats.snapshot()["window"]["latency_ms"]["p50"] < 8_000  # a fair sample, not the first 256
