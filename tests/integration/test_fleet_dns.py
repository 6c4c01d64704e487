"""--cloud NAME:PORT where the name resolves to several addresses: three real verifier processes
on 127.0.0.1, 127.0.0.2 and 127.0.0.3 (one port) behind a name the test's resolver answers, and
two on 127.0.0.1 and ::1 behind `localhost` where this machine's resolver gives both; eight
concurrent sessions, one replica SIGKILLed mid-generation, every output equal to cloud_only's
(tests/integration/test_fleet.py's checks). Marker `fleet`."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from edge.transport.replicas import resolve_host
from tests.integration.test_fleet import _bracketed, _check_fleet, _free_port
from tests.integration.test_outage import VerifierProcess
from tests.tiny_models import save_pair


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_pair(tmp_path_factory.mktemp("models"))  # the conftest's draft_model and target_model


class HostedVerifier(VerifierProcess):
    """A verifier on another loopback address than 127.0.0.1 (127.0.0.2, ::1), gRPC on `port`."""

    def __init__(self, model: Path, host: str, port: int) -> None:
        self.host = host
        super().__init__(model, port, "--host", host, "--drain-grace-s", "1")

    @property
    def address(self) -> str:
        return f"{_bracketed(self.host)}:{self.grpc_port}"


def _port_free_on(hosts: list[str]) -> int:
    """A port nothing listens on at any of `hosts`: the one port a DNS name's replicas share."""
    for _ in range(50):
        port = _free_port()
        try:
            for host in hosts:
                with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
                    sock.bind((host, port))
            return port
        except OSError:
            continue
    raise AssertionError(f"no port free on all of {hosts}")


@contextmanager
def hosted_fleet(target: Path, hosts: list[str]) -> Iterator[list[VerifierProcess]]:
    """One verifier per loopback address, all on the same gRPC port, as behind one DNS name."""
    port = _port_free_on(hosts)
    with ExitStack() as stack:
        yield [stack.enter_context(_stopping(HostedVerifier(target, host, port))) for host in hosts]


@contextmanager
def _stopping(verifier: VerifierProcess) -> Iterator[VerifierProcess]:
    try:
        yield verifier
    finally:
        verifier.stop()


@pytest.mark.fleet
def test_a_dns_name_of_three_verifiers(models: tuple[Path, Path], draft_model) -> None:  # type: ignore[no-untyped-def]
    """--cloud verifiers.test:PORT where the name resolves to 127.0.0.1, .2 and .3 (the answer
    of a headless Service): three replicas, the same affinity and failover as --cloud a,b,c."""
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    with hosted_fleet(models[1], hosts) as verifiers:
        port = verifiers[0].grpc_port

        def dns(name: str, asked_port: int) -> list[str]:
            assert (name, asked_port) == ("verifiers.test", port)
            return hosts

        _check_fleet(verifiers, f"verifiers.test:{port}", draft_model, resolve=dns)


@pytest.mark.fleet
def test_localhost_resolving_to_ipv4_and_ipv6(models: tuple[Path, Path], draft_model) -> None:  # type: ignore[no-untyped-def]
    """--cloud localhost:PORT with this machine's own resolver, where localhost is 127.0.0.1
    and ::1: a verifier on each is two replicas."""
    hosts = resolve_host("localhost", 0)
    if sorted(hosts) != ["127.0.0.1", "::1"]:
        pytest.skip(f"localhost resolves to {hosts} here, not to both 127.0.0.1 and ::1 (see /etc/hosts)")
    with hosted_fleet(models[1], hosts) as verifiers:
        _check_fleet(verifiers, f"localhost:{verifiers[0].grpc_port}", draft_model, spread=1)
