"""Each session's Verify rounds on one VerifyRounds call to its verifier.

A round writes its request on the call its session's first round opened and reads the one reply
to it: no new call each round. In gRPC's Python stack a call's setup and end cost more than its
messages (on a 2-core Xeon, a unary echo took 1.0 ms and a message on an open call 0.3 ms,
1.5–1.7 and 0.8 ms after a 5–25 ms pause, which is how rounds arrive: docs/vllm_overhead.md,
"A round's call"). The verifier answers each request as Verify does, so a round refused there
ends the call with Verify's status and is raised as a Verify's would be; the session's next
round opens another call. A verifier without VerifyRounds answers UNIMPLEMENTED once: its
rounds go as unary Verify calls from then on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc

from shared.errors import CloudUnavailable, DeadlineExceeded
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

RoundSender = Callable[..., Awaitable[pb.VerifyResponse]]  # (request, timeout=, metadata=), as stub.Verify


@dataclass
class _RoundCall:
    stub: pb_grpc.VerifierStub  # the replica it runs on
    call: Any  # grpc.aio.StreamStreamCall
    busy: bool = False  # a round is on it now


class RoundStreams:
    """The open VerifyRounds call of each session (by session id)."""

    def __init__(self) -> None:
        self._calls: dict[str, _RoundCall] = {}
        self._unary: set[int] = set()  # the stubs (by id) whose verifier has no VerifyRounds

    def sender(self, stub: pb_grpc.VerifierStub) -> RoundSender:
        """What sends a round to `stub`'s verifier."""
        return stub.Verify if id(stub) in self._unary else partial(self._round, stub)

    def close(self, session_id: str) -> None:
        """The session's call ended (its session closes): the verifier's side ends with it."""
        if open_call := self._calls.pop(session_id, None):
            open_call.call.cancel()

    def close_all(self) -> None:
        for session_id in list(self._calls):
            self.close(session_id)

    async def _round(
        self, stub: pb_grpc.VerifierStub, request: pb.VerifyRequest, *, timeout: float, metadata: Any
    ) -> pb.VerifyResponse:
        session_id = request.session_id
        held = self._calls.get(session_id)
        if held is not None and held.busy:  # a second round at once: a call of its own
            return await stub.Verify(request, timeout=timeout, metadata=metadata)
        if held is None or held.stub is not stub or held.call.done():
            self.close(session_id)
            held = self._calls[session_id] = _RoundCall(stub, stub.VerifyRounds(metadata=metadata))
        held.busy = True
        try:
            async with asyncio.timeout(timeout):  # not wait_for: no task of its own each round
                await held.call.write(request)
                reply = await held.call.read()
        except grpc.aio.AioRpcError as err:
            self._drop(session_id, held)
            if _broken(err):
                raise CloudUnavailable(f"the round's call broke on its way to the verifier: {err.details()}") from None
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self._unary.add(id(stub))  # the request was not taken: it goes again, as a Verify
            return await stub.Verify(request, timeout=timeout, metadata=metadata)
        except TimeoutError:
            self._drop(session_id, held)
            raise DeadlineExceeded("the verifier did not answer within the call's deadline (DEADLINE_EXCEEDED)") from None
        except BaseException:  # cancelled: its reply would answer the next round
            self._drop(session_id, held)
            raise
        held.busy = False
        if reply is grpc.aio.EOF:
            self._drop(session_id, held)
            raise CloudUnavailable("the verifier ended the session's round stream without answering its round")
        return reply  # type: ignore[no-any-return]

    def _drop(self, session_id: str, held: _RoundCall) -> None:
        held.call.cancel()
        if self._calls.get(session_id) is held:
            del self._calls[session_id]


def _broken(err: grpc.aio.AioRpcError) -> bool:
    """Whether the path to the verifier reset the call rather than the verifier answering it: a
    proxy whose replica went away resets the replica's open calls (INTERNAL, "Stream removed"),
    where a unary call would have been answered UNAVAILABLE. The verifier's own INTERNAL always
    names the request id."""
    return err.code() == grpc.StatusCode.INTERNAL and "request_id" not in (err.details() or "")
