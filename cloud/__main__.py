"""`cloud-verifier`: serve the target model over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

import torch

from cloud.config import VerifierSettings
from cloud.grpc_server import create_server
from cloud.verifier import Verifier
from shared import lm
from shared.cli import add_settings_flags, run_cli, settings_from_args

log = logging.getLogger("cloud-verifier")
SHUTDOWN_GRACE_S = 5.0


def build_verifier(settings: VerifierSettings) -> Verifier:
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if settings.model is None:
        from shared.model_store import TARGET_MODEL, ensure_model

        path = str(ensure_model(TARGET_MODEL))
    else:
        path = settings.model
    model = lm.load_model(path, settings.dtype, settings.device)
    return Verifier(model, path, settings.limits())


async def serve(settings: VerifierSettings) -> None:
    verifier = build_verifier(settings)
    server, port = create_server(verifier, f"{settings.host}:{settings.port}")
    await server.start()
    log.info("serving %s on %s:%d", verifier.model_id, settings.host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down (grace %.0fs)", SHUTDOWN_GRACE_S)
    await server.stop(SHUTDOWN_GRACE_S)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cloud-verifier", description=__doc__)
    add_settings_flags(parser, VerifierSettings)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def run() -> int:
        asyncio.run(serve(settings_from_args(VerifierSettings, args)))
        return 0

    return run_cli("cloud-verifier", run)


if __name__ == "__main__":
    sys.exit(main())
