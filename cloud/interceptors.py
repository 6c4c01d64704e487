"""The verifier's gRPC interceptors, around every call of the Verifier service (each round of a
VerifyRounds call is one Verify call to them):

- StatusInterceptor (outermost) answers each call: project errors (shared/errors.py) become
  their documented status codes and trailers, an unexpected exception INTERNAL with the
  request id only, never UNKNOWN; and it counts every call by method and code and logs it once.
- ApiKeyInterceptor (inside it) lets a call run only with a key of the keys in force
  (shared/api_keys.py; reloaded while the server runs, cloud/key_reload.py) and makes the key's
  name the call's principal(), which the servicer and the log line read.

The health and reflection services pass through both untouched: probes call them without a key.
"""

from __future__ import annotations

import logging
import time
import uuid
from abc import abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import Message

from cloud.logs import REFUSALS, log_event
from cloud.sessions import session_tag
from cloud.state import ServerState
from shared import wire
from shared.errors import CapacityExceeded, PositionMismatch, SpecDecError, Unauthenticated

__all__ = ["MAX_REQUEST_ID", "ApiKeyInterceptor", "ServiceInterceptor", "StatusInterceptor", "Undecodable", "principal"]

MAX_REQUEST_ID = 64  # the edge's ids are 16 characters; a longer one is cut before it is logged or echoed
log = logging.getLogger("cloud-verifier")

UnaryBehavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
StreamBehavior = Callable[[Any, grpc.aio.ServicerContext], AsyncGenerator[Any, None]]
Replied = Callable[[Any], None]  # told of each reply of a call

# Set by ApiKeyInterceptor for the call it lets in. grpc.aio runs each call in a task of its
# own, and a task starts from a copy of the context: one call's principal never reaches another.
_PRINCIPAL: ContextVar[str] = ContextVar("specdec_principal", default="")


def principal() -> str:
    """The API key name of the call running in this task: "" when no keys are configured,
    or before the call is authenticated."""
    return _PRINCIPAL.get()


@dataclass(frozen=True)
class Undecodable:
    """What a request that does not parse as its message type (truncated, invalid UTF-8 in a
    string field) becomes, so the call can answer INVALID_ARGUMENT rather than UNKNOWN."""

    size: int


class ServiceInterceptor:
    """Runs each method of the Verifier service inside `around`: wrapped round its behavior where
    the service is registered (cloud/grpc_server.py), so the health and reflection services, and
    the calls of other services, never pass through it."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def wrap(self, method: str, behavior: Any, *, streaming: bool) -> Any:
        """`behavior` (a unary-request method's: one reply, or a stream of them) inside `around`."""
        return self.stream(method, behavior) if streaming else self.unary(method, behavior)

    @abstractmethod
    def around(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> AbstractAsyncContextManager[Replied]:
        """What runs around one call: it gives what is told of each reply."""

    def unary(self, method: str, behavior: UnaryBehavior) -> UnaryBehavior:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with self.around(method, request, context) as replied:
                reply = await behavior(request, context)
                replied(reply)
            return reply

        return wrapped

    def stream(self, method: str, behavior: StreamBehavior) -> StreamBehavior:
        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncGenerator[Any, None]:
            # The replies are closed before the call leaves `around`: a stream's finally blocks
            # (freeing its KV) run however it ended, before the call is answered.
            async with self.around(method, request, context) as replied, aclosing(behavior(request, context)) as replies:
                async for reply in replies:
                    replied(reply)
                    yield reply

        return wrapped


class ApiKeyInterceptor(ServiceInterceptor):
    """A call runs only with `authorization: Bearer KEY` of a key in force (state.api_keys, read
    at each call: a reload replaces it); otherwise it raises Unauthenticated (the
    StatusInterceptor around it answers UNAUTHENTICATED and counts it).

    Once a key's name leaves the keys file, its streams end UNAUTHENTICATED at their next reply
    (or when their session, ended with the key, fails them); a unary call in flight finishes,
    or fails NOT_FOUND with its session gone."""

    @asynccontextmanager
    async def around(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Replied]:
        name = self.state.api_keys.principal(_authorization(context))
        _PRINCIPAL.set(name)
        try:
            yield lambda reply: None
        finally:
            if not self._current(name):  # a session this call opened after the reload ended the key's goes too
                self.state.end_owner_soon(name)

    def stream(self, method: str, behavior: StreamBehavior) -> StreamBehavior:
        def while_current(request: Any, context: grpc.aio.ServicerContext) -> AsyncGenerator[Any, None]:
            return self._while_current(principal(), behavior(request, context))  # called once `around` set it

        return super().stream(method, while_current)

    async def _while_current(self, name: str, replies: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
        """The stream's replies while `name` is a key in force."""
        async with aclosing(replies):
            while True:
                try:
                    reply = await anext(replies)
                except StopAsyncIteration:
                    return
                except SpecDecError:  # its session ended with its key (NOT_FOUND): say why
                    self._refuse_if_removed(name)
                    raise
                self._refuse_if_removed(name)
                yield reply

    def _current(self, name: str) -> bool:
        keys = self.state.api_keys
        return not keys.enabled or any(entry.name == name for entry in keys.entries)

    def _refuse_if_removed(self, name: str) -> None:
        if not self._current(name):
            raise Unauthenticated("the API key was removed")


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    return next((str(value) for key, value in context.invocation_metadata() or () if key == "authorization"), None)


class StatusInterceptor(ServiceInterceptor):
    """Every call's answer and bookkeeping: its status code (and trailers), one sample of the
    request metrics by method and code, and one log line."""

    @asynccontextmanager
    async def around(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Replied]:
        if isinstance(request, Undecodable):
            self.state.metrics.record_rpc(method, "INVALID_ARGUMENT", request.size, 0)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {method} message")
        call = _Call(self.state, method, request, _peer_address(context))
        async with _answering(context, call):
            yield call.replied


@dataclass
class _Call:
    """One RPC's bookkeeping: counted by status code and logged once, on the way out."""

    state: ServerState
    method: str
    request: Message
    peer: str  # the caller's address, without its port
    request_id: str = field(init=False)
    started: float = field(default_factory=time.perf_counter)
    sent: int = 0
    session: str = ""  # the reply's session id, for calls whose request has none (OpenSession)

    def __post_init__(self) -> None:
        # VerifyRequest carries the edge's request id; other calls (and an empty one) get a fresh id.
        self.request_id = getattr(self.request, "request_id", "")[:MAX_REQUEST_ID] or uuid.uuid4().hex[:16]

    def replied(self, reply: Message) -> None:
        self.sent += reply.ByteSize()
        self.session = self.session or getattr(reply, "session_id", "")

    def finish(self, code: str, detail: str = "") -> None:
        self.state.metrics.record_rpc(self.method, code, self.request.ByteSize(), self.sent)
        quiet = logging.DEBUG if self.method == "Verify" else logging.INFO  # an answered call's line
        if code == "OK" and not log.isEnabledFor(quiet):
            return  # a round is one of many: its line is not even built unless asked for
        fields: dict[str, Any] = {
            "method": self.method,
            "code": code,
            "request_id": self.request_id,
            "ms": round((time.perf_counter() - self.started) * 1000.0, 2),
        }
        if session := getattr(self.request, "session_id", "") or self.session:
            fields["session"] = session_tag(session)
        if caller := principal():
            fields["principal"] = caller
        if prompt := getattr(self.request, "prompt_tokens", None):
            fields["prompt_tokens"] = list(prompt) if self.state.log_prompts else len(prompt)
        if code in REFUSALS:
            self._refused(code, detail, fields)
        elif code != "OK":
            log_event(log, logging.WARNING, f"{self.method} failed: {detail}", **fields)
        else:
            log_event(log, quiet, self.method, **fields)

    def _refused(self, code: str, detail: str, fields: dict[str, Any]) -> None:
        """Counted every time; logged as the RefusalLog lets it, with how many refusals it stands for."""
        caller = principal()
        self.state.metrics.refused_calls.labels(code, caller).inc()
        refusals = self.state.refusals.admit(f"key {caller}" if caller else self.peer, code)
        if refusals:
            log_event(log, logging.WARNING, f"{self.method} refused: {detail}", peer=self.peer, refusals=refusals, **fields)


def _peer_address(context: grpc.aio.ServicerContext) -> str:
    """The caller's address without its port (a client's port changes with each connection)."""
    return str(context.peer() or "").rpartition(":")[0] or "unknown"


def _trailers(err: SpecDecError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a refusal carries: the server's position for a base_position
    mismatch; a retry hint under the project's name and under gRPC's own retry pushback."""
    if isinstance(err, PositionMismatch):
        return ((wire.SERVER_POSITION_KEY, str(err.server_position)),)
    if isinstance(err, CapacityExceeded) and err.retry_after_ms > 0:
        hint = str(err.retry_after_ms)
        return ((wire.RETRY_AFTER_MS_KEY, hint), (wire.RETRY_PUSHBACK_MS_KEY, hint))
    return ()


async def _abort(context: grpc.aio.ServicerContext, err: SpecDecError, request_id: str) -> None:
    if trailers := _trailers(err):
        context.set_trailing_metadata(trailers)
    detail = f"{err} (request_id {request_id})" if err.status == "INTERNAL" else str(err)
    await context.abort(grpc.StatusCode[err.status], detail)


@asynccontextmanager
async def _answering(context: grpc.aio.ServicerContext, call: _Call) -> AsyncIterator[None]:
    """The one place that maps project errors to gRPC status codes, and counts every call's code."""
    try:
        yield
    except SpecDecError as err:
        call.finish(err.status, str(err))
        await _abort(context, err, call.request_id)
    except Exception:  # a bug: logged in full here, the caller gets a status and the request id only
        log.exception("%s failed unexpectedly (request_id=%s)", call.method, call.request_id)
        call.finish("INTERNAL", "unexpected error")
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request_id {call.request_id})")
    except BaseException:  # cancelled: the client went away, its deadline passed, or the server stops
        call.finish("CANCELLED", "cancelled")
        raise
    else:
        call.finish("OK")
