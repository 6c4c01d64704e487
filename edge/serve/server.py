"""`edge-agent serve`: an OpenAI-compatible endpoint on this machine. Each request drafts here
and verifies in the cloud like `edge-agent --prompt` does; every edge-agent flag is the
default for requests, and a request's `speculative` object overrides some per request.

    edge-agent serve --cloud HOST:PORT [--host 127.0.0.1] [--port 8000]
                     [--serve-api-key KEY | --serve-api-keys-file FILE]

Without --cloud a verifier starts here as a child process, as for edge-agent. The server
logs `serving on http://HOST:PORT` once it accepts requests (port 0: any free port).

With --serve-api-keys-file, each key names a caller (the file's format is cloud-verifier's
--api-keys-file); a caller's conversations are kept for its own next turns, and only its own,
on this machine and on a verifier without API keys.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from edge.config import EdgeSettings
from edge.context import cloud_address, load_edge
from edge.metrics import EdgeMetrics
from shared.api_keys import ApiKeys
from shared.cli import add_settings_flags, run_cli, settings_from_args
from shared.errors import ConfigError
from shared.models import TARGET_MODEL
from shared.net import is_loopback

log = logging.getLogger("edge-agent")
SHUTDOWN_GRACE_S = 5  # open streams get this long to finish once a stop is asked
RUN_ONLY = ("prompt", "prompts", "output", "record", "log_rounds", "show_steps")  # edge-agent run flags


class ServeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_EDGE_")

    host: str = Field(
        "127.0.0.1", description="address to listen on (not loopback: give --serve-api-key or --serve-api-keys-file)"
    )
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 = any free port, logged)")
    serve_api_key: SecretStr | None = Field(None, description="Bearer key clients of /v1/* must send (off by default)")
    serve_api_keys_file: str | None = Field(
        None,
        description="file of the keys clients of /v1/* may send, one a line ('[NAME] KEY' or "
        "'[NAME] sha256:HEX', '#' comments: cloud-verifier's --api-keys-file format); each NAME is a "
        "caller whose conversations are reused for its own requests only (instead of --serve-api-key)",
    )
    served_model_name: str | None = Field(
        None, description="model id /v1/models lists and responses carry (default: the target model folder's name)"
    )

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "the HTTP endpoint": ("host", "port", "serve_api_key", "serve_api_keys_file", "served_model_name"),
    }

    def api_keys(self) -> ApiKeys:
        """The keys /v1/* accepts: the file's, the one key, or none (open)."""
        if self.serve_api_keys_file is not None:
            return ApiKeys.load(self.serve_api_keys_file, "--serve-api-keys-file")
        if self.serve_api_key is not None:
            return ApiKeys.one(self.serve_api_key.get_secret_value())
        return ApiKeys()

    def model_name(self, edge: EdgeSettings) -> str:
        if self.served_model_name:
            return self.served_model_name
        return Path(edge.target_model).name if edge.target_model else TARGET_MODEL


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder that refuses it: as good as missing
        return False


def _check_installed() -> None:
    missing = [name for name in ("fastapi", "uvicorn") if not _installed(name)]
    if missing:
        raise ConfigError(f"edge-agent serve needs {' and '.join(missing)}: pip install 'specedge[serve]'")


def _check_settings(edge: EdgeSettings, options: ServeSettings) -> None:
    given = [name for name in RUN_ONLY if getattr(edge, name)]
    if given:
        raise ConfigError(
            f"--{given[0].replace('_', '-')} is an edge-agent run option; serve answers requests "
            "(each response carries its stats)"
        )
    if edge.mode == "edge_only":
        raise ConfigError("serve answers with verified text: --mode edge_only is not served")
    if options.serve_api_key is not None and options.serve_api_keys_file is not None:
        raise ConfigError("give --serve-api-key or --serve-api-keys-file, not both (a key file may hold one key)")
    if options.serve_api_key is None and options.serve_api_keys_file is None and not is_loopback(options.host):
        log.warning(
            "serving on %s without --serve-api-key or --serve-api-keys-file: anyone who can reach it can use the verifier",
            options.host,
        )


async def _serve_http(app: Any, options: ServeSettings) -> None:
    """uvicorn on --host/--port until SIGINT or SIGTERM; then open streams get a grace period."""
    from shared.http_server import start_http, stop_signal  # uvicorn: only when serving

    server = await start_http(app, options.host, options.port, SHUTDOWN_GRACE_S)
    host = f"[{options.host}]" if ":" in options.host else options.host
    log.info("serving on http://%s:%d", host, server.port)
    stopping = stop_signal()
    await asyncio.wait({server.task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    await server.stop()


async def serve(edge: EdgeSettings, options: ServeSettings, keys: ApiKeys) -> None:
    from edge.pair_check import apply_pair_check, check_pair
    from edge.serve.app import ServeInfo, create_app
    from edge.serve.engine import Engine

    ctx = load_edge(edge)
    if edge.metrics_port is not None:
        ctx.metrics = EdgeMetrics()
        log.info("edge metrics on 127.0.0.1:%d", ctx.metrics.serve(edge.metrics_port))
    async with cloud_address(edge) as address:
        assert address is not None  # edge_only is refused
        engine = Engine(ctx, address)
        try:
            apply_pair_check(ctx, await check_pair(ctx, engine.client))
            await _serve_http(create_app(engine, ServeInfo(options.model_name(edge), keys, address)), options)
        finally:
            await engine.close()


def parser() -> argparse.ArgumentParser:
    """The endpoint's own flags, then every edge-agent setting (each in its group)."""
    made = argparse.ArgumentParser(
        prog="edge-agent serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_settings_flags(made, ServeSettings)
    add_settings_flags(made, EdgeSettings)
    return made


def serve_main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)

    def run() -> int:
        _check_installed()
        edge, options = settings_from_args(EdgeSettings, args), settings_from_args(ServeSettings, args)
        _check_settings(edge, options)
        keys = options.api_keys()  # a bad file fails here, before the models load
        asyncio.run(serve(edge, options, keys))
        return 0

    return run_cli("edge-agent serve", run)
