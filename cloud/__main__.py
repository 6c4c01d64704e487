"""`cloud-verifier`: serve the target model over gRPC, with probes, Prometheus metrics and a
live page over HTTP."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from cloud.config import PRECEDENCE, VerifierSettings, load_settings
from cloud.engine.transformers import TransformersEngine
from cloud.logs import configure_logging, log_event
from cloud.process import serve
from cloud.verifier import Verifier
from shared import lm
from shared.cli import add_settings_flags, run_cli
from shared.hardware import choose_dtype
from shared.models import TARGET_MODEL
from shared.models.hub import describe as describe_model
from shared.models.store import model_folder

log = logging.getLogger("cloud-verifier")


def build_verifier(settings: VerifierSettings) -> Verifier:
    device = lm.resolve_device(settings.device)
    dtype = choose_dtype(settings.dtype, device.type)
    threads = lm.configure_cpu(device, settings.threads)
    log_event(
        log,
        logging.INFO,
        f"{device.type}, {dtype.name} ({dtype.reason})" + (f", {threads} CPU threads" if threads else ""),
        dtype=dtype.name,
        dtype_reason=dtype.reason,
        threads=threads,
    )
    path = model_folder(settings.model, TARGET_MODEL)
    model = lm.load_model(path, dtype.name, str(device))
    # A name, not a path, reaches callers (OpenSession, /healthz, /v1/stats): the folder's name,
    # or `org/name@commit` for a Hub model, so the revision that ran is pinned.
    return Verifier(TransformersEngine(model), describe_model(path), settings.limits(), dtype_reason=dtype.reason)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cloud-verifier", description=__doc__, epilog=PRECEDENCE)
    add_settings_flags(parser, VerifierSettings)
    args = parser.parse_args(argv)

    def run() -> int:
        settings = load_settings(vars(args))
        configure_logging(settings.log_format, settings.log_level)
        asyncio.run(serve(settings, build_verifier))
        return 0

    return run_cli("cloud-verifier", run)


if __name__ == "__main__":
    sys.exit(main())
