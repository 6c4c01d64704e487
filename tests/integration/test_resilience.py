"""Gating and a slow, stalled or restarted verifier, through a real server and the fault
proxy (delays are injected on the link; the product never sleeps to fake them)."""

import asyncio

from cloud.grpc_server import create_server
from cloud.verifier import Verifier
from edge.client import VerifierClient
from edge.gating import EscalationRules, GatingThresholds
from edge.generate import Gating, GenerationResult, RoundRecord, TimeoutPolicy, cloud_only_generate, speculative_generate
from edge.kpolicy import FixedK
from shared.netproxy import FaultProxy, LinkConditions
from tests.harness import gen_config, make_drafter, random_prompt, running_verifier

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


def test_lossless_gating_equals_target_and_marks_hard_tokens(target_model, draft_model) -> None:
    gating = Gating(GatingThresholds(entropy_bits=1.0, margin=0.3, nll=1.0),
                    EscalationRules(), token_text=lambda t: f" w{t}")
    async def run() -> None:
        async with running_verifier(target_model) as (client, _):
            hard = 0
            for prompt in PROMPTS:
                reference = await _reference(client, prompt, 30)
                result = await speculative_generate(prompt, make_drafter(draft_model, signals=True), client,
                                                    FixedK(8), gen_config(max_new_tokens=30, gating=gating))
                assert result.token_ids == reference
                hard += result.hard_tokens
                # A hard token ends a block: no block goes on past its first hard token.
                for record in result.round_log:
                    assert record.k <= 8
            assert hard > 0

    asyncio.run(run())


def test_local_commit_is_lossy_and_counted(target_model, draft_model) -> None:
    gating = Gating(GatingThresholds(entropy_bits=9.0, margin=0.0, nll=9.0, hard_ratio=0.3), local_commit=True)
    async def run() -> None:
        async with running_verifier(target_model) as (client, _):
            result = await speculative_generate(PROMPTS[0], make_drafter(draft_model, signals=True), client,
                                                FixedK(4), gen_config(max_new_tokens=30, gating=gating))
            reference = await _reference(client, PROMPTS[0], 30)
        # Every block is easy under these thresholds: all tokens but the last are local; the one
        # cloud round carries them as catch-up and returns the target's next token after them.
        assert result.local_tokens == 29 and len(result.token_ids) == 30
        assert result.rounds == 1 and result.round_log[-1].catchup == 29
        assert all(r.local for r in result.round_log[:-1])
        async with running_verifier(target_model) as (client, _):
            after_prefix = await _reference(client, PROMPTS[0] + result.token_ids[:29], 1)
        assert result.token_ids[29] == after_prefix[0]
        assert len(reference) == 30  # the lossless output exists to compare agreement against

    asyncio.run(run())


async def _through_proxy(target_model, draft_model, rtt_ms: float, timeouts: TimeoutPolicy, prompt: list[int],
                         n: int = 24) -> tuple[GenerationResult, Recorder, list[int]]:
    async with running_verifier(target_model) as (direct, _):
        reference = await _reference(direct, prompt, n)
        proxy = FaultProxy("127.0.0.1", int(direct.target.rsplit(":", 1)[1]), LinkConditions(rtt_ms=rtt_ms))
        await proxy.start()
        client = VerifierClient(proxy.address, verify_timeout_s=10)
        recorder = Recorder()
        try:
            return (await speculative_generate(prompt, make_drafter(draft_model), client, FixedK(4),
                                               gen_config(max_new_tokens=n, timeouts=timeouts), recorder),
                    recorder, reference)
        finally:
            await client.close()
            await proxy.close()


def test_slow_verifier_shows_provisional_text_and_final_text_is_lossless(target_model, draft_model) -> None:
    timeouts = TimeoutPolicy(soft_deadline_s=0.05)
    async def run() -> None:
        retracted = provisional = 0
        for prompt in PROMPTS[:3]:
            result, recorder, reference = await _through_proxy(target_model, draft_model, 400.0, timeouts, prompt)
            assert result.token_ids == reference == recorder.final
            assert recorder.provisional_shown  # the user saw provisional text while waiting
            provisional += result.provisional_tokens
            retracted += result.retracted_tokens
        assert provisional > 0 and retracted <= provisional

    asyncio.run(run())


def test_accept_unverified_counts_unverified_tokens(target_model, draft_model) -> None:
    timeouts = TimeoutPolicy(soft_deadline_s=0.05, mode="accept-unverified", backoff_s=0.01)
    async def run() -> None:
        result, recorder, _ = await _through_proxy(target_model, draft_model, 400.0, timeouts, PROMPTS[1])
        assert result.unverified_tokens > 0
        assert recorder.final == result.token_ids and len(result.token_ids) == 24

    asyncio.run(run())


def test_strict_mode_never_shows_unverified_text(target_model, draft_model) -> None:
    async def run() -> None:
        result, recorder, reference = await _through_proxy(target_model, draft_model, 300.0, TimeoutPolicy(mode="strict"),
                                                           PROMPTS[2], n=12)
        assert result.token_ids == reference and not recorder.provisional_shown
        assert result.provisional_tokens == result.unverified_tokens == 0

    asyncio.run(run())


def test_verifier_restarted_mid_generation(target_model, draft_lm) -> None:
    """Kill the verifier after a few rounds, start a new one behind the same proxy address:
    the edge reopens a session with its committed prefix and ends with target-only output."""
    async def run() -> None:
        first_server, first_port = create_server(Verifier(target_model, "tiny"), "127.0.0.1:0")
        await first_server.start()
        proxy = FaultProxy("127.0.0.1", first_port)
        await proxy.start()
        client = VerifierClient(proxy.address, verify_timeout_s=5)
        servers = [first_server]
        restarted = asyncio.Event()

        class RestartAfterThreeRounds(Recorder):
            def committed(self, tokens: list[int], record: RoundRecord | None) -> None:
                super().committed(tokens, record)
                if self.rounds == 3 and not restarted.is_set():
                    restarted.set()
                    asyncio.get_running_loop().create_task(restart())

        async def restart() -> None:
            await servers[0].stop(None)
            proxy.drop_connections()
            server, port = create_server(Verifier(target_model, "tiny"), "127.0.0.1:0")
            await server.start()
            servers.append(server)
            proxy.target = ("127.0.0.1", port)

        try:
            recorder = RestartAfterThreeRounds()
            cfg = gen_config(max_new_tokens=40, timeouts=TimeoutPolicy(soft_deadline_s=5.0, backoff_s=0.05))
            result = await speculative_generate(PROMPTS[4], make_drafter(draft_lm), client, FixedK(3), cfg,
                                                recorder)
            reference = await _reference(client, PROMPTS[4], 40)
            assert restarted.is_set() and result.reopens >= 1
            assert result.token_ids == reference == recorder.final
        finally:
            await client.close()
            await proxy.close()
            for server in servers:
                await server.stop(None)

    asyncio.run(run())
