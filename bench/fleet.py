"""Fleet figures on loopback: three cloud-verifier replicas behind HAProxy (deploy/haproxy.cfg),
Prometheus scraping them. Two measurements in one run:

1. what the proxy adds to a Verify call: pairs of Verify calls, one through HAProxy and one
   straight to the replica HAProxy routes that session to, interleaved (which goes first
   alternates), each on its own session;
2. failover: concurrent edge sessions (greedy, fp32) through HAProxy, one replica SIGKILLed
   once it has served some rounds; sessions completed, reopens, every output against
   cloud_only's, and the extra latency the kill caused (the stalled round against the others).

Tiny random models by default (bench/tiny_models.py): the figures are the fleet's, not a
model's. Writes fleet.json, fleet.md and dashboard.png (the Grafana dashboard's queries,
bench/dashboard_render.py) under --report.

    python -m bench.fleet --report docs/fleet
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench import environment
from bench.cli import settings_parser
from bench.dashboard_render import load_dashboard, render
from bench.fleet_parts import REPO, Replica, running_haproxy, running_replicas
from bench.fleet_report import markdown
from bench.fleet_sessions import failover, proxy_overhead
from bench.prometheus import running_prometheus
from bench.tiny_models import save_pair
from shared.cli import run_cli, settings_from_args

DASHBOARD = REPO / "deploy" / "grafana" / "specdec.json"


class FleetSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_FLEET_")

    report: Path = Field(description="folder for fleet.json, fleet.md, dashboard.png")
    replicas: int = Field(3, ge=1, description="verifier replicas behind the proxy")
    sessions: int = Field(8, ge=1, description="concurrent edge sessions in the failover run")
    max_new_tokens: int = Field(600, ge=1, description="per edge session")
    kill_after_rounds: int = Field(200, ge=1, description="SIGKILL the busiest replica after this many rounds")
    pairs: int = Field(400, ge=1, description="Verify pairs (proxy, direct) for the proxy's added latency")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "the fleet": ("replicas", "pairs"),
        "the failover run": ("sessions", "max_new_tokens", "kill_after_rounds"),
        "results": ("report",),
    }


def parser() -> argparse.ArgumentParser:
    return settings_parser("python -m bench.fleet", __doc__, FleetSettings)


async def _measure(args: FleetSettings, proxy: str, replicas: list[Replica], draft: Path) -> dict[str, Any]:
    overhead = await proxy_overhead(proxy, replicas, args.pairs)
    fleet = await failover(proxy, replicas, draft, args.sessions, args.max_new_tokens, args.kill_after_rounds)
    return {"proxy_overhead": overhead, "failover": fleet}


def run(args: FleetSettings, folder: Path) -> dict[str, Any]:
    torch.set_num_threads(1)  # the edges' draft model: leave the cores to the verifiers
    draft, target = save_pair(folder / "models")
    with running_replicas(target, args.replicas, folder) as replicas:
        targets = [f"127.0.0.1:{r.http_port}" for r in replicas]
        with running_prometheus(targets, folder / "prometheus") as prom, running_haproxy(replicas, folder) as proxy:
            prom.wait_for_scrapes(len(replicas))
            measured = asyncio.run(_measure(args, proxy, replicas, draft))
            prom.wait_for_scrapes(prom.scrapes() + 2)
            end = time.time()
            start = measured["failover"]["started_unix_s"] - 3.0  # the dashboard shows the sessions' part
            kill_at = measured["failover"]["kill_unix_s"] - start
            caption = (
                f"{args.replicas} verifiers behind HAProxy, tiny random models, {args.sessions} concurrent edge "
                f"sessions from 3 s; one replica SIGKILLed at {kill_at:.0f} s"
            )
            args.report.mkdir(parents=True, exist_ok=True)
            render(prom, load_dashboard(DASHBOARD), args.report / "dashboard.png", (start, end), 1.0, "5s", caption)
    return measured | {"dashboard_window_s": round(end - start, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    given = parser().parse_args(argv)
    return run_cli("python -m bench.fleet", lambda: _run_and_report(settings_from_args(FleetSettings, given), argv))


def _run_and_report(args: FleetSettings, argv: Sequence[str] | None) -> int:
    with tempfile.TemporaryDirectory(prefix="specdec-fleet-") as tmp:
        measured = run(args, Path(tmp))
    git = environment.git_state(REPO)
    result = {
        "command": "python -m bench.fleet " + " ".join(sys.argv[1:] if argv is None else argv),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": environment.machine(),
        "versions": environment.versions(),
        "git_commit": git["commit"],
        "git_dirty": git["dirty"],
        "models": "tiny random Llama pair (bench/tiny_models.py: 2 layers, hidden 32, vocab 96), fp32",
        "settings": args.model_dump(mode="json"),
    } | measured
    (args.report / "fleet.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.report / "fleet.md").write_text(markdown(result))
    sys.stderr.write(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
