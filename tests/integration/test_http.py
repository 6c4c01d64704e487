"""The verifier's operations surface on real servers (uvicorn + grpc.aio, port 0, one event
loop): probes across model loading, Prometheus counters after known rounds, gRPC health and
reflection, session and round stats, the live page."""

import asyncio
import json
import re
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cloud.config import VerifierSettings
from cloud.sessions import session_tag
from shared.pb import verifier_pb2 as pb
from tests.harness import random_prompt
from tests.ops import SETTINGS, greedy_continuation, http_get, http_json, metric_samples, running_servers, stub

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _health(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
        return int(reply.status)


# ---- readiness across loading and draining ---------------------------------------------


def test_probes_go_503_to_200_across_model_loading(target_model) -> None:
    async def run() -> None:
        gate = threading.Event()
        async with running_servers(target_model, gate) as (servers, loading):
            http = servers.http.port
            assert (await http_get(http, "/livez"))[0] == 200
            status, body = await http_json(http, "/readyz")
            assert status == 503 and body["detail"] == "loading"
            loading_health = (await http_json(http, "/healthz"))[1]
            assert loading_health["status"] == "loading" and loading_health["max_kv_bytes"] is None
            assert await _health(servers.grpc_port) == NOT_SERVING
            channel, verifier = stub(servers.grpc_port)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=[3, 4]))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "loading" in (err.value.details() or "")

            gate.set()
            await loading
            assert (await http_json(http, "/readyz")) == (200, {"status": "ready"})
            assert await _health(servers.grpc_port) == SERVING
            assert await _health(servers.grpc_port, "specdec.v1.Verifier") == SERVING
            health = (await http_json(http, "/healthz"))[1]
            assert health["model_ids"] == ["tiny-target"] and health["dtype"] == "float32"
            assert health["engine"] == "transformers"
            assert health["device"] == "cpu" and health["sessions"] == 0 and health["uptime_s"] > 0
            limits = servers.state.verifier.limits
            assert (health["max_kv_bytes"], health["max_context_tokens"]) == (4 << 30, limits.max_context_tokens)
            assert re.fullmatch(r"\d+\.\d+\.\d+.*|unknown", health["version"])

            await servers.state.drain()
            assert (await http_json(http, "/readyz")) == (503, {"detail": "draining"})
            assert await _health(servers.grpc_port) == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=[3, 4]))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in (err.value.details() or "")
            assert (await http_get(http, "/livez"))[0] == 200  # alive while draining
            await channel.close()

    asyncio.run(run())


# ---- Prometheus counters after a known sequence of rounds ------------------------------


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metric_counters_move_by_the_right_amounts(target_model) -> None:
    prompt = random_prompt(3)
    g = greedy_continuation(target_model, prompt, 6)  # the target's greedy tokens g0..g5
    wrong = (g[2] + 1) % 96

    async def run() -> None:
        async with running_servers(target_model) as (servers, loading):
            await loading
            channel, verifier = stub(servers.grpc_port)
            before = metric_samples((await http_get(servers.http.port, "/metrics"))[1].decode())
            opened = await verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=prompt))
            sid, n = opened.session_id, len(prompt)
            requests = [  # (request, ok)
                (pb.VerifyRequest(session_id=sid, base_position=n, draft_tokens=[g[0], g[1], wrong], request_id="r1"), True),
                (pb.VerifyRequest(session_id=sid, base_position=n + 3, draft_tokens=[g[3], g[4]]), True),
                (pb.VerifyRequest(session_id=sid, base_position=n + 6, draft_tokens=[5] * 9), False),  # k over 8
                (pb.VerifyRequest(session_id="nope", base_position=n, draft_tokens=[5]), False),
            ]
            replies = []
            for request, ok in requests:
                try:
                    replies.append(await verifier.Verify(request))
                except grpc.aio.AioRpcError:
                    assert not ok
            assert [(r.accepted_len, r.next_token, r.bonus) for r in replies] == [(2, g[2], False), (2, g[5], True)]
            sessions = (await http_json(servers.http.port, "/v1/sessions"))[1]
            during = metric_samples((await http_get(servers.http.port, "/metrics"))[1].decode())
            await verifier.CloseSession(pb.CloseSessionRequest(session_id=sid))
            after = metric_samples((await http_get(servers.http.port, "/metrics"))[1].decode())
            await asyncio.sleep(1.01 - time.time() % 1)  # the per-second series holds complete seconds
            stats = (await http_json(servers.http.port, "/v1/stats"))[1]
            await channel.close()

        def delta(name: str, **labels: str) -> float:
            return _value(after, name, **labels) - _value(before, name, **labels)

        assert delta("specdec_requests_total", method="OpenSession", code="OK") == 1
        assert delta("specdec_requests_total", method="Verify", code="OK") == 2
        assert delta("specdec_requests_total", method="Verify", code="INVALID_ARGUMENT") == 1
        assert delta("specdec_requests_total", method="Verify", code="NOT_FOUND") == 1
        assert delta("specdec_requests_total", method="CloseSession", code="OK") == 1
        assert delta("specdec_rounds_total") == 2
        assert delta("specdec_draft_tokens_total") == 5
        assert delta("specdec_accepted_tokens_total") == 4
        assert [delta("specdec_accepted_tokens_per_pos_total", position=str(i)) for i in range(8)] == [2, 2, 0, 0, 0, 0, 0, 0]
        assert delta("specdec_bonus_tokens_total") == 1
        assert delta("specdec_draft_length_count") == 2 and delta("specdec_draft_length_sum") == 5
        assert delta("specdec_draft_length_bucket", le="2.0") == 1 and delta("specdec_draft_length_bucket", le="3.0") == 2
        assert delta("specdec_accepted_length_count") == 2 and delta("specdec_accepted_length_sum") == 4
        for histogram in ("specdec_verify_latency_seconds", "specdec_forward_seconds", "specdec_queue_seconds"):
            assert delta(f"{histogram}_count") == 2
        assert delta("specdec_verify_latency_seconds_sum") >= delta("specdec_forward_seconds_sum") > 0
        assert delta("specdec_received_bytes_total", method="Verify") == sum(r.ByteSize() for r, _ in requests)
        assert delta("specdec_sent_bytes_total", method="Verify") == sum(r.ByteSize() for r in replies)
        assert _value(during, "specdec_open_sessions") == 1 and _value(after, "specdec_open_sessions") == 0
        kv_per_token = servers.state.verifier.sessions.kv_bytes_per_token  # type: ignore[union-attr]
        assert _value(during, "specdec_kv_cache_bytes") == (n + 6 - 1) * kv_per_token
        # bounded labels only: key names come from the keys file, reasons from a fixed few
        assert {key for (_, labels) in after for key, _ in labels} <= {"method", "code", "position", "le", "key", "reason"}

        assert sessions["count"] == 1
        row = sessions["sessions"][0]
        assert row["length"] == n + 6 and row["rounds"] == 2 and row["age_s"] >= row["idle_s"] >= 0
        assert row["session"] == session_tag(sid) and sid not in json.dumps(sessions)
        assert set(row) == {"session", "age_s", "idle_s", "length", "rounds", "kv_bytes"}  # no token contents

        window = stats["window"]
        assert window["rounds"] == 2 and window["tau"] == 3.0
        assert window["acceptance_by_position"][:3] == [1.0, 1.0, 0.0] and window["drafted_by_position"][:3] == [2, 2, 1]
        assert sum(stats["rounds_per_s"]) == 2 and stats["open_sessions"] == 0

    asyncio.run(run())


# ---- gRPC health and reflection --------------------------------------------------------


async def _reflected_services(port: int) -> list[str]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        async for reply in call:
            return [s.name for s in reply.list_services_response.service]
    return []


async def _reflection_status(port: int) -> grpc.StatusCode:
    """The status of a reflection call that sends no message: a server without the service answers
    its headers at once, and a message written after that answer would fail on the client's side
    (INTERNAL) before the status is read."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=10)
        return await call.code()


@pytest.mark.parametrize("reflect", [True, False], ids=["reflection on", "reflection off"])
def test_grpc_health_serving_and_reflection_switch(target_model, reflect: bool) -> None:
    async def run() -> None:
        settings = SETTINGS.model_copy(update={"reflection": reflect})
        async with running_servers(target_model, settings=settings) as (servers, loading):
            await loading
            assert await _health(servers.grpc_port) == SERVING
            if reflect:
                services = await _reflected_services(servers.grpc_port)
                assert {"specdec.v1.Verifier", "grpc.health.v1.Health"} <= set(services)
            else:
                assert await _reflection_status(servers.grpc_port) == grpc.StatusCode.UNIMPLEMENTED

    asyncio.run(run())


# ---- request ids in the logs -----------------------------------------------------------


def test_logs_carry_request_ids_and_no_prompt(target_model, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG", logger="cloud-verifier")

    async def run() -> str:
        async with running_servers(target_model) as (servers, loading):
            await loading
            channel, verifier = stub(servers.grpc_port)
            opened = await verifier.OpenSession(pb.OpenSessionRequest(prompt_tokens=[7, 8, 9]))
            await verifier.Verify(
                pb.VerifyRequest(session_id=opened.session_id, base_position=3, draft_tokens=[4], request_id="edge-42")
            )
            with pytest.raises(grpc.aio.AioRpcError):
                await verifier.Verify(pb.VerifyRequest(session_id="nope", draft_tokens=[4]))
            await channel.close()
            return opened.session_id

    session_id = asyncio.run(run())
    events = [r.fields for r in caplog.records if hasattr(r, "fields") and "method" in r.fields]  # type: ignore[attr-defined]
    verify_ok, verify_failed = [e for e in events if e["method"] == "Verify"]
    assert verify_ok["request_id"] == "edge-42" and verify_ok["code"] == "OK"
    assert verify_failed["code"] == "NOT_FOUND" and re.fullmatch(r"[0-9a-f]{16}", verify_failed["request_id"])
    opened = next(e for e in events if e["method"] == "OpenSession")
    assert opened["prompt_tokens"] == 3  # a count: the ids themselves only with --log-prompts
    assert opened["session"] == verify_ok["session"] == session_tag(session_id)
    assert session_id not in caplog.text  # logs carry a tag, never the id that drives the session


# ---- the live page ---------------------------------------------------------------------


def test_live_page_is_self_contained(target_model) -> None:
    async def run() -> None:
        async with running_servers(target_model) as (servers, loading):
            await loading
            status, body = await http_get(servers.http.port, "/")
            page = body.decode()
            assert status == 200 and page.count("<canvas id=") == 4 and "v1/stats" in page
            assert not re.search(r"(src|href)=\"(https?:)?//", page)  # no CDN: the machine may be offline
            assert (await http_get(servers.http.port, "/docs"))[0] == 404

    asyncio.run(run())


def test_http_port_zero_is_logged(target_model, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="cloud-verifier")

    async def run() -> int:
        async with running_servers(target_model, settings=VerifierSettings(port=0, http_port=0)) as (servers, loading):
            await loading
            return servers.http.port

    port = asyncio.run(run())
    assert port > 0 and f"http on 127.0.0.1:{port}" in caplog.text
    assert re.search(r"serving tiny-target on 127\.0\.0\.1:\d+", caplog.text)
