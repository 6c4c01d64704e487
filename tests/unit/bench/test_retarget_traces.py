"""bench/retarget_traces.py: a recorded greedy session rewritten for another target keeps each
round's k and accepted length, and its replies are that target's own greedy tokens (checked
against one plain forward pass over the whole output, not the rewriting code)."""

import pytest

from bench.retarget_traces import main, retarget
from edge.trace import OpenEvent, SessionTrace, TraceEnd, TraceError, TraceHeader, VerifyEvent, read_traces, write_trace
from shared import lm
from shared.protocol import SamplingParams, VerifyRequest

PROMPT = [5, 9, 14, 3, 27]
ROUNDS = [(4, 2), (4, 4), (4, 0), (3, 1)]  # (k, accepted_len) as recorded


def _trace(accept_mode: str = "greedy") -> SessionTrace:
    header = TraceHeader("speculative", PROMPT, SamplingParams(), 0, accept_mode, 96, 32, [])
    events: list = [OpenEvent(0.0, 0.1, 0, [], len(PROMPT))]
    position = len(PROMPT)
    for i, (k, accepted) in enumerate(ROUNDS):
        request = VerifyRequest("", position, [7] * k)  # what the recorded drafter proposed
        events.append(VerifyEvent(1.0 + i, 1.5 + i, request, accepted, 8, accepted == k, position + accepted + 1, 400.0))
        position += accepted + 1
    return SessionTrace(header, events, TraceEnd(9.0, [], "length", len(ROUNDS)), "recorded")


def test_rounds_accept_what_was_recorded_and_reply_the_targets_greedy_tokens(target_model) -> None:
    rewritten = retarget(_trace(), target_model, "tiny")
    output = rewritten.end.output_tokens
    assert len(output) == sum(accepted + 1 for _, accepted in ROUNDS)
    logits = lm.forward(target_model, lm.new_cache(target_model), PROMPT + output[:-1])  # [n, V]
    assert logits[len(PROMPT) - 1 :].argmax(-1).tolist() == output  # the target's own greedy text
    rounds = [e for e in rewritten.events if isinstance(e, VerifyEvent)]
    start = 0
    for event, (k, accepted) in zip(rounds, ROUNDS, strict=True):
        drafts = event.request.draft_tokens
        assert len(drafts) == k and event.accepted_len == accepted
        assert drafts[:accepted] == output[start : start + accepted]  # accepted: the target's choices
        if accepted < k:
            assert drafts[accepted] != output[start + accepted]  # then one it rejects
        assert event.next_token == output[start + accepted]
        start += accepted + 1
    assert [e.t for e in rewritten.events] == [e.t for e in _trace().events]  # think-time kept


def test_only_greedy_traces_can_be_rewritten(target_model) -> None:
    with pytest.raises(TraceError, match="only greedy"):
        retarget(_trace("sparse"), target_model, "tiny")


def test_the_command_rewrites_a_folder_and_refuses_sampled_traces_in_one_line(target_model, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    target_model.save_pretrained(tmp_path / "model")
    write_trace(tmp_path / "greedy" / "recorded.jsonl", _trace())
    flags = ["--model", str(tmp_path / "model"), "--device", "cpu", "--dtype", "float32"]
    assert main(["--traces", str(tmp_path / "greedy"), "--out", str(tmp_path / "out"), *flags]) == 0
    (written,) = read_traces(tmp_path / "out")
    assert written.end.output_tokens == retarget(_trace(), target_model, "model").end.output_tokens
    write_trace(tmp_path / "sampled" / "recorded.jsonl", _trace("sparse"))
    capsys.readouterr()
    assert main(["--traces", str(tmp_path / "sampled"), "--out", str(tmp_path / "out2"), *flags]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    want = "python -m bench.retarget_traces: error: recorded: only greedy speculative traces can be retargeted"
    assert err.splitlines()[-1] == want
