"""Kept prefixes never cross a trust boundary, through the real gRPC server and its auth, by
every way a session opens (OpenSession, Generate, a Decode call that opens it), on every engine:
an open reports the prompt tokens its scope's kept KV served (`reused_tokens`; on vLLM, vLLM's
own count of its prefix-cache hits), and another key's or client's open over the very same
prompt computes every token. One key's flood of new prompts leaves another key's kept
conversation in place, and a refused open keeps its key's prefix."""

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from cloud.batcher import ForwardCost
from cloud.grpc_server import create_server
from cloud.quotas import KeyLimits, TokenRate
from cloud.sessions import SessionLimits
from cloud.state import ServerState
from cloud.verifier import Verifier, VerifierLimits
from edge.transport.client import VerifierClient
from shared.api_keys import ApiKeys
from shared.errors import CapacityExceeded
from shared.protocol import DecodeRequest, GenerateRequest, OpenSessionRequest, SessionConfig
from tests.harness import TargetEngine, engine_of, random_prompt
from tests.ops import SETTINGS, running_servers

CONFIG = SessionConfig(vocab_size=96)
PROMPT_TOKENS = 48  # three of vLLM's 16-token blocks: a prompt its prefix cache can serve
KEYS = "alice alice-key-Qw3Er5Ty7\nbob bob-key-Zx8Cv6Bn4\n"
Opener = Callable[[VerifierClient, list[int]], Awaitable[int]]


async def _open_session(client: VerifierClient, prompt: list[int]) -> int:
    opened = await client.open_session(OpenSessionRequest(prompt, CONFIG))
    await client.close_session(opened.session_id)
    return opened.reused_tokens


async def _generate(client: VerifierClient, prompt: list[int]) -> int:
    chunks = [chunk async for chunk in client.generate(GenerateRequest(prompt, CONFIG, max_new_tokens=2))]
    return chunks[0].reused_tokens


async def _decode(client: VerifierClient, prompt: list[int]) -> int:
    reused, session = 0, ""
    async for chunk in client.decode(DecodeRequest("", 0, 2, open=OpenSessionRequest(prompt, CONFIG))):
        if chunk.opened is not None:
            reused, session = chunk.opened.reused_tokens, chunk.opened.session_id
    await client.close_session(session)
    return reused


OPENERS: dict[str, Opener] = {"open_session": _open_session, "generate": _generate, "decode": _decode}


@asynccontextmanager
async def _served(
    target: TargetEngine, limits: VerifierLimits | None = None, keys: str | None = KEYS
) -> AsyncIterator[tuple[Verifier, Callable[[str | None], VerifierClient], ServerState]]:
    """A verifier behind the real gRPC server (with API keys when `keys`), and a maker of
    clients, each with its own channel (and, without keys, its own reuse token)."""
    verifier = Verifier(engine_of(target), "tiny-target", limits)
    state = ServerState(verifier.limits.max_draft_tokens, verifier, api_keys=ApiKeys.parse(keys) if keys else None)
    server, port = create_server(state, "127.0.0.1:0")
    await server.start()
    clients: list[VerifierClient] = []

    def client(key: str | None = None) -> VerifierClient:
        clients.append(VerifierClient(f"127.0.0.1:{port}", api_key=key))
        return clients[-1]

    try:
        yield verifier, client, state
    finally:
        for made in clients:
            await made.close()
        await server.stop(None)


def _turn(history: list[int], seed: int) -> list[int]:
    return history + random_prompt(500 + seed, length=6)


@pytest.mark.parametrize("path", OPENERS)
def test_two_keys_never_reuse_each_others_prefixes(target_engine: TargetEngine, path: str) -> None:
    asyncio.run(_two_keys_never_reuse_each_others_prefixes(target_engine, path))


async def _two_keys_never_reuse_each_others_prefixes(target_engine: TargetEngine, path: str) -> None:
    opener = OPENERS[path]
    async with _served(target_engine) as (verifier, client, _):
        alice, bob = client("alice-key-Qw3Er5Ty7"), client("bob-key-Zx8Cv6Bn4")
        prompt = random_prompt(31 + list(OPENERS).index(path), length=PROMPT_TOKENS)  # vLLM's cache outlives a test
        assert await opener(alice, prompt) == 0
        assert await opener(bob, _turn(prompt, 1)) == 0  # alice's exact prompt and more: every token computed
        assert await opener(alice, _turn(prompt, 2)) >= 32  # her own: reused (vLLM: whole blocks)
        assert await opener(client("alice-key-Qw3Er5Ty7"), _turn(prompt, 3)) == 0  # another client of her key
        reused_by = verifier.sessions.prefixes.totals_by_owner
        assert reused_by["bob"].reused == 0 and reused_by["bob"].prefilled == PROMPT_TOKENS + 6


@pytest.mark.parametrize("path", OPENERS)
def test_clients_without_keys_never_reuse_each_others_prefixes(target_engine: TargetEngine, path: str) -> None:
    asyncio.run(_clients_without_keys_never_reuse_each_others_prefixes(target_engine, path))


async def _clients_without_keys_never_reuse_each_others_prefixes(target_engine: TargetEngine, path: str) -> None:
    opener = OPENERS[path]
    async with _served(target_engine, keys=None) as (_, client, _):
        first, second = client(), client()
        prompt = random_prompt(41 + list(OPENERS).index(path), length=PROMPT_TOKENS)
        assert await opener(first, prompt) == 0
        assert await opener(second, _turn(prompt, 1)) == 0
        assert await opener(first, _turn(prompt, 2)) >= 32  # the same client: its token names its scope
        assert await opener(second, _turn(prompt, 3)) >= 32  # and the second's own turn reuses its own


def test_one_cache_for_every_client_only_when_the_operator_says_so(target_engine: TargetEngine) -> None:
    asyncio.run(_one_cache_for_every_client_only_when_the_operator_says_so(target_engine))


async def _one_cache_for_every_client_only_when_the_operator_says_so(target_engine: TargetEngine) -> None:
    async with _served(target_engine, VerifierLimits(share_prefixes=True), keys=None) as (_, client, _):
        prompt = random_prompt(33, length=PROMPT_TOKENS)
        assert await _open_session(client(), prompt) == 0
        assert await _open_session(client(), _turn(prompt, 1)) >= 32


def test_with_reuse_off_a_key_reuses_nothing_even_of_its_own(target_engine: TargetEngine) -> None:
    asyncio.run(_with_reuse_off_a_key_reuses_nothing_even_of_its_own(target_engine))


async def _with_reuse_off_a_key_reuses_nothing_even_of_its_own(target_engine: TargetEngine) -> None:
    async with _served(target_engine, VerifierLimits(reuse_prefixes=False)) as (verifier, client, _):
        alice = client("alice-key-Qw3Er5Ty7")
        prompt = random_prompt(39, length=PROMPT_TOKENS)
        assert await _open_session(alice, prompt) == 0
        assert await _open_session(alice, _turn(prompt, 1)) == 0
        assert len(verifier.sessions.prefixes) == 0


def test_with_keys_the_shared_cache_flag_shares_within_a_key_only(forward_pass_engine: TargetEngine) -> None:
    asyncio.run(_with_keys_the_shared_cache_flag_shares_within_a_key_only(forward_pass_engine))


async def _with_keys_the_shared_cache_flag_shares_within_a_key_only(forward_pass_engine: TargetEngine) -> None:
    async with _served(forward_pass_engine, VerifierLimits(share_prefixes=True)) as (_, client, _):
        prompt = random_prompt(34, length=PROMPT_TOKENS)
        assert await _open_session(client("alice-key-Qw3Er5Ty7"), prompt) == 0
        assert await _open_session(client("bob-key-Zx8Cv6Bn4"), _turn(prompt, 1)) == 0
        assert await _open_session(client("alice-key-Qw3Er5Ty7"), _turn(prompt, 2)) == PROMPT_TOKENS - 1


def test_a_flood_from_one_key_leaves_another_keys_conversation_in_place(forward_pass_engine: TargetEngine) -> None:
    asyncio.run(_a_flood_from_one_key_leaves_another_keys_conversation_in_place(forward_pass_engine))


async def _a_flood_from_one_key_leaves_another_keys_conversation_in_place(forward_pass_engine: TargetEngine) -> None:
    """Room for 4 prompts' KV: bob's kept conversation holds one of them; alice's 12 distinct
    prompts (6 closed, then 6 left open) churn her own kept prefixes and then her own idle
    sessions, and bob's next turn computes only its new tokens."""
    async with _served(forward_pass_engine) as (verifier, client, _):
        per_token = verifier.sessions.kv_bytes_per_token
        limits = verifier.sessions.limits
        verifier.sessions.limits = SessionLimits(limits.ttl_s, limits.max_sessions, 4 * (PROMPT_TOKENS + 8) * per_token)
        alice, bob = client("alice-key-Qw3Er5Ty7"), client("bob-key-Zx8Cv6Bn4")
        history = random_prompt(35, length=PROMPT_TOKENS)
        await _open_session(bob, history)
        for n in range(6):
            await _open_session(alice, random_prompt(600 + n, length=PROMPT_TOKENS))
        assert verifier.sessions.prefixes.count(owner="alice") >= 1  # she kept some of hers
        for n in range(6):
            await alice.open_session(OpenSessionRequest(random_prompt(700 + n, length=PROMPT_TOKENS), CONFIG))
        assert verifier.sessions.evictions["kv_cap"] >= 3  # her own idle sessions made the room
        assert await _open_session(bob, _turn(history, 1)) == PROMPT_TOKENS - 1  # all but the row the turn needs


def test_a_refused_open_keeps_its_keys_prefix(forward_pass_engine: TargetEngine) -> None:
    asyncio.run(_a_refused_open_keeps_its_keys_prefix(forward_pass_engine))


async def _a_refused_open_keeps_its_keys_prefix(forward_pass_engine: TargetEngine) -> None:
    limits = VerifierLimits(sessions=SessionLimits(per_key=KeyLimits(max_kv_bytes=(PROMPT_TOKENS + 20) * 4096)))
    async with _served(forward_pass_engine, limits) as (verifier, client, _):
        per_token = verifier.sessions.kv_bytes_per_token
        verifier.sessions.limits = SessionLimits(per_key=KeyLimits(max_kv_bytes=(PROMPT_TOKENS + 20) * per_token))
        alice = client("alice-key-Qw3Er5Ty7")
        history = random_prompt(36, length=PROMPT_TOKENS)
        await _open_session(alice, history)
        with pytest.raises(CapacityExceeded):  # a prompt past her KV cap: refused after it took her prefix
            await _open_session(alice, history + random_prompt(37, length=40))
        assert verifier.sessions.prefixes.count(owner="alice") == 1
        assert await _open_session(alice, _turn(history, 1)) == PROMPT_TOKENS - 1


def test_opens_racing_for_one_kept_prefix_report_and_pay_what_they_computed(forward_pass_engine: TargetEngine) -> None:
    asyncio.run(_opens_racing_for_one_kept_prefix_report_and_pay_what_they_computed(forward_pass_engine))


async def _opens_racing_for_one_kept_prefix_report_and_pay_what_they_computed(forward_pass_engine: TargetEngine) -> None:
    """Two opens of one client sent together: both are admitted on the estimate that its kept
    prefix holds their prompt, only one takes it; each reports what it reused, the key's rate is
    charged every token they computed, and admission's cost model learns from what was fed."""
    async with _served(forward_pass_engine) as (verifier, client, state):
        state.batcher.rate = TokenRate(1000.0, clock=lambda: 0.0)  # a frozen clock: nothing refills
        alice = client("alice-key-Qw3Er5Ty7")
        history = random_prompt(38, length=PROMPT_TOKENS)
        assert await _open_session(alice, history) == 0
        state.batcher.cost = ForwardCost()  # what admission learns of prefills, from here
        racing = await asyncio.gather(*(_open_session(alice, _turn(history, n)) for n in (1, 2)))
        assert sorted(racing) == [0, PROMPT_TOKENS - 1]
        assert state.batcher.cost.known  # it learned from the prefill that ran, not the 7 tokens each was queued as
        computed = PROMPT_TOKENS + 2 * (PROMPT_TOKENS + 6) - (PROMPT_TOKENS - 1)
        assert state.batcher.rate._buckets["alice"].level == 2000.0 - computed


@pytest.mark.parametrize(
    ("changes", "warned"),
    [
        ({}, None),
        ({"host": "0.0.0.0", "insecure": True}, "no API keys on 0.0.0.0"),
        ({"shared_prefix_cache": True}, "one prefix cache for every client (--shared-prefix-cache)"),
    ],
)
def test_the_verifier_says_at_start_what_clients_share(
    target_model, caplog: pytest.LogCaptureFixture, changes: dict[str, object], warned: str | None
) -> None:
    async def run() -> None:
        async with running_servers(target_model, settings=SETTINGS.model_copy(update=changes)):
            pass

    caplog.set_level(logging.WARNING, logger="cloud-verifier")
    asyncio.run(run())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "no TLS" not in r.getMessage()]
    if warned is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warned in warnings[0], warnings
