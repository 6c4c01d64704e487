"""Auto mode's rule on measured rates (edge/round/mode_switch.py), without a model or a wire."""

import pytest

from edge.round.mode_switch import CLOUD_ONLY, SPECULATIVE, ModeMemory, ModeSwitch, Plan, SwitchRules


def _warm_start(switch: ModeSwitch, target_tok_s: float) -> None:
    """The first stretch (two tokens: the prefill's, then one step at the target's rate), then
    the drafter is ready."""
    first = switch.plan(drafter_ready=False, generated=0)
    assert (first.mode, first.tokens) == (CLOUD_ONLY, 2)
    switch.stretch_done(0.0, [1 / target_tok_s])
    assert switch.target_rate == pytest.approx(target_tok_s)
    assert switch.plan(drafter_ready=True, generated=2).mode == SPECULATIVE


def _rounds(switch: ModeSwitch, n: int, tokens: int, seconds: float, generated: int) -> list[str]:
    modes = []
    for i in range(n):
        switch.round_done(tokens, seconds)
        modes.append(switch.plan(True, generated + (i + 1) * tokens).mode)
    return modes


def test_the_first_stretches_double_while_the_drafter_prefills() -> None:
    switch = ModeSwitch()
    sizes = []
    for _ in range(5):
        plan = switch.plan(drafter_ready=False, generated=sum(sizes))
        assert plan.mode == CLOUD_ONLY
        sizes.append(plan.tokens)
        switch.stretch_done(0.1, [0.1] * (plan.tokens - 1))
    assert sizes == [2, 4, 8, 16, 16]
    assert [s.why for s in switch.switches] == ["start"]
    assert switch.target_rate == 10.0


def test_faster_speculation_is_kept_and_the_target_measured_again_later() -> None:
    switch = ModeSwitch(SwitchRules(reprobe_after_tokens=30))
    _warm_start(switch, target_tok_s=5.0)
    modes = _rounds(switch, 8, tokens=4, seconds=0.5, generated=1)  # 8 tok/s against 5
    assert modes[:7] == [SPECULATIVE] * 7
    assert modes[7] == CLOUD_ONLY and switch.switches[-1].why == "probe_target"  # 32 tokens: past 30
    assert switch.plan(True, 40).mode == SPECULATIVE  # after the 4-token stretch: back to speculation


def test_slower_speculation_backs_off_in_doubling_stretches_and_a_winning_probe_resets_them() -> None:
    rules = SwitchRules(backoff_tokens=16, max_backoff_tokens=64)
    switch = ModeSwitch(rules)
    _warm_start(switch, target_tok_s=10.0)
    stretches = []
    for _ in range(4):  # each probe: 3 rounds at 4 tok/s, then a stretch
        modes = _rounds(switch, 3, tokens=2, seconds=0.5, generated=0)
        assert modes[:2] == [SPECULATIVE] * 2 and modes[2] == CLOUD_ONLY
        stretches.append(switch.switches[-1])
        switch.stretch_done(0.1, [0.1] * 15)  # 16 tokens: a longer stretch goes on first
        if switch.holding:
            rest = switch.plan(True, 0)
            assert rest.mode == CLOUD_ONLY and not rest.reason
            switch.stretch_done(0.1, [0.1] * (rest.tokens - 1))
        assert switch.plan(True, 0).mode == SPECULATIVE and switch.switches[-1].why == "probe_speculation"
    assert [s.why for s in stretches] == ["slower"] * 4
    assert "4.00 tok/s < 0.95 x target 10.00 tok/s" in stretches[0].reason
    # the stretch lengths: 16, 32, 64, 64 (capped); a probe that wins resets to 16
    assert _rounds(switch, 3, tokens=6, seconds=0.5, generated=0) == [SPECULATIVE] * 3
    assert _rounds(switch, 1, tokens=1, seconds=1.0, generated=0) == [CLOUD_ONLY]


def test_stretch_lengths_follow_the_backoff() -> None:
    switch = ModeSwitch(SwitchRules(backoff_tokens=16, max_backoff_tokens=64))
    _warm_start(switch, target_tok_s=10.0)
    lengths = []
    for _ in range(4):
        for _ in range(2):
            switch.round_done(2, 0.5)
            switch.plan(True, 0)
        switch.round_done(2, 0.5)
        plan = switch.plan(True, 0)
        lengths.append(plan.tokens)
        switch.stretch_done(0.1, [0.1] * (plan.tokens - 1))
        switch.plan(True, 0)
    assert lengths == [16, 32, 64, 64]


def test_the_prefills_step_is_no_decoding_rate() -> None:
    switch = ModeSwitch()
    switch.plan(False, 0)
    switch.stretch_done(0.0, [0.05, 0.05, 0.05])  # the first token came with the prefill: not counted
    assert switch.target_rate == pytest.approx(20.0)
    switch.stretch_done(0.1, [0.1])  # a later stretch's first step counts
    assert switch.target_rate == pytest.approx(0.5 * 20.0 + 0.5 * 10.0)


def test_speculation_is_judged_only_against_a_measured_target_rate() -> None:
    switch = ModeSwitch(SwitchRules(min_rounds=3, reprobe_target_tokens=4))
    switch.plan(False, 0)
    switch.stretch_done(0.0, [])  # cut short after the prefill's token: the target's rate is unknown
    assert switch.plan(True, 1).mode == SPECULATIVE
    assert _rounds(switch, 2, tokens=1, seconds=10.0, generated=1) == [SPECULATIVE] * 2  # under min_rounds
    switch.round_done(1, 10.0)
    plan = switch.plan(True, 4)
    assert (plan.mode, plan.tokens, switch.switches[-1].why) == (CLOUD_ONLY, 4, "probe_target")
    switch.stretch_done(0.05, [0.05] * 3)
    assert switch.target_rate == pytest.approx(20.0)


def test_the_drafter_prefills_between_stretches_where_it_shares_the_verifiers_cores(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from edge import config
    from edge.config import EdgeSettings

    monkeypatch.setattr(config, "runs_on_every_core", lambda: True)
    assert not EdgeSettings().prefills_beside()  # no --cloud: a verifier on this machine
    assert not EdgeSettings(cloud="127.0.0.1:50051,[::1]:50052").prefills_beside()
    assert EdgeSettings(cloud="10.0.0.7:50051").prefills_beside()
    assert EdgeSettings(cloud="127.0.0.1:50051", draft_prefill="beside").prefills_beside()
    assert not EdgeSettings(cloud="gpu-box:50051", draft_prefill="between").prefills_beside()
    monkeypatch.setattr(config, "runs_on_every_core", lambda: False)  # pinned apart from the verifier
    assert EdgeSettings(cloud="127.0.0.1:50051").prefills_beside()


def test_a_lost_probe_holds_the_next_generation_on_the_target_until_its_backoff_is_spent() -> None:
    memory = ModeMemory()
    first = ModeSwitch(SwitchRules(backoff_tokens=16), memory)
    _warm_start(first, target_tok_s=10.0)
    assert _rounds(first, 3, tokens=2, seconds=0.5, generated=2)[-1] == CLOUD_ONLY  # 4 tok/s: lost
    first.stretch_done(0.1, [0.1] * 9)  # the generation ends 10 tokens into its 16-token stretch
    first.remember()
    assert (memory.hold, memory.backoff) == (6, 32) and memory.target_rate == pytest.approx(10.0)

    second = ModeSwitch(SwitchRules(backoff_tokens=16), memory)
    start = second.plan(drafter_ready=False, generated=0)
    assert (start.mode, start.tokens, second.switches[0].why) == (CLOUD_ONLY, 6, "start")
    assert second.holding and "lost its last probe" in start.reason
    second.stretch_done(0.0, [0.1] * 5)
    assert not second.holding
    assert second.plan(drafter_ready=True, generated=6).mode == SPECULATIVE  # the probe is due
    assert _rounds(second, 3, tokens=2, seconds=0.5, generated=6)[-1] == CLOUD_ONLY  # lost again
    assert second.plan(True, 12) == Plan(CLOUD_ONLY, 32)  # the backoff went on doubling

    third = ModeSwitch(SwitchRules(backoff_tokens=16), ModeMemory())
    assert third.plan(False, 0).tokens == 2  # a fresh memory: the usual start


def test_a_winning_probe_leaves_the_next_generation_free_to_speculate() -> None:
    memory = ModeMemory(target_rate=10.0, backoff=64, hold=0)
    switch = ModeSwitch(SwitchRules(backoff_tokens=16), memory)
    _warm_start(switch, target_tok_s=10.0)
    assert _rounds(switch, 3, tokens=8, seconds=0.5, generated=2) == [SPECULATIVE] * 3  # 16 tok/s
    switch.remember()
    assert (memory.hold, memory.backoff) == (0, 16)
