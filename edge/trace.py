"""Session traces: what `edge-agent --record DIR` writes and `loadtest` replays.

One JSONL file per session (generation of one prompt), token ids and numbers only, no text:

  line 1   {"type": "session", "version": 1, "mode", "draft_model", "target_model", "prompt_tokens",
            "sampling": {temperature, top_k, top_p, repetition_penalty}, "seed", "accept_mode",
            "vocab_size", "max_new_tokens", "stop_token_ids", "started_at" (unix s), "edge": {k policy,
            drafter, overlap, timeout mode, ...}}
  then     {"type": "open", "t", "t_reply", "seed", "prefix_tokens", "position", "prefill_ms", "error"}
           {"type": "verify", "t", "t_reply", "base_position", "committed_tokens", "draft_tokens",
            "draft_probs", "hard_mask", "sparse_draft": [{token_ids, probs}], "want_top_k",
            "accepted_len", "next_token", "bonus", "new_base_position", "verify_ms", "queue_ms",
            "resends", "error"}
           {"type": "generate", "t", "t_first", "t_reply", "max_new_tokens", "stop_token_ids", "tokens", "error"}
  last     {"type": "end", "t", "output_tokens", "finish_reason", "rounds", "reopens"}

Times are seconds since the session started (`t` = send, `t_reply` = reply received), so a
replay keeps the edge's think-time between a reply and the next request. `error` is a gRPC
status name, or null when the call succeeded (a failed call has no reply fields).

A session that lost its verifier session (NOT_FOUND after an eviction, a restart, a position
drift) shows the failed Verify with its error, then a second "open" whose `prefix_tokens` are the
tokens generated so far (the edge reopens on prompt + prefix, with the seed it sent); the
replayer replays that reopen too. Calls the edge cancelled itself (accept-unverified's soft
deadline) are not recorded: their outcome is unknown to the edge too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shared.protocol import (
    SamplingParams,
    SparseDistribution,
    VerifyRequest,
)

TRACE_VERSION = 1


class TraceError(ValueError):
    """A trace file that is not a version-1 session trace; reported as one line."""


@dataclass(frozen=True)
class TraceHeader:
    mode: str  # speculative | cloud_only
    prompt_tokens: list[int]
    sampling: SamplingParams
    seed: int
    accept_mode: str
    vocab_size: int
    max_new_tokens: int
    stop_token_ids: list[int]
    draft_model: str = ""
    target_model: str = ""  # the verifier's model id, from its OpenSession reply
    started_at: float = 0.0  # unix seconds: arrival times of a set of traces
    edge: dict[str, Any] = field(default_factory=dict)  # k policy, drafter, overlap, timeouts: context only


@dataclass(frozen=True)
class OpenEvent:
    t: float
    t_reply: float
    seed: int
    prefix_tokens: list[int]  # generated tokens the session was (re)opened on, after the prompt
    position: int = 0
    prefill_ms: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class VerifyEvent:
    t: float
    t_reply: float
    request: VerifyRequest  # session_id and request_id left empty
    accepted_len: int = 0
    next_token: int = 0
    bonus: bool = False
    new_base_position: int = 0
    verify_ms: float = 0.0
    queue_ms: float = 0.0
    resends: int = 0  # RESOURCE_EXHAUSTED answers resent before this outcome
    error: str | None = None


@dataclass(frozen=True)
class GenerateEvent:
    t: float
    t_first: float | None
    t_reply: float
    max_new_tokens: int
    stop_token_ids: list[int]
    tokens: list[int]
    error: str | None = None


Event = OpenEvent | VerifyEvent | GenerateEvent


@dataclass(frozen=True)
class TraceEnd:
    t: float
    output_tokens: list[int]
    finish_reason: str
    rounds: int = 0
    reopens: int = 0


@dataclass(frozen=True)
class SessionTrace:
    header: TraceHeader
    events: list[Event]
    end: TraceEnd
    name: str = ""  # file stem

    def replied_verifies(self) -> list[VerifyEvent]:
        return [e for e in self.events if isinstance(e, VerifyEvent) and e.error is None]

    def first_open(self) -> OpenEvent | None:
        return next((e for e in self.events if isinstance(e, OpenEvent) and e.error is None), None)


# ---- JSON lines ----------------------------------------------------------------------------


def _request_json(req: VerifyRequest) -> dict[str, Any]:
    return {
        "base_position": req.base_position,
        "committed_tokens": req.committed_tokens,
        "draft_tokens": req.draft_tokens,
        "draft_probs": req.draft_probs,
        "hard_mask": [int(b) for b in req.hard_mask],
        "sparse_draft": [{"token_ids": s.token_ids, "probs": s.probs} for s in req.sparse_draft],
        "want_top_k": req.want_top_k,
    }


def _event_json(event: Event) -> dict[str, Any]:
    if isinstance(event, VerifyEvent):
        out = {"type": "verify", "t": event.t, "t_reply": event.t_reply, **_request_json(event.request)}
        reply = {k: v for k, v in asdict(event).items() if k not in ("t", "t_reply", "request")}
        return out | reply
    kind = "open" if isinstance(event, OpenEvent) else "generate"
    return {"type": kind, **asdict(event)}


def trace_lines(trace: SessionTrace) -> list[str]:
    header = asdict(trace.header)
    lines = [{"type": "session", "version": TRACE_VERSION, **header}]
    lines += [_event_json(e) for e in trace.events]
    lines.append({"type": "end", **asdict(trace.end)})
    return [json.dumps(line, separators=(",", ":")) for line in lines]


def write_trace(path: Path, trace: SessionTrace) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(trace_lines(trace)) + "\n")


def _verify_event(line: dict[str, Any]) -> VerifyEvent:
    request = VerifyRequest(
        "",
        int(line["base_position"]),
        [int(t) for t in line["draft_tokens"]],
        [float(q) for q in line["draft_probs"]],
        committed_tokens=[int(t) for t in line["committed_tokens"]],
        hard_mask=[bool(b) for b in line["hard_mask"]],
        sparse_draft=[
            SparseDistribution([int(t) for t in s["token_ids"]], [float(q) for q in s["probs"]]) for s in line["sparse_draft"]
        ],
        want_top_k=int(line["want_top_k"]),
    )
    return VerifyEvent(
        line["t"],
        line["t_reply"],
        request,
        line["accepted_len"],
        line["next_token"],
        line["bonus"],
        line["new_base_position"],
        line["verify_ms"],
        line["queue_ms"],
        line["resends"],
        line["error"],
    )


def _event(line: dict[str, Any]) -> Event:
    kind = line.pop("type")
    if kind == "verify":
        return _verify_event(line)
    if kind == "open":
        return OpenEvent(**line)
    if kind == "generate":
        return GenerateEvent(**line)
    raise TraceError(f"unknown event type {kind!r}")


def parse_trace(lines: list[str], name: str = "") -> SessionTrace:
    where = name or "trace"
    try:
        records = [json.loads(line) for line in lines if line.strip()]
    except json.JSONDecodeError as err:
        raise TraceError(f"{where}: not JSON lines ({err})") from None
    if len(records) < 2 or records[0].get("type") != "session" or records[-1].get("type") != "end":
        raise TraceError(f"{where}: expected a session header first and an end line last")
    header = records[0]
    if header.get("version") != TRACE_VERSION:
        raise TraceError(f"{where}: trace version {header.get('version')!r}, this build reads {TRACE_VERSION}")
    try:
        del header["type"], header["version"]
        header["sampling"] = SamplingParams(**header["sampling"])
        events = [_event(dict(r)) for r in records[1:-1]]
        end = records[-1]
        del end["type"]
        return SessionTrace(TraceHeader(**header), events, TraceEnd(**end), name)
    except (KeyError, TypeError) as err:
        raise TraceError(f"{where}: malformed line ({err!r})") from None


def read_trace(path: Path) -> SessionTrace:
    return parse_trace(path.read_text().splitlines(), path.stem)


def read_traces(folder: Path) -> list[SessionTrace]:
    """Every *.jsonl trace in folder, in arrival (started_at) order."""
    paths = sorted(folder.glob("*.jsonl"))
    if not paths:
        raise TraceError(f"no *.jsonl traces in {folder}")
    return sorted((read_trace(p) for p in paths), key=lambda tr: (tr.header.started_at, tr.name))
