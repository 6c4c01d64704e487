"""Gating and a slow, stalled or restarted verifier, through a real server and the fault
proxy (delays are injected on the link; the product never sleeps to fake them)."""

import asyncio
import threading

import pytest
from grpc import aio

from cloud.grpc_server import create_server
from cloud.verifier import Verifier
from edge.drafting.gating import EscalationRules, GatingThresholds
from edge.drafting.kpolicy import FixedK
from edge.round.generate import Gating, GenerationResult, RoundRecord, TimeoutPolicy, cloud_only_generate, speculative_generate
from edge.transport.client import VerifierClient
from shared.errors import InvalidRequest
from tests.harness import TargetEngine, gen_config, make_drafter, random_prompt, running_verifier
from tests.ops import running_servers
from tools.netproxy import FaultProxy, LinkConditions

PROMPTS = [random_prompt(seed, length=6) for seed in range(6)]


class Recorder:
    """An observer that keeps what the user would have seen."""

    def __init__(self) -> None:
        self.final: list[int] = []
        self.provisional_shown: list[list[int]] = []
        self.rounds = 0

    def committed(self, tokens: list[int], record: RoundRecord | None) -> None:
        self.final += tokens
        self.rounds += record is not None

    def provisional(self, tokens: list[int]) -> None:
        self.provisional_shown.append(list(tokens))


async def _reference(client: VerifierClient, prompt: list[int], n: int) -> list[int]:
    return (await cloud_only_generate(prompt, client, gen_config(max_new_tokens=n))).token_ids


def test_lossless_gating_equals_target_and_marks_hard_tokens(target_engine: TargetEngine, draft_model) -> None:
    gating = Gating(GatingThresholds(entropy_bits=1.0, margin=0.3, nll=1.0), EscalationRules(), token_text=lambda t: f" w{t}")

    async def run() -> None:
        async with running_verifier(target_engine) as (client, _):
            hard = 0
            for prompt in PROMPTS:
                reference = await _reference(client, prompt, 30)
                result = await speculative_generate(
                    prompt,
                    make_drafter(draft_model, signals=True),
                    client,
                    FixedK(8),
                    gen_config(max_new_tokens=30, gating=gating),
                )
                assert result.token_ids == reference
                hard += result.hard_tokens
                # A hard token ends a block: no block goes on past its first hard token.
                for record in result.round_log:
                    assert record.k <= 8
            assert hard > 0

    asyncio.run(run())


def test_local_commit_is_lossy_and_counted(target_engine: TargetEngine, draft_model) -> None:
    gating = Gating(GatingThresholds(entropy_bits=9.0, margin=0.0, nll=9.0, hard_ratio=0.3), local_commit=True)

    async def run() -> None:
        async with running_verifier(target_engine) as (client, _):
            result = await speculative_generate(
                PROMPTS[0],
                make_drafter(draft_model, signals=True),
                client,
                FixedK(4),
                gen_config(max_new_tokens=30, gating=gating),
            )
            reference = await _reference(client, PROMPTS[0], 30)
        # Every block is easy under these thresholds: all tokens but the last are local; the one
        # cloud round carries them as catch-up and returns the target's next token after them.
        assert result.local_tokens == 29 and len(result.token_ids) == 30
        assert result.rounds == 1 and result.round_log[-1].catchup == 29
        assert all(r.local for r in result.round_log[:-1])
        async with running_verifier(target_engine) as (client, _):
            after_prefix = await _reference(client, PROMPTS[0] + result.token_ids[:29], 1)
        assert result.token_ids[29] == after_prefix[0]
        assert len(reference) == 30  # the lossless output exists to compare agreement against

    asyncio.run(run())


async def _through_proxy(
    target_engine: TargetEngine, draft_model, rtt_ms: float, timeouts: TimeoutPolicy, prompt: list[int], n: int = 24
) -> tuple[GenerationResult, Recorder, list[int]]:
    async with running_verifier(target_engine) as (direct, _):
        reference = await _reference(direct, prompt, n)
        proxy = FaultProxy("127.0.0.1", int(direct.target.rsplit(":", 1)[1]), LinkConditions(rtt_ms=rtt_ms))
        await proxy.start()
        client = VerifierClient(proxy.address, verify_timeout_s=10)
        recorder = Recorder()
        try:
            return (
                await speculative_generate(
                    prompt,
                    make_drafter(draft_model),
                    client,
                    FixedK(4),
                    gen_config(max_new_tokens=n, timeouts=timeouts),
                    recorder,
                ),
                recorder,
                reference,
            )
        finally:
            await client.close()
            await proxy.close()


def test_slow_verifier_shows_provisional_text_and_final_text_is_lossless(target_engine: TargetEngine, draft_model) -> None:
    timeouts = TimeoutPolicy(soft_deadline_s=0.05)

    async def run() -> None:
        retracted = provisional = 0
        for prompt in PROMPTS[:3]:
            result, recorder, reference = await _through_proxy(target_engine, draft_model, 400.0, timeouts, prompt)
            assert result.token_ids == reference == recorder.final
            assert recorder.provisional_shown  # the user saw provisional text while waiting
            # The round log says what the output line says: each round names the tokens it found
            # on screen, and what it took back of them.
            assert sum(r.provisional for r in result.round_log) >= result.provisional_tokens > 0
            assert sum(r.retracted for r in result.round_log) == result.retracted_tokens
            provisional += result.provisional_tokens
            retracted += result.retracted_tokens
        assert provisional > 0 and retracted <= provisional

    asyncio.run(run())


def test_accept_unverified_counts_unverified_tokens(target_engine: TargetEngine, draft_model) -> None:
    timeouts = TimeoutPolicy(soft_deadline_s=0.05, mode="accept-unverified", backoff_s=0.01)

    async def run() -> None:
        result, recorder, _ = await _through_proxy(target_engine, draft_model, 400.0, timeouts, PROMPTS[1])
        assert result.unverified_tokens > 0
        assert recorder.final == result.token_ids and len(result.token_ids) == 24

    asyncio.run(run())


def test_strict_mode_never_shows_unverified_text(target_engine: TargetEngine, draft_model) -> None:
    async def run() -> None:
        result, recorder, reference = await _through_proxy(
            target_engine, draft_model, 300.0, TimeoutPolicy(mode="strict"), PROMPTS[2], n=12
        )
        assert result.token_ids == reference and not recorder.provisional_shown
        assert result.provisional_tokens == result.unverified_tokens == 0

    asyncio.run(run())


class Restartable:
    """A verifier behind the fault proxy that can be stopped and, `down_s` later, replaced by a
    new one at the same address (a new server behind the proxy)."""

    def __init__(self, target: TargetEngine) -> None:
        self.target = target
        self.servers: list[aio.Server] = []
        self.proxy: FaultProxy | None = None
        self.restarted = asyncio.Event()

    async def start(self) -> VerifierClient:
        port = await self._new_server()
        self.proxy = FaultProxy("127.0.0.1", port)
        await self.proxy.start()
        return VerifierClient(self.proxy.address, verify_timeout_s=5)

    async def _new_server(self) -> int:
        server, port = create_server(Verifier(self.target(), "tiny"), "127.0.0.1:0")
        await server.start()
        self.servers.append(server)
        return port

    def restart_soon(self, down_s: float) -> None:
        """Called from an observer: restart in a task, once."""
        if not self.restarted.is_set():
            self.restarted.set()
            asyncio.get_running_loop().create_task(self._restart(down_s))

    async def _restart(self, down_s: float) -> None:
        assert self.proxy is not None
        await self.servers[-1].stop(None)
        self.proxy.drop_connections()
        await asyncio.sleep(down_s)
        self.proxy.target = ("127.0.0.1", await self._new_server())

    async def close(self) -> None:
        if self.proxy is not None:
            await self.proxy.close()
        for server in self.servers:
            await server.stop(None)


class RestartAfter(Recorder):
    """Restarts the verifier (down for `down_s`) once `rounds` rounds or chunks are final."""

    def __init__(self, verifier: Restartable, rounds: int, down_s: float) -> None:
        super().__init__()
        self.verifier, self.after, self.down_s = verifier, rounds, down_s
        self.chunks = 0

    def committed(self, tokens: list[int], record: RoundRecord | None) -> None:
        super().committed(tokens, record)
        self.chunks += 1
        if self.rounds >= self.after or self.chunks >= self.after:
            self.verifier.restart_soon(self.down_s)


def test_verifier_restarted_mid_generation(target_engine: TargetEngine, draft_lm) -> None:
    """Kill the verifier after a few rounds, start a new one behind the same proxy address:
    the edge reopens a session with its committed prefix and ends with target-only output."""

    async def run() -> None:
        verifier = Restartable(target_engine)
        client = await verifier.start()
        try:
            recorder = RestartAfter(verifier, rounds=3, down_s=0.0)
            cfg = gen_config(max_new_tokens=40, timeouts=TimeoutPolicy(soft_deadline_s=5.0, backoff_s=0.05))
            result = await speculative_generate(PROMPTS[4], make_drafter(draft_lm), client, FixedK(3), cfg, recorder)
            reference = await _reference(client, PROMPTS[4], 40)
            assert verifier.restarted.is_set() and result.reopens >= 1
            assert result.token_ids == reference == recorder.final
        finally:
            await client.close()
            await verifier.close()

    asyncio.run(run())


@pytest.mark.parametrize("mode", ["provisional", "strict"])
def test_the_edge_shows_its_draft_while_the_verifier_is_away(target_engine: TargetEngine, draft_model, mode) -> None:
    """Down for a second and a half (many waits of the backoff): provisional mode shows the
    pending block, at most one block, and the final text is still the target's; strict mode
    shows nothing."""

    async def run() -> None:
        verifier = Restartable(target_engine)
        client = await verifier.start()
        try:
            recorder = RestartAfter(verifier, rounds=3, down_s=1.5)
            timeouts = TimeoutPolicy(soft_deadline_s=5.0, mode=mode, backoff_s=0.05, max_backoff_s=0.2)
            result = await speculative_generate(
                PROMPTS[5],
                make_drafter(draft_model),
                client,
                FixedK(4),
                gen_config(max_new_tokens=40, timeouts=timeouts),
                recorder,
            )
            reference = await _reference(client, PROMPTS[5], 40)
        finally:
            await client.close()
            await verifier.close()
        assert result.token_ids == reference == recorder.final and result.reopens >= 1
        if mode == "strict":
            assert not recorder.provisional_shown and result.provisional_tokens == 0
            return
        assert recorder.provisional_shown and all(1 <= len(shown) <= 4 for shown in recorder.provisional_shown)
        assert 1 <= result.provisional_tokens <= 4  # one outage, one block shown
        assert result.retracted_tokens <= result.provisional_tokens

    asyncio.run(run())


def test_cloud_only_stream_resumes_where_it_was_cut(target_engine: TargetEngine) -> None:
    """The Generate stream dies after a few tokens and the verifier is back half a second later:
    the stream resumes on prompt + tokens so far; nothing is lost or repeated."""

    async def run() -> None:
        verifier = Restartable(target_engine)
        client = await verifier.start()
        try:
            recorder = RestartAfter(verifier, rounds=5, down_s=0.5)
            cfg = gen_config(max_new_tokens=60, timeouts=TimeoutPolicy(backoff_s=0.05))
            result = await cloud_only_generate(PROMPTS[3], client, cfg, recorder)
        finally:
            await client.close()
            await verifier.close()
        assert verifier.restarted.is_set() and result.reopens >= 1
        assert result.token_ids == recorder.final == target_engine.greedy_continuation(PROMPTS[3], 60)

    asyncio.run(run())


@pytest.mark.parametrize("mode", ["speculative", "cloud_only"])
def test_the_first_call_waits_for_a_verifier_still_loading(target_engine: TargetEngine, draft_model, mode) -> None:
    """The edge starts while the verifier is still loading its model (UNAVAILABLE): the first
    OpenSession (or Generate) is retried until it is served, and the text is the target's."""

    async def run() -> None:
        gate = threading.Event()
        async with running_servers(target_engine, gate) as (servers, _):
            client = VerifierClient(f"127.0.0.1:{servers.grpc_port}", verify_timeout_s=5)
            asyncio.get_running_loop().call_later(1.0, gate.set)
            recorder = Recorder()
            cfg = gen_config(max_new_tokens=30, timeouts=TimeoutPolicy(backoff_s=0.05, max_backoff_s=0.2))
            try:
                if mode == "cloud_only":
                    result = await cloud_only_generate(PROMPTS[2], client, cfg, recorder)
                else:
                    result = await speculative_generate(PROMPTS[2], make_drafter(draft_model), client, FixedK(4), cfg, recorder)
            finally:
                await client.close()
        assert gate.is_set() and result.reopens == 0
        assert result.token_ids == recorder.final == target_engine.greedy_continuation(PROMPTS[2], 30)
        if mode == "speculative":  # the draft was shown while the model loaded
            assert recorder.provisional_shown and result.provisional_tokens >= 1

    asyncio.run(run())


def test_a_refused_request_is_not_retried(target_engine: TargetEngine) -> None:
    """INVALID_ARGUMENT is no outage: it fails at once, even with a long reconnect window."""

    async def run() -> None:
        async with running_verifier(target_engine) as (client, _):
            cfg = gen_config(max_new_tokens=8, vocab=10_000, timeouts=TimeoutPolicy(reconnect_window_s=300))
            start = asyncio.get_running_loop().time()
            with pytest.raises(InvalidRequest):
                await cloud_only_generate(PROMPTS[0], client, cfg)
            assert asyncio.get_running_loop().time() - start < 5

    asyncio.run(run())
