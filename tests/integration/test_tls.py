"""TLS and mTLS between a real VerifierClient and a real grpc.aio verifier (tiny models,
certificates made at run time), HTTPS on the HTTP port, and openssl's view of the handshake."""

import asyncio
import logging
import re
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cloud.grpc_server import create_server
from cloud.state import ServerState
from cloud.tls import ServerTls, check_exposure
from cloud.verifier import Verifier
from edge.drafting.kpolicy import FixedK
from edge.round.generate import cloud_only_generate, speculative_generate
from edge.transport.client import ClientTls, VerifierClient
from shared.errors import CloudUnavailable, ConfigError, SpecDecError, TlsHandshakeFailed
from shared.protocol import OpenSessionRequest, SessionConfig
from tests.certs import Pki, make_pki
from tests.harness import TargetEngine, gen_config, make_drafter, random_prompt
from tests.ops import SETTINGS, running_servers

OPENSSL = "/usr/bin/openssl"
PROMPT = random_prompt(3)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """Certificates of another CA, which the verifier's clients must not trust (nor it them)."""
    return make_pki(tmp_path_factory.mktemp("other-pki"), "another CA")


def _server_tls(pki: Pki, mtls: bool) -> ServerTls:
    return ServerTls.checked(str(pki.server_cert), str(pki.server_key), str(pki.ca) if mtls else None)


def _client_tls(trusted: Pki, identity: Pki | None = None) -> ClientTls:
    cert, key = (str(identity.client_cert), str(identity.client_key)) if identity else (None, None)
    return ClientTls.from_files(str(trusted.ca), cert, key)


@asynccontextmanager
async def tls_verifier(target: TargetEngine, tls: ServerTls) -> AsyncIterator[str]:
    state = ServerState.for_verifier(Verifier(target(), "tiny-target"))
    server, port = create_server(state, "127.0.0.1:0", credentials=tls.grpc_credentials())
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


REFUSED_BY_SERVER = (CloudUnavailable, TlsHandshakeFailed)


async def _refused(
    address: str, tls: ClientTls | None, error: type[SpecDecError] | tuple[type[SpecDecError], ...] = REFUSED_BY_SERVER
) -> str:
    """The server hangs up on a client it refuses (under TLS 1.3 the client sees "Socket
    closed", as in an outage); a client that refuses the server's certificate knows it was
    TLS, and does not retry."""
    client = VerifierClient(address, verify_timeout_s=5, open_timeout_s=5, tls=tls)
    try:
        with pytest.raises(error) as err:
            await client.open_session(OpenSessionRequest(PROMPT, SessionConfig()))
        return str(err.value)
    finally:
        await client.close()


# ---- edge and verifier over TLS and mTLS -------------------------------------------------


@pytest.mark.parametrize("mtls", [False, True], ids=["tls", "mtls"])
def test_greedy_generation_over_tls_equals_the_target(target_engine: TargetEngine, draft_model, pki: Pki, mtls: bool) -> None:
    reference = target_engine.greedy_continuation(PROMPT, 24)

    async def run() -> None:
        async with tls_verifier(target_engine, _server_tls(pki, mtls)) as address:
            client = VerifierClient(address, verify_timeout_s=10, tls=_client_tls(pki, pki if mtls else None))
            try:
                spec = await speculative_generate(
                    PROMPT, make_drafter(draft_model), client, FixedK(4), gen_config(max_new_tokens=24)
                )
                cloud = await cloud_only_generate(PROMPT, client, gen_config(max_new_tokens=24))
            finally:
                await client.close()
        assert spec.token_ids == cloud.token_ids == reference
        assert spec.rounds > 0 and spec.bytes_up > 0 and cloud.bytes_up > 0

    asyncio.run(run())


def test_plaintext_client_and_untrusted_ca_are_refused(target_engine: TargetEngine, pki: Pki, other_pki: Pki) -> None:
    async def run() -> None:
        async with tls_verifier(target_engine, _server_tls(pki, mtls=False)) as address:
            await _refused(address, None, CloudUnavailable)  # plaintext to a TLS port
            untrusted = await _refused(address, _client_tls(other_pki), TlsHandshakeFailed)  # not from this CA
            assert "CERTIFICATE_VERIFY_FAILED" in untrusted and "--tls-ca" in untrusted

    asyncio.run(run())


def test_mtls_refuses_a_client_without_an_accepted_certificate(target_engine: TargetEngine, pki: Pki, other_pki: Pki) -> None:
    async def run() -> None:
        async with tls_verifier(target_engine, _server_tls(pki, mtls=True)) as address:
            await _refused(address, _client_tls(pki))  # no client certificate
            await _refused(address, _client_tls(pki, other_pki))  # one signed by another CA
            client = VerifierClient(address, tls=_client_tls(pki, pki))
            try:
                assert (await client.open_session(OpenSessionRequest(PROMPT, SessionConfig()))).session_id
            finally:
                await client.close()

    asyncio.run(run())


def test_openssl_completes_the_handshake(target_engine: TargetEngine, pki: Pki) -> None:
    def s_client(port: int) -> str:
        cmd = [
            OPENSSL,
            "s_client",
            "-connect",
            f"127.0.0.1:{port}",
            "-CAfile",
            str(pki.ca),
            "-verify_ip",
            "127.0.0.1",
            "-alpn",
            "h2",
        ]
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
        return (done.stdout + done.stderr).decode(errors="replace")  # it also prints the server's HTTP/2 frames

    async def run() -> str:
        async with tls_verifier(target_engine, _server_tls(pki, mtls=False)) as address:
            return await asyncio.to_thread(s_client, int(address.rsplit(":", 1)[1]))  # the server runs on this loop

    output = asyncio.run(run())
    assert "Verify return code: 0 (ok)" in output, output
    assert "CN=verifier" in output.replace(" = ", "=")


def test_bad_tls_files_are_one_line_config_errors(pki: Pki, other_pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--tls-cert"):
        ServerTls.checked(str(tmp_path / "missing.pem"), str(pki.server_key), None)
    with pytest.raises(ConfigError, match="not a usable PEM"):
        ServerTls.checked(str(pki.server_cert), str(other_pki.server_key), None)  # the key of another certificate
    with pytest.raises(ConfigError, match="--tls-ca"):
        ClientTls.from_files(str(tmp_path / "missing-ca.pem"))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_tls(host: str) -> None:
    check_exposure(host, None, insecure=False)


def test_other_hosts_need_tls_or_insecure(pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    for host in ("0.0.0.0", "::", "10.1.2.3", "verifier.example.com"):
        with pytest.raises(ConfigError, match=f"--host {re.escape(host)} serves other machines"):
            check_exposure(host, None, insecure=False)
        check_exposure(host, _server_tls(pki, mtls=False), insecure=False)
    caplog.set_level(logging.WARNING, logger="cloud-verifier")
    check_exposure("0.0.0.0", None, insecure=True)
    assert "no TLS on 0.0.0.0 (--insecure)" in caplog.text


# ---- the whole service: HTTPS beside gRPC over TLS --------------------------------------


def _get(url: str, context: ssl.SSLContext | None) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10, context=context) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as err:
        return err.code


async def _health(port: int, tls: ClientTls) -> int:
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", tls.credentials()) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return int(reply.status)


def test_service_serves_https_probes_and_grpc_under_mtls(target_engine: TargetEngine, pki: Pki) -> None:
    """Under mTLS the HTTP port asks no client certificate, so probes reach /livez and /readyz;
    gRPC (the health service included) requires one."""
    settings = SETTINGS.model_copy(
        update={"tls_cert": str(pki.server_cert), "tls_key": str(pki.server_key), "tls_client_ca": str(pki.ca)}
    )
    trusting = ssl.create_default_context(cafile=str(pki.ca))

    async def run() -> None:
        async with running_servers(target_engine, settings=settings) as (servers, loading):
            await loading
            http = servers.http.port
            assert await asyncio.to_thread(_get, f"https://127.0.0.1:{http}/livez", trusting) == 200
            assert await asyncio.to_thread(_get, f"https://localhost:{http}/readyz", trusting) == 200
            with pytest.raises(OSError):  # plain HTTP to the HTTPS port: the server hangs up
                await asyncio.to_thread(_get, f"http://127.0.0.1:{http}/livez", None)
            with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # not trusting the CA
                await asyncio.to_thread(_get, f"https://127.0.0.1:{http}/livez", ssl.create_default_context())
            serving = health_pb2.HealthCheckResponse.SERVING
            assert await _health(servers.grpc_port, _client_tls(pki, pki)) == serving
            with pytest.raises(grpc.aio.AioRpcError):
                await _health(servers.grpc_port, _client_tls(pki))

    asyncio.run(run())
