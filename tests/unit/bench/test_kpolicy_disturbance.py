"""bench/studies/kpolicy_disturbance.py without a model: the phases a run's progress enters, the
link and the busy loop they set, and the recovery and settling figures read from round logs."""

import socket
import time

import pytest

from bench.processes import Placement
from bench.runner import Run
from bench.studies.kpolicy_disturbance import (
    Disturbance,
    SteppedLink,
    phase_bounds,
    rounds_until,
    scenarios,
    settled_from,
    summarize,
)
from bench.systems import BUILT_IN

IDS = [f"p{i}" for i in range(9)]


def test_settling_compares_each_prompt_with_the_reference_on_it() -> None:
    def rounds(ks_by_prompt: list[list[int]]) -> list[dict[str, object]]:
        return [{"id": f"q{i}", "k": k} for i, ks in enumerate(ks_by_prompt) for k in ks]

    ids = ["q0", "q1", "q2", "q3"]
    reference = rounds([[4] * 10, [7] * 10, [3] * 10, [5] * 10])  # k follows each text
    assert settled_from(rounds([[4] * 10, [6] * 10, [3] * 8, [5] * 9]), reference, ids) == 0
    # the first prompt still drafts as before the step; from the second on, as the reference
    assert settled_from(rounds([[2] * 12, [7, 8] * 5, [4] * 10, [5] * 10]), reference, ids) == 12
    # a relapse: settled only from the prompt after it
    assert settled_from(rounds([[4] * 10, [1] * 10, [3] * 10, [5] * 10]), reference, ids) == 20
    assert settled_from(rounds([[4] * 10, [7] * 10, [3] * 10, [9] * 10]), reference, ids) is None


def test_the_prompts_that_start_after_some_rounds() -> None:
    rounds = [{"id": p, "k": 3} for p, n in (("a", 20), ("b", 15), ("c", 20)) for _ in range(n)]
    assert rounds_until(rounds, ["a", "b", "c"], 30) == ["c"]
    assert rounds_until(rounds, ["a", "b", "c"], 0) == ["a", "b", "c"]


def fake_run(k_by_prompt: dict[str, list[int]], seconds_by_prompt: dict[str, float]) -> Run:
    records = [{"id": p, "token_ids": [0] * 64, "elapsed_s": seconds_by_prompt[p]} for p in IDS]
    rounds = [{"id": p, "k": k, "accepted_len": k} for p in IDS for k in k_by_prompt[p]]
    return Run(BUILT_IN["speculative"], Placement("pinned"), 5.0, records, rounds, 0, 0.0)


def test_the_summary_compares_each_disturbance_with_the_run_at_its_rtt() -> None:
    settled = {p: [4] * 20 for p in IDS}
    quiet = fake_run(settled, dict.fromkeys(IDS, 4.0))
    # the hog halves the first third's speed; the first 30 rounds after it are a little slow
    hog_seconds = {p: 8.0 if i < 3 else (5.0 if i == 3 else 4.0) for i, p in enumerate(IDS)}
    hog = fake_run(settled, hog_seconds)
    far = fake_run({p: [7] * 20 for p in IDS}, dict.fromkeys(IDS, 6.0))
    step_ks = {p: ([7] * 20 if 3 <= i < 6 else [4] * 20) for i, p in enumerate(IDS)}
    step_ks["p3"] = [4] * 15 + [7] * 5  # the step up followed from the second prompt after it
    step_ks["p6"] = [7] * 8 + [4] * 12  # the step down at once (median 4 within the first prompt)
    step = fake_run(step_ks, dict.fromkeys(IDS, 5.0))
    summary = summarize({"quiet": quiet, "hog": hog, "rtt-step": step, "quiet-80": far}, IDS, scenarios(5.0, 80.0))
    recovery = summary["hog_recovery"]
    assert recovery["ratio_during"] == 0.5
    assert recovery["prompts_from_round_30"] == ["p5", "p6", "p7", "p8"]
    assert recovery["ratio_from_round_30"] == 1.0 and recovery["ratio_after"] < 1.0
    up, down = summary["rtt_step"]
    assert up["reference_median_k_by_prompt"] == [7.0, 7.0, 7.0] and up["median_k_by_prompt"] == [4.0, 7.0, 7.0]
    assert (up["settled_from_round"], down["settled_from_round"]) == (20, 0)
    hog_phases = summary["scenarios"]["hog"]["phases"]
    assert [p["hog"] for p in hog_phases] == [True, False, False]
    assert hog_phases[0]["tokens_per_s"] == 8.0 and hog_phases[2]["tokens_per_s"] == 16.0


def test_a_run_enters_each_phase_as_its_prompts_finish() -> None:
    """The link's RTT and a busy loop on the verifier's core follow the prompts done."""
    assert phase_bounds(12) == (4, 8)
    listener = socket.create_server(("127.0.0.1", 0))
    target = f"127.0.0.1:{listener.getsockname()[1]}"
    hog, step = scenarios(5.0, 80.0)[1:3]
    try:
        with SteppedLink(target) as link:
            proxy = link._proxy  # noqa: SLF001 - the conditions the proxy applies
            with Disturbance(hog, link, "0", 12) as disturbance:
                assert disturbance._hog is not None and disturbance._hog.poll() is None  # noqa: SLF001
                busy = disturbance._hog  # noqa: SLF001
                disturbance.progress(3)
                assert busy.poll() is None
                disturbance.progress(4)
                assert busy.poll() is not None and disturbance._hog is None  # noqa: SLF001
            with Disturbance(step, link, "0", 12) as disturbance:
                for done, rtt in ((0, 5.0), (4, 80.0), (7, 80.0), (8, 5.0)):
                    disturbance.progress(done)
                    assert _eventually(lambda: proxy.conditions.rtt_ms == rtt), (done, rtt)  # noqa: B023
                assert disturbance._hog is None  # noqa: SLF001
    finally:
        listener.close()


def _eventually(check: object, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("prompts", [3, 6, 12])
def test_thirds_cover_every_prompt(prompts: int) -> None:
    first, second = phase_bounds(prompts)
    assert 0 < first < second < prompts
