"""The verifier's HTTP side: probes, Prometheus metrics, session and round stats, the live
page. Served by uvicorn in the gRPC server's own event loop (start_http)."""

from __future__ import annotations

from dataclasses import asdict
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException, Response
from fastapi.responses import HTMLResponse

from cloud.metrics import CONTENT_TYPE
from cloud.state import ServerState
from cloud.tls import ServerTls
from shared import http_server
from shared.api_keys import Caller
from shared.errors import Unauthenticated
from shared.http_server import HttpServer


def _status(state: ServerState) -> dict[str, Any]:
    """The status, the model, the caps admission enforces (the context of a session and the KV
    of all) and the uptime."""
    verifier = state.verifier  # None while the model loads: its facts are null
    engine = verifier.engine.describe() if verifier else {}
    return {
        "status": state.status,
        "model_ids": [verifier.model_id] if verifier else [],
        "engine": engine.get("engine"),
        "dtype": engine.get("dtype"),
        "dtype_reason": verifier.dtype_reason if verifier else None,
        "device": engine.get("device"),
        "max_context_tokens": verifier.limits.max_context_tokens if verifier else None,
        "max_kv_bytes": verifier.limits.sessions.max_kv_bytes if verifier else None,
        "uptime_s": round(state.uptime_s(), 3),
    }


def _caller(state: ServerState, public: bool = False) -> Any:
    """A dependency that lets a request in with an accepted API key (or with none configured,
    or, `public`, with none at all) and gives its Caller; else 401 with the reason, never the key."""

    async def check(authorization: str | None = Header(None)) -> Caller:
        try:
            return state.api_keys.caller(authorization)
        except Unauthenticated as err:
            if public:
                return NOBODY
            raise HTTPException(401, detail=str(err), headers={"WWW-Authenticate": "Bearer"}) from None

    return Depends(check)


NOBODY = Caller("", sees_all=False)  # --public-metrics without a key: sees no session


def create_app(state: ServerState, public_metrics: bool = False) -> FastAPI:
    # No /docs and no /openapi.json: the page pulls scripts from a CDN, the schema would be the
    # one route open without a key, and operators read the README. Routes are async so they run
    # on the event loop, where the telemetry they read is written.
    app = FastAPI(title="cloud-verifier", version=state.version, docs_url=None, redoc_url=None, openapi_url=None)
    # Probes (/livez /readyz /healthz) stay open: kubelet sends no key. The rest needs one
    # (--public-metrics: none for the aggregates; sessions stay their keys' own).
    _add_probes(app, state)
    _add_telemetry(app, state, _caller(state, public_metrics))
    return app


def _add_probes(app: FastAPI, state: ServerState) -> None:
    @app.get("/livez")
    async def livez() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        if not state.ready:
            raise HTTPException(503, detail=state.status)
        return {"status": state.status}

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {**_status(state), "sessions": len(state.sessions()), "version": state.version}


def _add_telemetry(app: FastAPI, state: ServerState, caller: Any) -> None:
    """Prometheus metrics (every key's aggregates), and the sessions and recent rounds the
    caller may see: its own key's, or every key's for an operator key (shared/api_keys.py)."""
    page = (resources.files("cloud") / "static" / "index.html").read_text()

    @app.get("/metrics", dependencies=[caller])
    async def metrics() -> Response:
        state.sessions()  # refreshes the session gauges
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/sessions")
    async def sessions(who: Caller = caller) -> dict[str, Any]:
        rows = state.sessions(who)
        return {"count": len(rows), "sessions": [asdict(row) for row in rows]}

    @app.get("/v1/stats")
    async def stats(who: Caller = caller) -> dict[str, Any]:
        rows = state.sessions(who)
        return {
            **_status(state),
            "open_sessions": len(rows),
            "kv_bytes": sum(r.kv_bytes for r in rows),
            "prefix_reuse": state.prefix_reuse(who),
            **state.live_for(who).snapshot(),
        }

    @app.get("/", response_class=HTMLResponse, dependencies=[caller])
    async def live_page() -> str:
        return page


async def start_http(app: FastAPI, host: str, port: int, tls: ServerTls | None = None) -> HttpServer:
    """Serve app on host:port (0 = any free port) in this event loop, HTTPS with `tls` (no
    client certificate asked: see cloud/tls.py); returns once it listens."""
    return await http_server.start_http(app, host, port, **(tls.uvicorn_options() if tls else {}))
