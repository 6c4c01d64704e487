"""`python -m bench`: every system over the same prompts, sampling settings and seeds, side by side in
one run, at each added RTT; one JSON result (checked against bench/result.schema.json) and,
with --report, a Markdown report with plots.

Systems: target-only (transformers generate, the reference), hf-assisted (generate with
assistant_model: the peer), edge_only, cloud_only, speculative (the edge's default drafter:
llama.cpp on the draft GGUF), and the named rows speculative-transformers (the same draft
model in transformers), ngram, ngram8, hybrid (n-gram drafting) and overlap (drafting while
Verify is in flight); more with --variant NAME="edge-agent flags".

    python -m bench --systems target-only,hf-assisted,cloud_only,speculative --per-task 3 --rtt-ms 0,50 \\
          --max-new-tokens 64 --output results/bench.json --report results/bench
    python -m bench --quick --output /tmp/quick.json --report /tmp/quick      # tiny random models, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from bench.cli import settings_parser
from bench.config import BenchFlags
from bench.report import write_report
from bench.resolve import prompts_of, settings_from
from bench.result import build, validate
from bench.runner import BenchRunner
from bench.tasks import write_prompts
from shared.cli import run_cli, settings_from_args
from shared.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def _parser() -> argparse.ArgumentParser:
    return settings_parser("python -m bench", __doc__, BenchFlags)


def run(args: BenchFlags) -> int:
    if args.temperature < 0 or args.bandwidth_kbps < 0:
        raise ConfigError("--temperature and --bandwidth-kbps must not be negative")
    prompts = prompts_of(args)
    settings = settings_from(args)
    settings.output.parent.mkdir(parents=True, exist_ok=True)
    with tqdm(total=0, unit="prompt", file=sys.stderr, dynamic_ncols=True) as bar:
        runner = BenchRunner(settings, prompts, bar)
        bar.total = runner.total_prompt_runs()
        bar.refresh()
        runs = runner.run_all(bar.set_description)
    result = build(settings, runs, [p.id for p in prompts], runner.runner_meta, runner.kv_bytes_per_token, REPO)
    validate(result)
    settings.output.write_text(json.dumps(result, indent=1) + "\n")
    sys.stderr.write(f"bench: result {settings.output}\n")
    if settings.report is not None:
        sys.stderr.write(f"bench: report {write_report(result, settings.report)}\n")
    write_prompts(prompts, settings.files / "prompts.jsonl")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_cli("bench", lambda: run(settings_from_args(BenchFlags, args)))


if __name__ == "__main__":
    sys.exit(main())
