"""Recording a session trace (edge-agent --record DIR): a client tap that keeps one
session's calls, in the format edge/trace.py writes and reads."""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, replace

from edge.trace import Event, GenerateEvent, OpenEvent, SessionTrace, TraceEnd, TraceHeader, VerifyEvent
from edge.transport.client import TappedCall
from shared.errors import SpecDecError
from shared.protocol import GenerateRequest, OpenSessionRequest, OpenSessionResult, VerifyRequest, VerifyResult


def _code(error: SpecDecError | None) -> str | None:
    return None if error is None else error.status


class SessionRecorder:
    """A client tap (edge/transport/client.py CallTap) that keeps one session's calls; `finish` writes
    the trace. The round loop is unaware of it."""

    def __init__(self, header: TraceHeader) -> None:
        self.header = header
        self.start = time.perf_counter()
        self.events: list[Event] = []
        self.target_model = ""

    def _t(self, clock: float) -> float:
        return round(clock - self.start, 6)

    def opened(self, call: TappedCall[OpenSessionRequest, OpenSessionResult]) -> None:
        req, result = call.request, call.result
        prefix = req.prompt_tokens[len(self.header.prompt_tokens) :]
        if result is not None:  # a folder's name, not the verifier's local path
            self.target_model = self.target_model or result.model_id.rstrip("/").rsplit("/", 1)[-1]
        position, prefill_ms = (result.position, result.prefill_ms) if result else (0, 0.0)
        sent, replied = self._t(call.sent), self._t(call.replied)
        self.events.append(OpenEvent(sent, replied, req.config.seed, prefix, position, prefill_ms, _code(call.error)))

    def verified(self, call: TappedCall[VerifyRequest, VerifyResult]) -> None:
        req, result = call.request, call.result
        bare = replace(req, session_id="", request_id="")  # the trace never holds a session id
        sent, replied = self._t(call.sent), self._t(call.replied)
        if result is None:
            self.events.append(VerifyEvent(sent, replied, bare, resends=call.resends, error=_code(call.error)))
            return
        self.events.append(
            VerifyEvent(
                sent,
                replied,
                bare,
                result.accepted_len,
                result.next_token,
                result.bonus,
                result.new_base_position,
                result.metrics.verify_ms,
                result.metrics.queue_ms,
                call.resends,
            )
        )

    def generated(self, call: TappedCall[GenerateRequest, list[int]]) -> None:
        req = call.request
        self.target_model = self.target_model or self.header.target_model
        first = None if call.first is None else self._t(call.first)
        event = GenerateEvent(
            self._t(call.sent),
            first,
            self._t(call.replied),
            req.max_new_tokens,
            list(req.stop_token_ids),
            call.result or [],
            _code(call.error),
        )
        self.events.append(event)

    def finish(self, output_tokens: list[int], finish_reason: str, rounds: int = 0, reopens: int = 0) -> SessionTrace:
        header = self.header
        if self.target_model and not header.target_model:
            header = TraceHeader(**{**asdict(header), "sampling": header.sampling, "target_model": self.target_model})
        end = TraceEnd(self._t(time.perf_counter()), output_tokens, finish_reason, rounds, reopens)
        return SessionTrace(header, self.events, end)


def trace_file_name(label: str, started_at: float) -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(started_at))
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in label)[:40]
    return f"{stamp}-{safe}-{uuid.uuid4().hex[:6]}.jsonl"
