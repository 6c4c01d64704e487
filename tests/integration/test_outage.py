"""The real console programs through an outage: a cloud-verifier process SIGKILLed in the middle of
an `edge-agent --prompts` run and started again 20 s later on the same port; and a batch in
which the verifier refuses one prompt."""

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.ops import metric_samples
from tests.serve_procs import edge_command, verifier_command
from tests.tiny_models import save_pair

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
OUTAGE_S = 20.0  # a restart and a model load: ten times the edge's longest wait between reconnects (2 s)
PROMPTS_FAILED = 3  # edge-agent's exit status when some prompts of a --prompts run failed


class VerifierProcess:
    """`cloud-verifier` in its own process; a thread reads its log (so a full pipe never blocks
    it) and notes the ports it serves on."""

    def __init__(self, model: Path, port: int = 0, *flags: str) -> None:
        cmd = verifier_command(model, *flags, port=port)
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=ENV)
        self.log: list[str] = []
        self.grpc_port = self.http_port = 0
        self.serving = threading.Event()
        threading.Thread(target=self._read_log, daemon=True).start()
        assert self.serving.wait(120), "cloud-verifier did not start:\n" + "".join(self.log)

    def _read_log(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            if match := re.search(r"http on \S+:(\d+)", line):
                self.http_port = int(match.group(1))
            if match := re.search(r"serving .* on \S+:(\d+)", line):
                self.grpc_port = int(match.group(1))
                self.serving.set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def rounds(self) -> float:
        return self._metric("specdec_rounds_total")

    def steps(self) -> float:
        """Verify rounds and Decode tokens served so far (0 while it cannot answer)."""
        try:
            return self._metric("specdec_rounds_total") + self._metric("specdec_decode_tokens_total")
        except OSError:
            return 0.0

    def evictions(self) -> dict[str, float]:
        """specdec_evicted_sessions_total by reason, as this process counted them."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=10) as reply:
            samples = metric_samples(reply.read().decode())
        return {dict(labels)["reason"]: n for (name, labels), n in samples.items() if name == "specdec_evicted_sessions_total"}

    def _metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=10) as reply:
            return metric_samples(reply.read().decode()).get((name, frozenset()), 0.0)

    def close(self) -> None:
        self.stop()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@contextmanager
def verifier_process(model: Path, port: int = 0, *flags: str) -> Iterator[VerifierProcess]:
    verifier = VerifierProcess(model, port, *flags)
    try:
        yield verifier
    finally:
        verifier.stop()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_pair(tmp_path_factory.mktemp("models"))


def _edge_cmd(draft: Path, address: str, prompts: Path, output: Path, *args: str) -> list[str]:
    flags = ["--draft-threads", "1", "--draft-model", str(draft), "--cloud", address]
    return edge_command(*flags, "--prompts", str(prompts), "--output", str(output), "--no-chat", *args)


def _write_prompts(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": text}) + "\n" for i, text in enumerate(texts)))
    return path


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _wait_for(condition, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_batch_rides_out_a_verifier_killed_and_restarted_20_s_later(models: tuple[Path, Path], tmp_path: Path) -> None:
    """SIGKILL the verifier once the first prompt is a few dozen rounds in (its /metrics says
    so), keep it down OUTAGE_S, start it again on the same port: every prompt finishes with
    exactly cloud_only's tokens, and the run exits 0."""
    draft, target = models
    # 300 tokens is about 170 rounds per prompt: the kill at round 30 lands inside the first one.
    prompts = _write_prompts(tmp_path / "prompts.jsonl", ["w2 w15 w28 w41 w54", "w9 w22 w35 w48 w61", "w16 w29 w42 w55 w68"])
    spec_out, cloud_out = tmp_path / "speculative.jsonl", tmp_path / "cloud_only.jsonl"
    edge_log = (tmp_path / "edge.log").open("w")
    with verifier_process(target) as first:
        port = first.grpc_port
        edge = subprocess.Popen(
            # speculative: every token comes from a round, so round 30 is inside the first prompt
            _edge_cmd(draft, first.address, prompts, spec_out, "--mode", "speculative", "--max-new-tokens", "300"),
            stdout=edge_log,
            stderr=subprocess.STDOUT,
            env=ENV,
        )
        try:
            _wait_for(lambda: first.rounds() >= 30, 120, "30 rounds")
            first.kill()
            assert edge.poll() is None and not spec_out.read_text(), "the kill missed the first prompt"
            time.sleep(OUTAGE_S)
            assert edge.poll() is None, "the edge gave up during the outage"
            with verifier_process(target, port) as second:
                assert edge.wait(timeout=120) == 0, (tmp_path / "edge.log").read_text()
                done = subprocess.run(
                    _edge_cmd(draft, second.address, prompts, cloud_out, "--mode", "cloud_only", "--max-new-tokens", "300"),
                    capture_output=True,
                    text=True,
                    env=ENV,
                    timeout=120,
                )
                assert done.returncode == 0, done.stderr
        finally:
            if edge.poll() is None:
                edge.kill()
            edge_log.close()
    spec, cloud = _records(spec_out), _records(cloud_out)
    assert [r["id"] for r in spec] == [r["id"] for r in cloud] == ["p0", "p1", "p2"]
    for s, c in zip(spec, cloud, strict=True):
        assert "error" not in s and s["finish_reason"] == c["finish_reason"] == "length"
        assert s["token_ids"] == c["token_ids"] and s["text"] == c["text"] and len(s["token_ids"]) == 300
    cut = spec[0]
    assert cut["reopens"] >= 1 and spec[1]["reopens"] == spec[2]["reopens"] == 0
    assert cut["provisional_tokens"] >= 1  # the draft was shown while the verifier was away
    assert cut["retracted_tokens"] <= cut["provisional_tokens"]


def test_a_prompt_the_verifier_refuses_fails_alone(models: tuple[Path, Path], tmp_path: Path) -> None:
    """The middle prompt is longer than the verifier's context limit (INVALID_ARGUMENT, no outage:
    no reconnecting): its line carries the error, the others are answered, the exit status says
    some prompts failed. Speculative and cloud_only alike."""
    draft, target = models
    long_prompt = " ".join(f"w{i % 90 + 2}" for i in range(40))
    prompts = _write_prompts(tmp_path / "prompts.jsonl", ["w5 w9 w13", long_prompt, "w7 w11 w3"])
    records = {}
    with verifier_process(target, 0, "--max-context-tokens", "30") as verifier:
        for mode in ("speculative", "cloud_only"):
            out = tmp_path / f"{mode}.jsonl"
            start = time.monotonic()
            done = subprocess.run(
                _edge_cmd(draft, verifier.address, prompts, out, "--mode", mode, "--max-new-tokens", "20"),
                capture_output=True,
                text=True,
                env=ENV,
                timeout=120,
            )
            assert done.returncode == PROMPTS_FAILED, done.stderr
            assert time.monotonic() - start < 60  # not retried for the reconnect window
            assert "Traceback" not in done.stderr
            assert re.search(r"2/3 p1 failed: INVALID_ARGUMENT: .*limit 30", done.stderr)
            assert "1 of 3 prompts failed" in done.stderr.splitlines()[-1]
            records[mode] = _records(out)
    for mode, lines in records.items():
        assert [r["id"] for r in lines] == ["p0", "p1", "p2"], mode
        failed = lines[1]
        assert failed["finish_reason"] == "error" and "limit 30" in failed["error"] and "\n" not in failed["error"]
        assert failed["token_ids"] == [] and failed["text"] == ""
        for answered in (lines[0], lines[2]):
            assert "error" not in answered and len(answered["token_ids"]) == 20
    for i in (0, 2):
        assert records["speculative"][i]["token_ids"] == records["cloud_only"][i]["token_ids"]


CRASHES = 5


def _crash_repeatedly(first: VerifierProcess, target: Path, busy: Any) -> VerifierProcess:
    """SIGKILL the verifier CRASHES times while `busy()` says its clients still work, each time
    once it has served a few steps, and start it again on the same port within a second."""
    current, port = first, first.grpc_port
    for crash in range(CRASHES):
        served, up = current.steps(), current
        _wait_for(lambda up=up, served=served: up.steps() >= served + 8 or not busy(), 120, f"work before crash {crash + 1}")
        assert busy(), f"the clients finished before crash {crash + 1}: make them longer"
        current.kill()
        time.sleep(0.5)
        current = VerifierProcess(target, port)
    return current


def test_several_edges_ride_out_five_crashes(models: tuple[Path, Path], tmp_path: Path) -> None:
    """Three edge-agent batches at once against a verifier SIGKILLed five times and restarted on
    the same port each time: every prompt finishes, each output equals cloud_only's token for
    token (none repeated or lost), every crash costs a reopen, and the last verifier evicted no
    session (by TTL or any cap): lost sessions come back by reopening."""
    draft, target = models
    prompts = _write_prompts(tmp_path / "prompts.jsonl", [f"w{i} w{i + 13} w{i + 26} w{i + 39}" for i in range(3)])
    outputs = [tmp_path / f"edge{i}.jsonl" for i in range(3)]
    flags = ("--max-new-tokens", "400", "--reconnect-window-s", "120")
    with verifier_process(target) as first:
        edges = [
            subprocess.Popen(_edge_cmd(draft, first.address, prompts, out, *flags), stderr=subprocess.PIPE, text=True, env=ENV)
            for out in outputs
        ]
        try:
            last = _crash_repeatedly(first, target, lambda: all(e.poll() is None for e in edges))
            with contextlib.closing(last):
                for edge in edges:
                    assert edge.wait(timeout=300) == 0, edge.stderr.read() if edge.stderr else ""
                reference = tmp_path / "cloud_only.jsonl"
                done = subprocess.run(
                    _edge_cmd(draft, last.address, prompts, reference, "--mode", "cloud_only", *flags),
                    capture_output=True,
                    text=True,
                    env=ENV,
                    timeout=300,
                )
                assert done.returncode == 0, done.stderr
                evicted = last.evictions()
        finally:
            for edge in edges:
                if edge.poll() is None:
                    edge.kill()
    # A crash loses sessions; the edges reopen them. No cap or TTL evicted one on the way.
    assert set(evicted) == {"ttl", "session_cap", "kv_cap", "key_kv_cap"} and sum(evicted.values()) == 0, evicted
    cloud = _records(reference)
    reopens = 0
    for out in outputs:
        records = _records(out)
        assert [r["id"] for r in records] == [r["id"] for r in cloud]
        for got, want in zip(records, cloud, strict=True):
            assert "error" not in got and got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
        reopens += sum(r["reopens"] for r in records)
    assert reopens >= CRASHES  # every crash cost at least one session a reopen


def test_an_openai_stream_rides_out_five_crashes(models: tuple[Path, Path], tmp_path: Path) -> None:
    """The same through `edge-agent serve`: an OpenAI client's streamed text, across five
    verifier crashes, equals the target's alone (the request pinned to cloud_only afterwards)."""
    from openai import OpenAI

    from tests.serve_procs import serve_cmd, start

    draft, target = models
    with verifier_process(target) as first:
        serve = start(
            serve_cmd(draft, first.address, "--reconnect-window-s", "120"), tmp_path / "serve.log", r"serving on (http://\S+:\d+)"
        )
        client = OpenAI(base_url=f"{serve.match.group(1)}/v1", api_key="unused", max_retries=0, timeout=300)
        request = {"model": "any", "prompt": "w3 w16 w29", "max_tokens": 1200, "temperature": 0}
        streamed: list[str] = []
        reader = threading.Thread(
            target=lambda: streamed.extend(
                c.choices[0].text for c in client.completions.create(**request, stream=True) if c.choices
            )
        )
        reader.start()
        try:
            last = _crash_repeatedly(first, target, reader.is_alive)
            reader.join(timeout=300)
            with contextlib.closing(last):
                alone = client.completions.create(**request, extra_body={"speculative": {"enabled": False}})
        finally:
            serve.stop()
    assert not reader.is_alive() and "".join(streamed) == alone.choices[0].text and alone.choices[0].text
