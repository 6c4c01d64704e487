"""Error types shared by both sides. Each names the gRPC status code it maps to,
so the server has one place that translates them (cloud/interceptors.py) and the
edge client raises the same types back from a status code (edge/transport/client.py)."""

from __future__ import annotations

from shared.protocol import WireBytes


class SpecDecError(Exception):
    """Base error; `status` is the name of a grpc.StatusCode member. `wire`: the bytes the
    failed call put on the wire, resends included, as the edge's client counts them."""

    status = "INTERNAL"
    wire = WireBytes()


class InvalidRequest(SpecDecError):
    status = "INVALID_ARGUMENT"


class InvalidParameter(InvalidRequest):
    """A bad field of a request to `edge-agent serve`; `param` names it as OpenAI does
    (stop[0], speculative.k), None when the problem is the request as a whole."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class SessionNotFound(SpecDecError):
    status = "NOT_FOUND"


class PositionMismatch(SpecDecError):
    """The edge's base_position differs from the server's committed length."""

    status = "FAILED_PRECONDITION"

    def __init__(self, message: str, server_position: int) -> None:
        super().__init__(message)
        self.server_position = server_position


class SessionRefused(SpecDecError):
    """The verifier's engine cannot verify a session the way it asks (an accept mode or a
    vocabulary it has no exact rule for); the message names the engine and what it refused."""

    status = "FAILED_PRECONDITION"


class CapacityExceeded(SpecDecError):
    """The verifier is full (queue, sessions or KV memory); retry_after_ms is its hint for
    when a retry may succeed (0: no hint, e.g. a prompt that can never fit)."""

    status = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class VerifierFault(SpecDecError):
    """The verifier failed on this request's step (a bug, logged with its request id); the
    step was undone and no other request was touched."""

    status = "INTERNAL"


class EngineFailed(SpecDecError):
    """The target's engine can run no more passes (its own processes died): the verifier
    process stops, with a non-zero exit status, so that its supervisor starts it again."""

    status = "UNAVAILABLE"


class ServerDraining(SpecDecError):
    status = "UNAVAILABLE"


class CloudUnavailable(SpecDecError):
    """The edge could not reach the verifier (connection refused or lost)."""

    status = "UNAVAILABLE"


class DeadlineExceeded(CloudUnavailable):
    """A call ran past its deadline: the verifier did not answer in time (too busy, or cut
    off). Recoverable as an outage is, but named for what happened."""

    status = "DEADLINE_EXCEEDED"


class DraftFailed(SpecDecError):
    """The edge's draft model could not evaluate a block (its runtime said why)."""


class Unauthenticated(SpecDecError):
    """The call carried no API key, or one the verifier does not know. The message never
    holds the key that was presented."""

    status = "UNAUTHENTICATED"


class TlsHandshakeFailed(SpecDecError):
    """The edge and the verifier could not agree on TLS (an untrusted certificate, a name it
    does not carry). Not retried as an outage is: the same certificates fail the same way."""

    status = "UNAVAILABLE"


class ConfigError(SpecDecError):
    """A bad command-line option or model folder: reported as one line by the CLIs."""

    status = "INVALID_ARGUMENT"


ERRORS_BY_STATUS: dict[str, type[SpecDecError]] = {
    cls.status: cls for cls in (InvalidRequest, SessionNotFound, CapacityExceeded, ServerDraining, Unauthenticated)
}
