"""The peer on a CPU box: llama.cpp's own server (`llama-server`) on the same prompts as a
`bench` run, alone and with its local draft model (`-md`), greedy. Each prompt goes in as the
same token ids edge-agent sends (the target's chat template, the edge's tokenizer), streamed from
`/completion` with no prompt cache, one prompt at a time: end-to-end tokens/s (all tokens over
all wall time, prefill included) and the time to the first token.

`llama-server` is built from the llama.cpp source that llama-cpp-python's sdist carries
(`vendor/llama.cpp`, `cmake --build build --target llama-server`); name the binary with --server.

    python -m bench.studies.llamacpp_server_peer --server PATH --target-gguf FILE --draft-gguf FILE \\
        --tokenizer FOLDER --prompts BENCH_OUTPUT_files/prompts.jsonl [--max-new-tokens 64] [--threads 2]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from bench.cli import study_settings
from bench.environment import machine_line, provenance
from bench.fleet_parts import free_port
from edge.prompts import encode_prompt, read_prompts
from edge.tokenizer import EdgeTokenizer
from shared.cli import run_cli


class PeerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECDEC_PEER_")

    server: Path = Field(description="the llama-server binary")
    target_gguf: Path = Field(description="the target's GGUF")
    draft_gguf: Path = Field(description="the draft's GGUF (for -md)")
    tokenizer: Path = Field(description="a folder holding the target's tokenizer and chat template")
    prompts: Path = Field(description="the prompt set of a bench run (edge-agent's JSONL)")
    max_new_tokens: int = Field(64, ge=1, description="tokens per prompt")
    threads: int = Field(2, ge=1, description="llama-server threads (-t, and -td with a draft)")
    server_flags: str = Field("", description="more llama-server flags for both runs, space-separated")
    out: Path = Field(Path("docs/llamacpp_peer"), description="folder for the JSON result and report.md")

    help_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "the peer": ("server", "target_gguf", "draft_gguf", "threads", "server_flags"),
        "the prompts": ("tokenizer", "prompts", "max_new_tokens"),
        "output": ("out",),
    }


def _start(args: PeerSettings, draft: bool, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [str(args.server), "-m", str(args.target_gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads)]
    cmd += ["-c", "8192", "-np", "1", "--no-webui", *args.server_flags.split()]
    if draft:
        cmd += ["-md", str(args.draft_gguf), "-td", str(args.threads), "--spec-type", "draft-simple"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"llama-server did not come up: {log}")


def _complete(url: str, tokens: list[int], max_new_tokens: int) -> dict[str, Any]:
    """One streamed greedy completion: its tokens, time to the first and wall time."""
    body = {"prompt": tokens, "n_predict": max_new_tokens, "temperature": 0, "top_k": 1, "stream": True}
    body |= {"cache_prompt": False, "return_tokens": True}
    request = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    start, first, out = time.perf_counter(), None, []
    with urllib.request.urlopen(request, timeout=600) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: ") :])
            out += event.get("tokens", [])
            if first is None and out:
                first = time.perf_counter() - start
            if event.get("stop"):
                break
    return {"tokens": out, "ttft_s": first or 0.0, "elapsed_s": time.perf_counter() - start}


def _run(args: PeerSettings, draft: bool, prompts: list[tuple[str, list[int]]]) -> dict[str, Any]:
    name = "llama-server -md" if draft else "llama-server"
    proc, url = _start(args, draft, args.out / f"{name.replace(' ', '_')}.log")
    try:
        _complete(url, prompts[0][1], 4)  # warm-up
        samples = [{"id": pid, **_complete(url, ids, args.max_new_tokens)} for pid, ids in prompts]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    tokens = sum(len(s["tokens"]) for s in samples)
    return {
        "system": name,
        "tok_s": round(tokens / sum(s["elapsed_s"] for s in samples), 3),
        "ttft_p50_s": round(statistics.median(s["ttft_s"] for s in samples), 3),
        "samples": samples,
    }


def _report(result: dict[str, Any]) -> str:
    lines = ["# llama-server on the bench prompts", "", machine_line(result["provenance"]["machine"]), ""]
    lines += ["| system | tok/s end to end | TTFT p50 |", "|---|---|---|"]
    lines += [f"| {r['system']} | {r['tok_s']:.2f} | {r['ttft_p50_s']:.2f} s |" for r in result["runs"]]
    return "\n".join(lines) + f"\n\n{result['prompts']} prompts, {result['max_new_tokens']} tokens each, greedy.\n"


def main(argv: list[str] | None = None) -> int:
    args, command = study_settings("bench.studies.llamacpp_server_peer", __doc__, PeerSettings, argv)

    def run() -> int:
        tokenizer = EdgeTokenizer(args.tokenizer)
        prompts = [(p.id, encode_prompt(tokenizer, p.text, True)) for p in read_prompts(args.prompts)]
        args.out.mkdir(parents=True, exist_ok=True)
        runs = [_run(args, draft, prompts) for draft in (False, True)]
        result = {"provenance": provenance(command), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens}
        result["runs"] = runs
        (args.out / "llamacpp_peer.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "report.md").write_text(_report(result))
        print(_report(result))  # noqa: T201
        return 0

    return run_cli("llamacpp_server_peer", run)


if __name__ == "__main__":
    sys.exit(main())
