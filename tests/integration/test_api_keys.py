"""API keys on a real verifier (uvicorn + grpc.aio, tiny models): every Verifier RPC and the
HTTP routes beyond the probes need a key; the key never shows in an error or a log line; the
console programs refuse an exposed plaintext verifier and a wrong key with one line."""

import asyncio
import hashlib
import json
import logging
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cloud.config import VerifierSettings
from edge.drafting.kpolicy import FixedK
from edge.round.generate import speculative_generate
from edge.transport.client import VerifierClient
from shared.errors import Unauthenticated
from shared.pb import verifier_pb2 as pb
from tests.certs import Pki, make_pki
from tests.harness import TargetEngine, gen_config, make_drafter, random_prompt
from tests.integration.test_cli import ENV
from tests.ops import SETTINGS, metric_samples, running_servers, stub
from tests.serve_procs import edge_command
from tests.tiny_models import save_pair

PLAIN_KEY = "plain-key-Xq7Lr2Vw9"
HASHED_KEY = "hashed-key-Mb4Tn8Kz1"
WRONG_KEY = "wrong-key-Pd5Hs3Jc6"
PROMPT = random_prompt(5)


def _keys_file(folder: Path) -> Path:
    path = folder / "keys.txt"
    path.write_text(f"# who may verify\nalice {PLAIN_KEY}\n\nsha256:{hashlib.sha256(HASHED_KEY.encode()).hexdigest()}\n")
    return path


def _metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) if key else ()


def _settings(tmp_path: Path, **changes: Any) -> VerifierSettings:
    return SETTINGS.model_copy(update={"api_keys_file": str(_keys_file(tmp_path)), **changes})


def _get(port: int, path: str, key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=dict(_metadata(key)))
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


async def _each_rpc(verifier: Any, session_id: str, key: str | None) -> list[grpc.aio.AioRpcError]:
    """OpenSession, Verify, CloseSession, Describe and Generate with `key`; the errors they raised."""
    metadata = _metadata(key)
    calls = [
        verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT), metadata=metadata),
        verifier.Verify(pb.VerifyRequest(session_id=session_id, base_position=len(PROMPT), draft_tokens=[4]), metadata=metadata),
        verifier.CloseSession(pb.CloseSessionRequest(session_id=session_id), metadata=metadata),
        verifier.Describe(pb.DescribeRequest(tokens_count=4), metadata=metadata),
    ]
    errors = []
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        errors.append(err.value)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in verifier.Generate(pb.GenerateRequest(prompt_tokens=PROMPT, max_new_tokens=4), metadata=metadata):
            pass
    return [*errors, err.value]


def test_every_rpc_needs_a_known_key_and_never_echoes_it(
    target_engine: TargetEngine, draft_model, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="cloud-verifier")

    async def run() -> str:
        async with running_servers(target_engine, settings=_settings(tmp_path)) as (servers, loading):
            await loading
            channel, verifier = stub(servers.grpc_port)
            opened = await verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT), metadata=_metadata(PLAIN_KEY))
            for key in (None, WRONG_KEY):
                errors = await _each_rpc(verifier, opened.session_id, key)
                assert [e.code() for e in errors] == [grpc.StatusCode.UNAUTHENTICATED] * 5
                assert all(e.details() and WRONG_KEY not in e.details() for e in errors)
            # The session the refused calls named is untouched: a round with the key goes on from the prompt.
            reply = await verifier.Verify(
                pb.VerifyRequest(session_id=opened.session_id, base_position=len(PROMPT), draft_tokens=[4]),
                metadata=_metadata(PLAIN_KEY),
            )
            assert reply.next_token >= 0
            # The health service stays open for probes.
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            await channel.close()

            # The edge's client with the hashed entry's key generates the target's text; with a wrong
            # key it stops at once with Unauthenticated (no reconnecting).
            address = f"127.0.0.1:{servers.grpc_port}"
            client = VerifierClient(address, verify_timeout_s=10, api_key=HASHED_KEY)
            result = await speculative_generate(
                PROMPT, make_drafter(draft_model), client, FixedK(3), gen_config(max_new_tokens=16)
            )
            assert result.token_ids == target_engine.greedy_continuation(PROMPT, 16)
            await client.close()
            client = VerifierClient(address, api_key=WRONG_KEY)
            started = asyncio.get_running_loop().time()
            with pytest.raises(Unauthenticated, match="UNAUTHENTICATED.*--api-key") as err:
                await speculative_generate(PROMPT, make_drafter(draft_model), client, FixedK(3), gen_config())
            assert asyncio.get_running_loop().time() - started < 5 and WRONG_KEY not in str(err.value)
            await client.close()
            return servers.state.metrics.exposition().decode()

    exposition = asyncio.run(run())
    samples = metric_samples(exposition)
    for method in ("OpenSession", "Verify", "CloseSession", "Describe", "Generate"):
        refused = samples[("specdec_requests_total", frozenset({("method", method), ("code", "UNAUTHENTICATED")}))]
        assert refused >= 2
    events = [r.fields for r in caplog.records if "method" in getattr(r, "fields", {})]  # type: ignore[attr-defined]
    principals = {e.get("principal") for e in events if e["code"] == "OK"}
    assert principals == {"alice", f"key-{hashlib.sha256(HASHED_KEY.encode()).hexdigest()[:8]}"}
    assert all("principal" not in e for e in events if e["code"] == "UNAUTHENTICATED")
    logged = caplog.text + " ".join(str(e) for e in events)
    for key in (PLAIN_KEY, HASHED_KEY, WRONG_KEY):
        assert key not in logged


@pytest.mark.parametrize("public", [False, True], ids=["keyed", "public-metrics"])
def test_http_routes_beyond_the_probes_need_a_key(target_engine: TargetEngine, tmp_path: Path, public: bool) -> None:
    async def run() -> None:
        async with running_servers(target_engine, settings=_settings(tmp_path, public_metrics=public)) as (servers, loading):
            await loading
            port = servers.http.port
            for path in ("/livez", "/readyz", "/healthz"):
                assert (await asyncio.to_thread(_get, port, path))[0] == 200
            for path in ("/metrics", "/v1/stats", "/v1/sessions", "/"):
                status, headers, body = await asyncio.to_thread(_get, port, path)
                if public:
                    assert status == 200, path
                    continue
                assert status == 401 and headers["www-authenticate"] == "Bearer", path
                assert (await asyncio.to_thread(_get, port, path, WRONG_KEY))[0] == 401
                assert WRONG_KEY.encode() not in (await asyncio.to_thread(_get, port, path, WRONG_KEY))[2]
                assert (await asyncio.to_thread(_get, port, path, PLAIN_KEY))[0] == 200
                assert (await asyncio.to_thread(_get, port, path, HASHED_KEY))[0] == 200
            health = (await asyncio.to_thread(_get, port, "/healthz"))[2].decode()
            assert str(tmp_path) not in health and "keys.txt" not in health

    asyncio.run(run())


# ---- the console programs ----------------------------------------------------------------


def _verifier_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "cloud", "--port", "0", "--http-port", "0", "--dtype", "float32", "--threads", "1", *flags]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--host", "0.0.0.0"], "--host 0.0.0.0 serves other machines: give --tls-cert and --tls-key"),
        (["--tls-cert", "server.pem"], "--tls-cert and --tls-key go together"),
        (["--api-keys-file", "/nonexistent/keys.txt"], "--api-keys-file /nonexistent/keys.txt"),
    ],
)
def test_verifier_refuses_to_start_with_one_line(flags: list[str], message: str) -> None:
    done = subprocess.run(
        _verifier_cmd("--model", "/nonexistent/model", *flags),
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("cloud-verifier: error: ") and message in last


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_pair(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secured_verifier(
    models: tuple[Path, Path],
    pki: Pki,
    target_engine: TargetEngine,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, list[str]]]:
    """cloud-verifier (of each engine) on 0.0.0.0 over TLS with API keys; yields its loopback
    address and its log so far."""
    keys = _keys_file(tmp_path_factory.mktemp("keys"))
    model, engine_flags = target_engine.served_model(models[1])
    cmd = _verifier_cmd(
        "--model",
        str(model),
        *engine_flags,
        "--host",
        "0.0.0.0",
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--api-keys-file",
        str(keys),
    )
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=ENV, stdin=subprocess.DEVNULL)
    assert proc.stderr is not None
    log, port = [], None
    for line in proc.stderr:
        log.append(line)
        if match := re.search(r"serving (\S+) on 0\.0\.0\.0:(\d+)", line):
            assert match.group(1) == model.name  # the folder's (or GGUF's) name, never its path
            port = match.group(2)
            break
    assert port, "cloud-verifier did not start:\n" + "".join(log)
    yield f"127.0.0.1:{port}", log
    proc.terminate()
    rest = proc.communicate(timeout=30)[1]
    log.append(rest)
    assert proc.returncode == 0


def _edge(
    models: tuple[Path, Path],
    address: str,
    *flags: str,
    env: dict[str, str] | None = None,
    prompt: tuple[str, str] = ("--prompt", "w5 w9"),
) -> subprocess.CompletedProcess[str]:
    cmd = edge_command("--cloud", address, "--draft-model", str(models[0]), *prompt, "--max-new-tokens", "8", *flags)
    return subprocess.run(cmd, capture_output=True, text=True, env=env or ENV, timeout=300, stdin=subprocess.DEVNULL)


def test_edge_over_tls_with_a_key(
    models: tuple[Path, Path], pki: Pki, secured_verifier: tuple[str, list[str]], tmp_path: Path
) -> None:
    address, log = secured_verifier
    tls = ["--tls-ca", str(pki.ca)]
    ok = _edge(models, address, *tls, env={**ENV, "SPECDEC_EDGE_API_KEY": PLAIN_KEY})  # the key from the environment
    assert ok.returncode == 0, ok.stderr
    assert re.search(r"\[auto\] \d+ tokens", ok.stderr)

    wrong = _edge(models, address, *tls, "--api-key", WRONG_KEY)
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr
    last = wrong.stderr.strip().splitlines()[-1]
    assert last.startswith("edge-agent: error: the verifier refused the call (UNAUTHENTICATED)")
    assert "--api-key" in last
    # A batch run stops at the first prompt too: every other prompt would be refused the same way.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "w5 w9"}\n{"id": "b", "prompt": "w7"}\n')
    batch = _edge(models, address, *tls, "--api-key", WRONG_KEY, prompt=("--prompts", str(prompts)))
    assert batch.returncode == 1 and "(UNAUTHENTICATED)" in batch.stderr.strip().splitlines()[-1]

    untrusted = _edge(models, address, "--api-key", PLAIN_KEY, "--tls")  # the system's CAs: not this one
    assert untrusted.returncode == 1 and "TLS with the verifier failed" in untrusted.stderr.strip().splitlines()[-1]
    other_ca = make_pki(tmp_path / "other-pki", "another CA").ca
    wrong_ca = _edge(models, address, "--api-key", PLAIN_KEY, "--tls-ca", str(other_ca))
    assert wrong_ca.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in wrong_ca.stderr and "--tls-ca" in wrong_ca.stderr
    # The edge's one line alone: no line of gRPC's own logging beside it.
    for failed in (wrong, untrusted, wrong_ca):
        assert len(failed.stderr.strip().splitlines()) == 1 and failed.stderr.startswith("edge-agent: error: "), failed.stderr
    for done in (ok, wrong, untrusted, wrong_ca):
        assert PLAIN_KEY not in done.stderr + done.stdout and WRONG_KEY not in done.stderr + done.stdout
    assert not any(key in "".join(log) for key in (PLAIN_KEY, WRONG_KEY))


def test_a_session_belongs_to_the_key_that_opened_it(target_engine: TargetEngine, tmp_path: Path) -> None:
    """Another key cannot Verify, Close or see a session: NOT_FOUND, exactly as for an id that
    does not exist, and the session goes on untouched for its own key."""

    async def run() -> None:
        async with running_servers(target_engine, settings=_settings(tmp_path)) as (servers, loading):
            await loading
            channel, verifier = stub(servers.grpc_port)
            alice, other = _metadata(PLAIN_KEY), _metadata(HASHED_KEY)
            opened = await verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT), metadata=alice)
            round_ = pb.VerifyRequest(session_id=opened.session_id, base_position=len(PROMPT), draft_tokens=[4])
            missing = pb.VerifyRequest(session_id="no-such-session", base_position=len(PROMPT), draft_tokens=[4])
            answers = []
            for call in (
                verifier.Verify(round_, metadata=other),
                verifier.Verify(missing, metadata=other),
                verifier.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), metadata=other),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                answers.append(err.value)
            assert [e.code() for e in answers] == [grpc.StatusCode.NOT_FOUND] * 3
            assert "unknown or was evicted" in answers[0].details() and "unknown or was evicted" in answers[1].details()
            reply = await verifier.Verify(round_, metadata=alice)
            assert reply.new_base_position > len(PROMPT)
            await verifier.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id), metadata=alice)
            await channel.close()

    asyncio.run(run())


def test_a_flood_of_wrong_keys_is_counted_in_full_and_logged_in_a_few_lines(target_model, tmp_path: Path) -> None:
    """10,000 OpenSession calls with a wrong key: the refusal counter says 10,000, the log grows
    by a few lines (one per source, code and interval, each saying how many it stands for)."""
    from io import StringIO

    from cloud.logs import TextFormatter

    buffer = StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(TextFormatter())
    logger = logging.getLogger("cloud-verifier")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    calls = 10_000

    async def flood(verifier: Any) -> None:
        async def refused(_: int) -> None:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT), metadata=_metadata(WRONG_KEY))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

        for start in range(0, calls, 500):
            await asyncio.gather(*(refused(i) for i in range(start, start + 500)))

    async def run() -> str:
        async with running_servers(target_model, settings=_settings(tmp_path)) as (servers, loading):
            await loading
            channel, verifier = stub(servers.grpc_port)
            before = len(buffer.getvalue())
            await flood(verifier)
            grown = len(buffer.getvalue()) - before
            await channel.close()
            assert grown < 10_000, buffer.getvalue()[-2000:]
            return servers.state.metrics.exposition().decode()

    try:
        exposition = asyncio.run(run())
    finally:
        logger.removeHandler(handler)
        logger.level = level
    samples = metric_samples(exposition)
    assert samples[("specdec_refused_calls_total", frozenset({("code", "UNAUTHENTICATED"), ("key", "")}))] == calls
    lines = [line for line in buffer.getvalue().splitlines() if "refused" in line]
    assert lines and sum(int(re.search(r"refusals=(\d+)", line).group(1)) for line in lines) <= calls  # type: ignore[union-attr]
    assert WRONG_KEY not in buffer.getvalue()


def test_each_key_sees_its_own_sessions_and_an_operator_key_sees_all(target_model, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("alice alice-key-1\nbob bob-key-2\nops ops-key-3 operator\n")
    settings = SETTINGS.model_copy(update={"api_keys_file": str(keys)})

    async def run() -> None:
        async with running_servers(target_model, settings=settings) as (servers, loading):
            await loading
            channel, verifier = stub(servers.grpc_port)
            for key, sessions in (("alice-key-1", 1), ("bob-key-2", 2)):
                for _ in range(sessions):
                    opened = await verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=PROMPT), metadata=_metadata(key))
                    await verifier.Verify(
                        pb.VerifyRequest(session_id=opened.session_id, base_position=len(PROMPT), draft_tokens=[4]),
                        metadata=_metadata(key),
                    )
            await channel.close()
            port = servers.http.port
            seen = {}
            for key in ("alice-key-1", "bob-key-2", "ops-key-3"):
                status, _, body = await asyncio.to_thread(_get, port, "/v1/sessions", key)
                _, _, stats = await asyncio.to_thread(_get, port, "/v1/stats", key)
                assert status == 200
                seen[key] = (json.loads(body)["count"], json.loads(stats)["open_sessions"], json.loads(stats)["window"]["rounds"])
            assert seen == {"alice-key-1": (1, 1, 1), "bob-key-2": (2, 2, 2), "ops-key-3": (3, 3, 3)}
            for key in (None, "alice-key-1"):  # the schema is not served: no route is open without a key
                assert (await asyncio.to_thread(_get, port, "/openapi.json", key))[0] == 404

    asyncio.run(run())
