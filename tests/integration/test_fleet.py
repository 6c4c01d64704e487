"""Three real cloud-verifier processes, and eight concurrent edge sessions spread over them:
through the edge's own rendezvous hashing (--cloud a,b,c), through a real HAProxy and through
real nginx, both hashing on the specdec-session-key header, and through the Kubernetes HAProxy
config with TLS and API keys end to end (marker `fleet`: needs Debian's haproxy and nginx).
Every session stays on one replica (no reopen, one OpenSession each, every round verified); a
replica SIGKILLed mid-generation costs its sessions a reopen elsewhere, and every output still
equals cloud_only's tokens."""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from edge.drafting.kpolicy import FixedK
from edge.round.generate import GenerationResult, TimeoutPolicy, cloud_only_generate, speculative_generate
from edge.transport.client import ClientTls, VerifierClient
from edge.transport.replicas import Resolver, resolve_host
from tests.certs import Pki, make_pki
from tests.harness import gen_config, make_drafter, random_prompt
from tests.integration.test_outage import VerifierProcess, verifier_process
from tests.ops import metric_samples
from tests.tiny_models import save_pair

SESSIONS = 8
PROMPTS = [random_prompt(100 + i, length=4 + i) for i in range(SESSIONS)]
HAPROXY_CFG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy.cfg"
NGINX_CONF = HAPROXY_CFG.with_name("nginx.conf")
K8S_HAPROXY_CFG = HAPROXY_CFG.parent / "k8s" / "base" / "haproxy.cfg"
API_KEY = "fleet-key-0123456789"


@dataclass(frozen=True)
class Secure:
    """TLS and an API key end to end: the edge to the proxy, the proxy to the replicas."""

    pki: Pki
    keys_file: Path

    @classmethod
    def make(cls, folder: Path) -> Secure:
        (folder / "keys.txt").write_text(f"fleet {API_KEY}\n")
        return cls(make_pki(folder / "tls"), folder / "keys.txt")

    def flags(self) -> list[str]:
        return [
            "--tls-cert",
            str(self.pki.server_cert),
            "--tls-key",
            str(self.pki.server_key),
            "--api-keys-file",
            str(self.keys_file),
        ]


def _connect(address: str, secure: Secure | None, resolve: Resolver = resolve_host) -> VerifierClient:
    if secure is None:
        return VerifierClient(address, verify_timeout_s=30, resolve=resolve)
    tls = ClientTls(secure.pki.ca.read_bytes())
    return VerifierClient(address, verify_timeout_s=30, tls=tls, api_key=API_KEY, resolve=resolve)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_pair(tmp_path_factory.mktemp("models"))  # the conftest's draft_model and target_model


@contextmanager
def fleet(target: Path, *flags: str) -> Iterator[list[VerifierProcess]]:
    with ExitStack() as stack:
        yield [stack.enter_context(verifier_process(target, 0, "--drain-grace-s", "1", *flags)) for _ in range(3)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def haproxy(verifiers: list[VerifierProcess], folder: Path) -> Iterator[str]:
    """deploy/haproxy.cfg as shipped, with these replicas and a free port: its address."""
    servers = "".join(
        f"    server v{i} {v.address} proto h2 check check-proto h1 port {v.http_port}\n" for i, v in enumerate(verifiers)
    )
    text = re.sub(r"(?m)^    server .*\n", "", HAPROXY_CFG.read_text()) + servers
    port = _free_port()
    with _haproxy_running(re.sub(r"bind 127\.0\.0\.1:\d+", f"bind 127.0.0.1:{port}", text), port, folder) as address:
        yield address


@contextmanager
def k8s_haproxy(verifiers: list[VerifierProcess], folder: Path, secure: Secure) -> Iterator[str]:
    """The Kubernetes ConfigMap's haproxy.cfg (TLS in and out, /readyz over HTTPS) with these
    replicas for the SRV template, the test certificates (names 127.0.0.1 and localhost) for
    the Secret's, and a free port."""
    tls = secure.pki.ca.parent
    (tls / "proxy.pem").write_bytes(secure.pki.server_cert.read_bytes() + secure.pki.server_key.read_bytes())
    template = re.search(
        r"(?m)^    server-template verifier 16 \S+ resolvers kube init-addr none (.*) port 8080$", K8S_HAPROXY_CFG.read_text()
    )
    assert template, "no server-template line in the Kubernetes haproxy.cfg"
    options = template.group(1).replace("verifier.specdec.svc", "localhost")
    servers = "".join(f"    server v{i} {v.address} {options} port {v.http_port}\n" for i, v in enumerate(verifiers))
    text = K8S_HAPROXY_CFG.read_text().replace(template.group(0) + "\n", servers).replace("/etc/haproxy/tls/", f"{tls}/")
    text = re.sub(r"(?ms)^resolvers kube.*?\n\n", "", text)
    port = _free_port()
    text = text.replace("bind :50051", f"bind 127.0.0.1:{port}").replace("bind :8404", f"bind 127.0.0.1:{_free_port()}")
    with _haproxy_running(text, port, folder) as address:
        yield address


@contextmanager
def _haproxy_running(text: str, port: int, folder: Path) -> Iterator[str]:
    binary = shutil.which("haproxy") or "/usr/sbin/haproxy"
    config = folder / "haproxy.cfg"
    config.write_text(text)
    proc = subprocess.Popen(
        [binary, "-W", "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=(folder / "haproxy.log").open("w")
    )
    try:
        _wait_port(proc, port, folder / "haproxy.log")
        time.sleep(2.5)  # two health checks: every replica is up in HAProxy's eyes
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextmanager
def nginx(verifiers: list[VerifierProcess], folder: Path) -> Iterator[str]:
    """deploy/nginx.conf as shipped, with these replicas, a free port and its files in `folder`."""
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    port = _free_port()
    servers = "".join(f"        server {v.address} max_fails=1 fail_timeout=10s;\n" for v in verifiers)
    text = re.sub(r"(?m)^        server 127.*\n", "", NGINX_CONF.read_text())
    text = text.replace("        keepalive 32;", servers + "        keepalive 32;")
    text = re.sub(r"listen 127\.0\.0\.1:\d+", f"listen 127.0.0.1:{port}", text).replace(
        "/tmp/specdec-nginx.pid", str(folder / "nginx.pid")
    )
    config = folder / "nginx.conf"
    config.write_text(text)
    log = (folder / "nginx.log").open("w")
    proc = subprocess.Popen(
        [binary, "-c", str(config), "-p", str(folder), "-e", "stderr", "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=log
    )
    try:
        _wait_port(proc, port, folder / "nginx.log")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _wait_port(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + 20
    while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def _counts(verifier: VerifierProcess, secure: Secure | None) -> tuple[float, float]:
    """(rounds, OpenSession calls answered OK) of a replica, from its /metrics."""
    host = _bracketed(getattr(verifier, "host", "127.0.0.1"))
    scheme, context = "http", None
    request = urllib.request.Request(f"http://{host}:{verifier.http_port}/metrics")
    if secure is not None:
        scheme, context = "https", ssl.create_default_context(cafile=str(secure.pki.ca))
        request = urllib.request.Request(
            f"{scheme}://{host}:{verifier.http_port}/metrics", headers={"authorization": f"Bearer {API_KEY}"}
        )
    with urllib.request.urlopen(request, timeout=10, context=context) as reply:
        samples = metric_samples(reply.read().decode())
    opens = samples.get(("specdec_requests_total", frozenset({("method", "OpenSession"), ("code", "OK")})), 0.0)
    return samples.get(("specdec_rounds_total", frozenset()), 0.0), opens


async def _sessions(client: VerifierClient, draft_model, max_new_tokens: int) -> list[GenerationResult]:  # type: ignore[no-untyped-def]
    cfg = gen_config(max_new_tokens=max_new_tokens, timeouts=TimeoutPolicy(reconnect_window_s=60))
    return list(
        await asyncio.gather(
            *(speculative_generate(prompt, make_drafter(draft_model), client, FixedK(4), cfg) for prompt in PROMPTS)
        )
    )


async def _references(address: str, max_new_tokens: int, secure: Secure | None) -> list[list[int]]:
    client = _connect(address, secure)
    try:
        return [(await cloud_only_generate(p, client, gen_config(max_new_tokens=max_new_tokens))).token_ids for p in PROMPTS]
    finally:
        await client.close()


@asynccontextmanager
async def _client(address: str, secure: Secure | None, resolve: Resolver = resolve_host) -> AsyncIterator[VerifierClient]:
    client = _connect(address, secure, resolve)
    try:
        yield client
    finally:
        await client.close()


async def _kill_busiest(
    verifiers: list[VerifierProcess], before: list[tuple[float, float]], rounds: float, secure: Secure | None
) -> VerifierProcess:
    """Once some replica has served `rounds` rounds of this run, SIGKILL it."""
    while True:
        now = await asyncio.gather(*(asyncio.to_thread(_counts, v, secure) for v in verifiers))
        served = [n[0] - b[0] for n, b in zip(now, before, strict=True)]
        if max(served) >= rounds:
            victim = verifiers[served.index(max(served))]
            await asyncio.to_thread(victim.kill)
            return victim
        await asyncio.sleep(0.05)


def _check_fleet(
    verifiers: list[VerifierProcess],
    address: str,
    draft_model,  # type: ignore[no-untyped-def]
    secure: Secure | None = None,
    resolve: Resolver = resolve_host,
    spread: int = 2,
) -> None:
    """`spread`: how many replicas the eight sessions must reach at least."""

    async def run() -> None:
        references = await _references(verifiers[0].address, 60, secure)
        before = [_counts(v, secure) for v in verifiers]
        async with _client(address, secure, resolve) as client:
            results = await _sessions(client, draft_model, 60)
        after = [_counts(v, secure) for v in verifiers]
        assert [r.token_ids for r in results] == references
        # One OpenSession per session and no reopen: every round of a session reached its replica.
        assert [r.reopens for r in results] == [0] * SESSIONS
        opened = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
        assert sum(opened) == SESSIONS and sum(1 for n in opened if n) >= spread, opened  # spread 2 of 3: 3 * 3^-8 to fail
        # Every round the edges made was verified (a round sent to the wrong replica is not).
        assert sum(a[0] - b[0] for a, b in zip(after, before, strict=True)) == sum(r.rounds for r in results)

        # A replica killed mid-generation: its sessions reopen elsewhere, on their committed prefix.
        references = await _references(verifiers[0].address, 150, secure)
        before = [_counts(v, secure) for v in verifiers]
        async with _client(address, secure, resolve) as client:
            killer = asyncio.create_task(_kill_busiest(verifiers, before, 40, secure))
            results = await _sessions(client, draft_model, 150)
            victim = await killer
        assert victim.proc.poll() is not None
        assert [r.token_ids for r in results] == references  # lossless: nothing lost or repeated
        assert sum(r.reopens for r in results) >= 1

    asyncio.run(run())


def test_rendezvous_over_three_verifiers(models: tuple[Path, Path], draft_model) -> None:  # type: ignore[no-untyped-def]
    """--cloud a,b,c without a proxy: the edge's rendezvous hashing keeps each session on one
    replica, and moves it to the next in its order once that one is dead."""
    with fleet(models[1]) as verifiers:
        _check_fleet(verifiers, ",".join(v.address for v in verifiers), draft_model)


@pytest.mark.fleet
def test_haproxy_over_three_verifiers(models: tuple[Path, Path], draft_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """deploy/haproxy.cfg in front of three replicas: one address for the edge, affinity by the
    session-key header, a dead replica's sessions redispatched and reopened."""
    with fleet(models[1]) as verifiers, haproxy(verifiers, tmp_path) as address:
        _check_fleet(verifiers, address, draft_model)


@pytest.mark.fleet
def test_nginx_over_three_verifiers(models: tuple[Path, Path], draft_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """deploy/nginx.conf in front of three replicas: `hash $http_specdec_session_key consistent`;
    a call to the dead replica is passed to the next (grpc_next_upstream error)."""
    with fleet(models[1]) as verifiers, nginx(verifiers, tmp_path) as address:
        _check_fleet(verifiers, address, draft_model)


@pytest.mark.fleet
def test_kubernetes_haproxy_with_tls_and_api_keys(models: tuple[Path, Path], draft_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The Kubernetes HAProxy config for real: TLS from the edge, TLS to replicas that ask an
    API key (passed through), readiness over HTTPS; the same affinity and failover."""
    secure = Secure.make(tmp_path)
    with fleet(models[1], *secure.flags()) as verifiers, k8s_haproxy(verifiers, tmp_path, secure) as address:
        _check_fleet(verifiers, address, draft_model, secure)
