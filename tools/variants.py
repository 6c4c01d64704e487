"""Run edge-agent variants side by side against one cloud-verifier, at several added RTTs,
and tabulate them (one JSON + one Markdown table). Every variant sees the same prompts, the
same verifier process and, per RTT, the same proxy.

    python tools/variants.py --prompts P.jsonl --output DIR --rtt-ms 0,50 \\
        --variant "cloud_only=--mode cloud_only" --variant "k4=--k 4" ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from summarize import summarize  # noqa: E402


def _start(cmd: list[str], log: Path, pattern: str) -> tuple[subprocess.Popen[bytes], str]:
    handle = log.open("w")
    proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT)
    for _ in range(1200):
        match = re.search(pattern, log.read_text())
        if match:
            return proc, match.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[2]} failed: see {log}")
        time.sleep(0.5)
    raise SystemExit(f"{cmd[2]} did not start: see {log}")


EDGE_PREFIX: list[str] = []  # taskset prefix in --pin mode


def _run_edge(args: list[str], log: Path) -> int:
    """Run edge-agent; returns its peak RSS in KiB (from wait4, this process alone)."""
    with log.open("w") as handle:
        proc = subprocess.Popen([*EDGE_PREFIX, sys.executable, "-m", "edge", *args], stdout=handle,
                                stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"edge-agent {' '.join(args)} failed: see {log}")
    return int(usage.ru_maxrss)


def _agreement(records: list[dict[str, Any]], reference: dict[str, list[int]]) -> float:
    """Fraction of output positions equal to the reference (lossy variants)."""
    same = total = 0
    for r in records:
        ref = reference.get(r["id"], [])
        total += max(len(ref), len(r["token_ids"]))
        same += sum(a == b for a, b in zip(r["token_ids"], ref, strict=False))
    return round(same / total, 3) if total else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--variant", action="append", required=True, help="NAME=edge-agent flags")
    parser.add_argument("--rtt-ms", default="0", help="comma-separated added RTTs")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-new-tokens", default="48")
    parser.add_argument("--pin", action="store_true",
                        help="two-machine mode: verifier on core 0, edge on core 1, one thread each (taskset)")
    args = parser.parse_args()
    out = args.output
    out.mkdir(parents=True, exist_ok=True)
    cloud_prefix, cloud_flags = (["taskset", "-c", "0"], ["--threads", "1"]) if args.pin else ([], [])
    if args.pin:
        EDGE_PREFIX[:] = ["taskset", "-c", "1"]
    verifier, address = _start([*cloud_prefix, sys.executable, "-m", "cloud", "--port", "0", "--http-port", "0",
                                "--dtype", args.dtype, *cloud_flags], out / "verifier.log", r"serving .* on (\S+:\d+)")
    rows: list[dict[str, Any]] = []
    # Warm the verifier (first-touch of the weights, allocator) so the first variant is not
    # charged for it.
    _run_edge(["--cloud", address, "--dtype", args.dtype, "--prompt", "Hi", "--max-new-tokens", "4",
               "--mode", "cloud_only"], out / "warmup.log")
    try:
        for rtt in [float(x) for x in args.rtt_ms.split(",")]:
            proxy, target = None, address
            if rtt > 0:
                proxy, target = _start([sys.executable, "-m", "shared.netproxy", "--target", address,
                                        "--rtt-ms", str(rtt)], out / f"proxy{rtt:g}.log", r"listening on (\S+:\d+)")
            reference: dict[str, list[int]] = {}
            for spec in args.variant:
                name, flags = spec.split("=", 1)
                result_file = out / f"{name}.rtt{rtt:g}.jsonl"
                pin_flags = ["--threads", "1"] if args.pin else []
                rss = _run_edge(["--cloud", target, "--dtype", args.dtype, "--prompts", args.prompts, *pin_flags,
                                 "--max-new-tokens", args.max_new_tokens, "--output", str(result_file),
                                 *shlex.split(flags)], out / f"{name}.rtt{rtt:g}.log")
                records = [json.loads(line) for line in result_file.read_text().splitlines()]
                if name == "cloud_only":
                    reference = {r["id"]: r["token_ids"] for r in records}
                row = {"variant": name, "rtt_ms": rtt, **summarize(records), "edge_peak_rss_mb": rss // 1024,
                       "cloud_calls_per_token": round(sum(r["rounds"] for r in records)
                                                      / max(sum(len(r["token_ids"]) for r in records), 1), 3),
                       "local_tokens": sum(r.get("local_tokens", 0) for r in records),
                       "hard_tokens": sum(r.get("hard_tokens", 0) for r in records),
                       "ahead_drafted": sum(r.get("ahead_drafted", 0) for r in records),
                       "ahead_used": sum(r.get("ahead_used", 0) for r in records)}
                if reference and name != "cloud_only":
                    row["identical"] = sum(reference.get(r["id"]) == r["token_ids"] for r in records)
                    row["agreement"] = _agreement(records, reference)
                rows.append(row)
                sys.stderr.write(json.dumps(row) + "\n")
            if proxy is not None:
                proxy.terminate()
    finally:
        verifier.terminate()
    result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "settings": vars(args)
              | {"output": str(out)}, "rows": rows}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    columns = ["variant", "rtt_ms", "tokens_per_s", "decode_tokens_per_s", "tau", "acceptance_rate", "target_passes_per_token",
               "cloud_calls_per_token", "verify_bytes_up_per_drafted_token", "identical", "agreement",
               "local_tokens", "hard_tokens", "ahead_drafted", "ahead_used", "edge_peak_rss_mb"]
    table = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    table += "".join("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |\n" for r in rows)
    (out / "table.md").write_text(table)
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
