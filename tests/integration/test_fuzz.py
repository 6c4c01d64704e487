"""Property-based fuzzing of the verifier's gRPC surface (hypothesis).

One real verifier (grpc.aio on a loopback port 0, the tiny random target) serves the whole
module from its own event loop in a background thread; the properties call it through a plain
synchronous channel. Every field of every request message is drawn: prompts, sampling settings
(NaN, infinite, subnormal, huge), seeds, accept modes known and unknown, vocabulary sizes, session
ids (real ones the fuzzer opened, mutated, empty, long, non-ASCII), base positions near the real
one, catch-up, drafts, draft probabilities, hard masks, sparse drafts, want_top_k, request ids,
max_new_tokens, stop ids, Decode stretches (on a held session, or opening one, or both, or neither;
max_tokens; stop ids; catch-up), grammars (text, stop ids, generated count), and the call's
deadline and metadata. Raw frames go to each method
as bytes: random, truncated, corrupted, with invalid UTF-8 in string fields, nested too deep, oversize.

For every case: the status is OK or one that docs/architecture.md's "Errors" section documents (never
UNKNOWN or INTERNAL); the details are short and hold no exception class name or traceback; an OK
reply agrees with its request; a session the fuzzer tracks is where the server says it is
(FAILED_PRECONDITION's position, CloseSession's position, a Decode stretch's positions), so a failed
request never moved it; a refused Decode leaves no session behind; and the server answers its health
check afterwards. An honest greedy session (the bystander) runs rounds beside the fuzzed calls
(every few cases, concurrently, so batched with them); its tokens must equal the same rounds on a
fresh verifier. A Decode refusal is predicted from the request and the session it names: both or
neither of session_id and open, max_tokens outside [1, max_new_tokens] or a stop id outside the
vocabulary is INVALID_ARGUMENT; an unknown session NOT_FOUND; a wrong base position
FAILED_PRECONDITION; bad catch-up (ids, length, past the context) INVALID_ARGUMENT.

SPECDEC_FUZZ_EXAMPLES=N: N examples per property (by default about 420 cases in all).
SPECDEC_FUZZ_REPORT=PATH: the status histogram as JSON; it is also written to the terminal.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import logging
import math
import os
import random
import re
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
import pytest
from google.protobuf import text_format
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloud.engine.llamacpp import MAX_SEQUENCES
from cloud.grpc_server import SERVICE_NAME, start_server
from cloud.sessions import SessionLimits
from cloud.state import ServerState
from cloud.verifier import Verifier, VerifierLimits
from shared import protocol, wire
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc
from shared.protocol import AcceptMode
from tests.harness import TargetEngine, random_prompt

VOCAB = 96  # the tiny target's logits width
# Caps the fuzzer can reach in a few milliseconds (a 1024-token context), and room enough that
# nothing it leaves behind evicts or expires the bystander (eviction is documented, not a bug).
LIMITS = VerifierLimits(max_context_tokens=1024, sessions=SessionLimits(ttl_s=3600.0, max_sessions=100_000))
MAX_K = LIMITS.max_draft_tokens
# docs/architecture.md, "Errors": the statuses a request may get. INTERNAL is a bug by definition; UNAUTHENTICATED
# (no API keys are configured here) and UNAVAILABLE (loading, draining) cannot happen on this server.
DOCUMENTED = frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"})
LONG_TIMEOUT = 30.0  # a call that runs into this deadline means the server hung
MAX_CHUNKS = 8  # a Generate or Decode stream is cancelled after this many chunks
BYSTANDER_EVERY = 3  # a bystander round rides beside every third case
# Text a status detail must never hold: an exception class name, a traceback.
LEAK = re.compile(r"Traceback|File \"|\b[A-Za-z_]+(Error|Exception)\b|\bline \d+, in\b")

EXAMPLES = int(os.environ.get("SPECDEC_FUZZ_EXAMPLES", "0") or 0)


def _budget(default: int) -> settings:
    return settings(
        max_examples=EXAMPLES or default,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
            HealthCheck.large_base_example,
        ],
    )


# ---- strategies -------------------------------------------------------------------------------


def _f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


F32_MAX = _f32(3.4028234663852886e38)
I32 = st.integers(-(2**31), 2**31 - 1)
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
DICE = st.integers(0, 9)
ANY_F32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
EDGE_FLOATS = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    1e-45,
    1e-40,
    _f32(1.1754943508222875e-38),
    _f32(1e-7),
    _f32(0.999),
    _f32(1.0000001),
    1.5,
    999.0,
    1000.0,
    _f32(1000.0001),
    _f32(1e-3),
    _f32(0.00099999),
    F32_MAX,
    -F32_MAX,
    math.inf,
    -math.inf,
    math.nan,
]
BAD_IDS = [-1, VOCAB, VOCAB + 1, 2**31 - 1, -(2**31)]
TEXT = st.text(max_size=40)  # any code point but surrogates (a str field cannot carry one)
ODD_IDS = [
    "",
    " ",
    "\x00",
    "\u00e9\u00e9\u00e9",
    "\U0001f642",
    "\u202eevil",
    "../../etc/passwd",
    "%s%n%x",
    "a" * 12,
    "\ufeff",
    "A" * 64,
]
INVALID_UTF8 = [
    b"\xff",
    b"\xfe\xff",
    b"\xc3\x28",
    b"\xa0\xa1",
    b"\xe2\x28\xa1",
    b"\xf0\x28\x8c\x28",
    b"\xed\xa0\x80",
    b"\xc0\xaf",
    b"\xf8\x88\x80\x80\x80",
    b"sid\xff",
    b"\xf4\x90\x80\x80",
]
HEADER_VALUE = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80)


def weighted(*options: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    total = sum(w for w, _ in options)

    def pick(n: int) -> st.SearchStrategy[Any]:
        for w, strategy in options:
            if n < w:
                return strategy
            n -= w
        raise AssertionError("unreachable")

    return st.integers(0, total - 1).flatmap(pick)


def ids(vocab: int) -> st.SearchStrategy[int]:
    """Mostly in-vocabulary ids, sometimes just past it or anywhere in int32."""
    return weighted((8, st.integers(0, vocab - 1)), (1, st.sampled_from([*BAD_IDS, vocab])), (1, I32))


@st.composite
def id_lists(draw: Any, vocab: int, max_small: int, max_big: int, min_size: int = 0) -> list[int]:
    """Short lists of valid ids, short lists with bad ids, or long seeded lists (hypothesis draws
    each element of a list, so long ones come from a PRNG), one bad id in some."""
    d = draw(DICE)
    if d <= 5:
        return draw(st.lists(st.integers(0, vocab - 1), min_size=min_size, max_size=max_small))  # type: ignore[no-any-return]
    if d <= 7:
        return draw(st.lists(ids(vocab), min_size=min_size, max_size=max_small))  # type: ignore[no-any-return]
    n = draw(st.integers(max(min_size, max_small + 1), max_big))
    rng = random.Random(draw(U32))
    out = [rng.randrange(vocab) for _ in range(n)]
    if d == 9 and n:
        out[rng.randrange(n)] = draw(st.sampled_from([*BAD_IDS, vocab]))
    return out


def probability() -> st.SearchStrategy[float]:
    return weighted((7, st.floats(2.0**-20, 1.0, width=32)), (2, st.sampled_from(EDGE_FLOATS)), (1, ANY_F32))


def _setting(valid: st.SearchStrategy[float]) -> st.SearchStrategy[float]:
    """0 (off / greedy), a valid value, an edge value, any float32."""
    return weighted((5, st.just(0.0)), (3, valid), (1, st.sampled_from(EDGE_FLOATS)), (1, ANY_F32))


@st.composite
def sampling_configs(draw: Any, clean: bool = False) -> pb.SamplingConfig | None:
    """clean: only settings the verifier documents as valid (greedy, or within the ranges)."""
    if draw(DICE) == 0:
        return None  # unset: greedy
    temperature = st.floats(2.0**-9, 512.0, width=32)
    top_p = st.floats(2.0**-10, 1.0, width=32)
    penalty = st.floats(2.0**-9, 512.0, width=32)
    if clean:
        return pb.SamplingConfig(
            temperature=draw(weighted((1, st.just(0.0)), (2, temperature))),
            top_k=draw(st.integers(0, 120)),
            top_p=draw(weighted((1, st.just(0.0)), (2, top_p))),
            repetition_penalty=draw(weighted((1, st.just(0.0)), (2, penalty))),
        )
    return pb.SamplingConfig(
        temperature=draw(_setting(temperature)),
        top_k=draw(
            weighted((5, st.just(0)), (3, st.integers(1, 120)), (1, st.sampled_from([1, 95, 96, 97, 2**31, 2**32 - 1])), (1, U32))
        ),
        top_p=draw(_setting(top_p)),
        repetition_penalty=draw(_setting(penalty)),
    )


ACCEPT_MODES = weighted((8, st.integers(0, 5)), (1, st.sampled_from([6, 99, -1, 2**31 - 1, -(2**31)])), (1, I32))
VOCAB_SIZES = weighted(
    (4, st.just(0)), (3, st.just(VOCAB)), (2, st.integers(1, VOCAB)), (1, st.sampled_from([VOCAB + 1, 4096, 2**31, 2**32 - 1]))
)
CLEAN_VOCAB_SIZES = weighted((1, st.just(0)), (1, st.just(VOCAB)), (1, st.integers(1, VOCAB)))
SEEDS = weighted((6, U64), (1, st.sampled_from([0, 1, 2**63, 2**64 - 1])))
TIMEOUTS = weighted((9, st.just(LONG_TIMEOUT)), (1, st.floats(0.001, 0.3)))
METADATA = weighted(
    (8, st.just(())),
    (1, st.tuples(st.tuples(st.just("authorization"), HEADER_VALUE))),
    (1, st.lists(st.tuples(st.sampled_from(["authorization", "x-fuzz", "x-request-id"]), HEADER_VALUE), max_size=3).map(tuple)),
)


@st.composite
def prompts(draw: Any, vocab_field: int, clean: bool = False) -> list[int]:
    vocab = vocab_field if 0 < vocab_field <= VOCAB else VOCAB
    if clean:
        return draw(
            weighted(
                (9, st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24)),  # type: ignore[no-any-return]
                (
                    1,
                    st.tuples(U32, st.integers(25, 900)).map(
                        lambda s: [random.Random(s[0]).randrange(vocab) for _ in range(s[1])]
                    ),
                ),
            )
        )
    if draw(DICE) == 0:
        return []
    return draw(id_lists(vocab, 24, 1100, min_size=1))  # type: ignore[no-any-return]


def reuse_tokens(clean: bool) -> st.SearchStrategy[str]:
    """A client's reuse token: none, one of the verifier's shape it never signed (a client of
    another verifier, or of this one before a restart), or text of any length."""
    of_its_shape = st.binary(min_size=24, max_size=24).map(lambda raw: base64.urlsafe_b64encode(raw).decode())
    if clean:
        return st.one_of(st.just(""), of_its_shape)
    return weighted((4, st.just("")), (2, of_its_shape), (2, st.text(max_size=64)), (1, st.text(min_size=65, max_size=300)))


@st.composite
def grammars(draw: Any, prompt_len: int) -> pb.Grammar | None:
    """None mostly; else a grammar of any text (valid Lark, garbage, oversize), stop ids in and
    out of the vocabulary, a generated count in and past the prompt. The fuzzed verifier's
    tokenizer carries no grammars: those that pass validation are refused (FAILED_PRECONDITION)."""
    if draw(DICE) < 8:
        return None
    text = draw(
        weighted(
            (3, st.just('start: "w1" | "w2"')),
            (3, st.text(max_size=200)),
            (1, st.just("")),
            (1, st.integers(64 * 1024 - 2, 64 * 1024 + 2).map(lambda n: "x" * n)),
        )
    )
    stops = draw(
        weighted((4, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)), (2, st.lists(ids(VOCAB), max_size=12)))
    )
    generated = draw(weighted((4, st.just(0)), (2, st.integers(0, prompt_len + 2)), (1, st.integers(0, 2**32 - 1))))
    return pb.Grammar(text=text, stop_token_ids=stops, generated=generated)


@st.composite
def open_requests(draw: Any, clean_in_ten: int = 4) -> pb.OpenSessionRequest:
    # by default four in ten valid in every field, so OK paths are fuzzed as deeply as refusals
    clean = draw(DICE) < clean_in_ten
    vocab_size = draw(CLEAN_VOCAB_SIZES if clean else VOCAB_SIZES)
    req = pb.OpenSessionRequest(
        prompt_tokens=draw(prompts(vocab_size, clean)),
        seed=draw(SEEDS),
        accept_mode=draw(st.integers(0, 5) if clean else ACCEPT_MODES),
        vocab_size=vocab_size,
        reuse_token=draw(reuse_tokens(clean)),
    )
    if (sampling := draw(sampling_configs(clean))) is not None:
        req.sampling.CopyFrom(sampling)
    if not clean and (grammar := draw(grammars(len(req.prompt_tokens)))) is not None:
        req.grammar.CopyFrom(grammar)
    return req


@st.composite
def generate_requests(draw: Any) -> pb.GenerateRequest:
    clean = draw(DICE) < 4
    vocab_size = draw(CLEAN_VOCAB_SIZES if clean else VOCAB_SIZES)
    valid_stops = st.lists(st.integers(0, VOCAB - 1), max_size=8)
    req = pb.GenerateRequest(
        prompt_tokens=draw(prompts(vocab_size, clean)),
        seed=draw(SEEDS),
        max_new_tokens=draw(
            st.integers(1, 12)
            if clean
            else weighted(
                (6, st.integers(1, 8)),
                (1, st.just(0)),
                (1, st.integers(9, 4096)),
                (1, st.integers(4097, 2**32 - 1)),
                (1, st.sampled_from([1024, 4096, 4097, 2**32 - 1])),
            )
        ),
        stop_token_ids=draw(
            valid_stops if clean else weighted((6, st.just([])), (3, valid_stops), (1, st.lists(ids(VOCAB), max_size=8)))
        ),
        vocab_size=vocab_size,
        reuse_token=draw(reuse_tokens(clean)),
    )
    if (sampling := draw(sampling_configs(clean))) is not None:
        req.sampling.CopyFrom(sampling)
    if (grammar := draw(grammars(len(req.prompt_tokens)))) is not None:
        req.grammar.CopyFrom(grammar)
    return req


# Strategies for calls on the fuzzer's own sessions draw a plan, and the plan builds the request
# from what the fuzzer knows at run time (the session's id, mode, vocabulary and position): no
# draw may depend on that state, or hypothesis could not replay a case.


def _fit(token: int, vocab: int) -> int:
    """An id valid in the model's vocabulary, moved into a session's smaller one; others as drawn."""
    return token % vocab if 0 <= token < VOCAB else token


@st.composite
def session_id_plans(draw: Any) -> Callable[[str | None], str]:
    """Mostly the real id (of a session the fuzzer opened), else a near miss, any text, odd ids, long ids."""
    d = draw(st.integers(0, 13))
    if d <= 10:
        mutation, other = draw(st.integers(0, 8)), draw(TEXT)

        def build(real: str | None) -> str:
            if real is None:
                return other
            if d <= 9:
                return real
            return [
                real[:-1],
                real + "x",
                real.upper(),
                " " + real,
                real + "\x00",
                real[::-1],
                real + "\u00e9",
                real * 2,
                real[1:],
            ][mutation]

        return build
    if d == 11:
        text = draw(TEXT)
    elif d == 12:
        text = draw(st.sampled_from(ODD_IDS))
    else:
        text = draw(st.sampled_from(["x", "\u00e9", "\U0001f642", "ab"])) * draw(st.integers(65, 20_000))
    return lambda real: text


@dataclass
class Tracked:
    """A session the fuzzer opened, and what it knows of it."""

    session_id: str
    mode: AcceptMode
    vocab: int
    position: int | None  # None after a call that may or may not have run (its deadline passed)
    rounds: int = 0


def _sparse(drafts: list[int], vocab: int, seed: int) -> list[pb.SparseDistribution]:
    """One valid distribution per draft token (the token in its support, unique ids, sum 1)."""
    rng = random.Random(seed)
    out = []
    for token in drafts:
        size = rng.randint(1, min(vocab, 12))
        support = [token, *rng.sample([t for t in range(vocab) if t != token], size - 1)]
        weights = [rng.random() + 1e-3 for _ in support]
        out.append(pb.SparseDistribution(token_ids=support, probs=[w / sum(weights) for w in weights]))
    return out


@st.composite
def broken_sparse(draw: Any) -> pb.SparseDistribution:
    n = draw(st.integers(0, 6))
    return pb.SparseDistribution(
        token_ids=draw(st.lists(ids(VOCAB), max_size=n)), probs=draw(st.lists(probability(), max_size=n + 1))
    )


@st.composite
def verify_plans(draw: Any) -> Callable[[Tracked | None], pb.VerifyRequest]:
    """A VerifyRequest for a tracked session (None: no real session at all). Four in ten are
    valid in every field for the session's mode, so the accept paths are fuzzed too."""
    clean = draw(DICE) < 4
    k = draw(
        st.integers(0, MAX_K)
        if clean
        else weighted((6, st.integers(0, 4)), (3, st.integers(5, MAX_K)), (1, st.integers(MAX_K + 1, 40)))
    )
    drafts = draw(st.lists(st.integers(0, VOCAB - 1) if clean or draw(DICE) < 8 else ids(VOCAB), min_size=k, max_size=k))
    d_position, delta, guess, fixed = (0 if clean else draw(DICE)), 0, 0, 0
    if d_position <= 7:  # the real position (a guess while it is unknown), one in eight a near miss
        delta, guess = draw(st.integers(-3, 3)) if d_position == 7 else 0, draw(st.integers(0, 1100))
    else:
        fixed = draw(U32 if d_position == 8 else st.sampled_from([0, 1, 2**31, 2**32 - 1]))
    valid_probs = draw(st.lists(st.floats(2.0**-20, 1.0, width=32), min_size=k, max_size=k))
    d = draw(st.integers(0, 7) if clean else DICE)
    if d <= 2:
        probs: list[float] = []
    elif d <= 7:
        probs = valid_probs
    elif d == 8:
        probs = draw(st.lists(probability(), min_size=k, max_size=k))
    else:
        probs = draw(st.lists(probability(), max_size=k + 2))
    d = draw(st.integers(0, 8) if clean else DICE)
    if d <= 5:
        mask = b""
    elif d <= 8:
        mask = draw(st.binary(min_size=(k + 7) // 8, max_size=(k + 7) // 8))
    else:
        mask = draw(st.binary(max_size=6))
    sparse_kind, seed = draw(st.integers(0, 6) if clean else DICE), draw(U32)
    broken_at, broken = draw(st.integers(0, 2**16)), draw(broken_sparse())
    junk = draw(st.lists(broken_sparse(), max_size=k + 1)) if sparse_kind >= 8 else []
    session_id = (lambda real: real or "") if clean else draw(session_id_plans())
    committed = draw(
        weighted((7, st.just([])), (3, st.lists(st.integers(0, VOCAB - 1), max_size=8) if clean else id_lists(VOCAB, 8, 80)))
    )
    want_top_k = draw(
        st.integers(0, LIMITS.max_top_k)
        if clean
        else weighted((6, st.just(0)), (3, st.integers(1, LIMITS.max_top_k + 1)), (1, U32))
    )
    request_id = draw(weighted((7, st.just("")), (2, TEXT), (1, st.integers(100, 5000).map(lambda n: "r" * n))))

    def build(target: Tracked | None) -> pb.VerifyRequest:
        vocab = target.vocab if target else VOCAB
        mode = target.mode if target else AcceptMode.GREEDY
        tokens = [_fit(t, vocab) for t in drafts]
        known = target.position if target else None
        position = max(0, (guess if known is None else known) + delta) if d_position <= 7 else fixed
        if mode is AcceptMode.SPARSE and sparse_kind <= 6:
            sparse = _sparse(tokens, vocab, seed) if all(0 <= t < vocab for t in tokens) else []
        elif mode is AcceptMode.SPARSE and sparse_kind == 7 and k:
            sparse = _sparse([t % vocab for t in tokens], vocab, seed)
            sparse[broken_at % k] = broken
        elif sparse_kind == 9 or (mode is AcceptMode.SPARSE and sparse_kind == 8):
            sparse = junk
        else:
            sparse = []
        q = valid_probs if clean and mode in (AcceptMode.SCALAR, AcceptMode.SHORTCUT) else probs
        return pb.VerifyRequest(
            session_id=session_id(target.session_id if target else None),
            base_position=position,
            committed_tokens=[_fit(t, vocab) for t in committed],
            draft_tokens=tokens,
            draft_probs=q,
            hard_mask=mask,
            sparse_draft=sparse,
            want_top_k=want_top_k,
            request_id=request_id,
        )

    return build


MAX_TOKENS = weighted(
    (6, st.integers(1, 8)),
    (1, st.just(0)),
    (1, st.integers(9, 4096)),
    (1, st.integers(4097, 2**32 - 1)),
    (1, st.sampled_from([1024, 4096, 4097, 2**32 - 1])),
)


# Catch-up a stretch must refuse: an id outside every vocabulary, or more tokens than a round takes.
CATCHUP_FAULTS = weighted(
    (
        1,
        st.tuples(st.lists(st.integers(0, VOCAB - 1), max_size=7), st.sampled_from(BAD_IDS), st.integers(0, 7)).map(
            lambda d: [*d[0][: d[2]], d[1], *d[0][d[2] :]]
        ),
    ),
    (1, st.tuples(U32, st.integers(LIMITS.max_catchup_tokens + 1, 80)).map(lambda s: [s[0] % VOCAB] * s[1])),
)


@st.composite
def decode_plans(draw: Any) -> Callable[[Tracked | None], pb.DecodeRequest]:
    """A DecodeRequest: a stretch on a tracked session (None: no real session at all), or one
    that opens its session (a fuzzed OpenSessionRequest), or one that sets both or neither.
    Four in ten are valid in every field of the stretch itself."""
    clean = draw(DICE) < 4
    d_target = draw(st.integers(0, 9))  # 0-5: names a session; 6-8: opens; 9: both, or neither
    both = d_target == 9 and draw(st.booleans())
    neither = d_target == 9 and not both
    opening = draw(open_requests(clean_in_ten=7)) if 6 <= d_target <= 8 or both else None  # mostly valid: the stretch is fuzzed
    session_id = (lambda real: real or "") if clean else draw(session_id_plans())
    d_position, delta, guess, fixed = (0 if clean else draw(DICE)), 0, 0, 0
    if d_position <= 7:  # the real position (a guess while it is unknown), one in eight a near miss
        delta, guess = draw(st.integers(-3, 3)) if d_position == 7 else 0, draw(st.integers(0, 1100))
    else:
        fixed = draw(U32 if d_position == 8 else st.sampled_from([0, 1, 2**31, 2**32 - 1]))
    valid_catchup = st.lists(st.integers(0, VOCAB - 1), max_size=8)
    committed = draw(
        weighted((7, st.just([])), (3, valid_catchup))
        if clean
        else weighted((5, st.just([])), (2, valid_catchup), (2, CATCHUP_FAULTS), (1, id_lists(VOCAB, 8, 80)))
    )
    valid_stops = st.lists(st.integers(0, VOCAB - 1), max_size=8)
    stops = draw(valid_stops if clean else weighted((6, st.just([])), (3, valid_stops), (1, st.lists(ids(VOCAB), max_size=8))))
    max_tokens = draw(st.integers(1, 12) if clean else MAX_TOKENS)

    def build(target: Tracked | None) -> pb.DecodeRequest:
        req = pb.DecodeRequest(max_tokens=max_tokens, stop_token_ids=stops)
        if opening is not None:
            req.open.CopyFrom(opening)
            vocab = opening.vocab_size if 0 < opening.vocab_size <= VOCAB else VOCAB
            req.base_position = fixed  # ignored with `open`
        else:
            vocab = target.vocab if target else VOCAB
            known = target.position if target else None
            req.base_position = max(0, (guess if known is None else known) + delta) if d_position <= 7 else fixed
        if both or (opening is None and not neither):
            req.session_id = session_id(target.session_id if target else None) or ("x" if both else "")
        req.committed_tokens.extend(_fit(t, vocab) for t in committed)
        return req

    return build


def _decode_refusal(req: pb.DecodeRequest, tracked: Tracked | None) -> str | None:
    """The status a Decode must be refused with before its first token, from its own fields and
    the session it names as the fuzzer knows it; None when it may run. An opening's own fields
    are not predicted here (a refused opening is INVALID_ARGUMENT too)."""
    opening = req.HasField("open")
    if opening == bool(req.session_id):
        return "INVALID_ARGUMENT"
    if not 0 < req.max_tokens <= LIMITS.max_new_tokens or any(not 0 <= t < VOCAB for t in req.stop_token_ids):
        return "INVALID_ARGUMENT"
    if opening:
        vocab, position = req.open.vocab_size or VOCAB, len(req.open.prompt_tokens)
    elif tracked is None:
        return "NOT_FOUND"
    elif tracked.position is None:
        return None  # FAILED_PRECONDITION or, at the right position, as below: the caller allows both
    elif req.base_position != tracked.position:
        return "FAILED_PRECONDITION"
    else:
        vocab, position = tracked.vocab, tracked.position
    catchup = list(req.committed_tokens)
    if len(catchup) > LIMITS.max_catchup_tokens or position + len(catchup) + 1 > LIMITS.max_context_tokens:
        return "INVALID_ARGUMENT"
    if any(not 0 <= t < vocab for t in catchup):
        return "INVALID_ARGUMENT"
    return None


# ---- raw frames ---------------------------------------------------------------------------------

METHODS = ("OpenSession", "Verify", "CloseSession", "Generate", "Decode")
STREAMING = frozenset({"Generate", "Decode"})
REQUEST_TYPES: dict[str, type[Message]] = {
    "OpenSession": pb.OpenSessionRequest,
    "Verify": pb.VerifyRequest,
    "CloseSession": pb.CloseSessionRequest,
    "Generate": pb.GenerateRequest,
    "Decode": pb.DecodeRequest,
}
STRING_FIELDS = {"OpenSession": [], "Verify": [1, 9], "CloseSession": [1], "Generate": [], "Decode": [1]}
OVERSIZE = b"\x0a\x90\x80\x80\x02" + b"a" * (4 * 1024 * 1024 + 16)  # a 4 MiB + 16 B session id: past gRPC's cap


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


CRAFTED = [
    b"\x0a\xff\xff\xff\xff\x0f",  # a length of 2^32 - 1 with nothing after it
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",  # a varint that never ends
    b"\x0b" * 200,  # groups nested 200 deep
    b"\x0b" * 5000 + b"\x0c" * 5000,  # 5000 deep, closed
    b"\x12\x05\x08\xff\xff\xff",  # a nested message cut inside
    b"\x22\x7f\x01\x02",  # packed ids claiming 127 bytes
    b"\x00",  # field number 0
    b"\x07",  # wire type 7
    b"\x0c",  # an end-group with no start
    b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x02",  # an 11-byte varint
    b"\x0a\x00" * 1000,  # the same empty string 1000 times
    _field(7, _field(1, b"\xff" * 10) + _field(2, b"\x00" * 7)),  # sparse_draft with a ragged packed float
    _field(5, b"\x00\x00\xc0\x7f" * 4),  # NaN draft_probs, packed
]


@st.composite
def frame_plans(draw: Any, method: str) -> Callable[[bytes], bytes]:
    """Raw bytes for `method`, most made from a valid message's bytes (passed to the plan)."""
    d = draw(st.integers(0, 11))
    if d == 0:
        frame = draw(st.binary(max_size=96))
        return lambda good: frame  # type: ignore[no-any-return]
    if d == 1:  # truncated
        cut = draw(st.integers(0, 2**16))
        return lambda good: good[: cut % max(len(good), 1)]
    if d == 2:  # bytes flipped
        flips = draw(st.lists(st.tuples(st.integers(0, 2**16), st.integers(1, 255)), min_size=1, max_size=4))

        def flipped(good: bytes) -> bytes:
            frame = bytearray(good)
            for at, bits in flips if frame else ():
                frame[at % len(frame)] ^= bits
            return bytes(frame)

        return flipped
    if d == 3:  # garbage after a valid message
        tail = draw(st.binary(min_size=1, max_size=32))
        return lambda good: good + tail
    if d == 4:  # invalid UTF-8 in a string field (or in an unknown field where the message has none)
        bad = _field(draw(st.sampled_from(STRING_FIELDS[method] or [15, 1000])), draw(st.sampled_from(INVALID_UTF8)))
        before = draw(st.booleans())
        return lambda good: bad + good if before else good + bad
    if d == 5:
        crafted = draw(st.sampled_from(CRAFTED))
        return lambda good: crafted  # type: ignore[no-any-return]
    if d == 6:  # empty (every field at its default), or past gRPC's size cap now and then
        frame = OVERSIZE if draw(st.integers(0, 63)) == 37 else b""
        return lambda good: frame
    if d == 7:  # a known field with the wrong wire type
        wrong = _varint(draw(st.integers(1, 9)) << 3 | draw(st.sampled_from([0, 1, 5]))) + b"\x01" * 8
        return lambda good: good + wrong
    if d == 8:  # an unknown field of any type
        unknown = _field(draw(st.integers(10, 2**29 - 1)), draw(st.binary(max_size=16)))
        return lambda good: good + unknown
    return lambda good: good  # the valid message, sent as raw bytes


# ---- the server and the calls -------------------------------------------------------------------


@dataclass
class Result:
    code: str
    details: str = ""
    trailing: dict[str, Any] = field(default_factory=dict)
    reply: Any = None  # the message (bytes on the raw path), or the stream's chunks
    cut: bool = False  # a stream this side cancelled after MAX_CHUNKS
    created: dict[str, list[int]] = field(default_factory=dict)  # Decode: sessions stored during the call, their tokens


def _error(err: grpc.RpcError, reply: Any = None) -> Result:
    return Result(err.code().name, err.details() or "", dict(err.trailing_metadata() or ()), reply)  # type: ignore[attr-defined]


def _unary(method: Any, request: Any, timeout: float, metadata: Any) -> Result:
    try:
        reply, call = method.with_call(request, timeout=timeout, metadata=metadata)
    except grpc.RpcError as err:
        return _error(err)
    return Result("OK", "", dict(call.trailing_metadata() or ()), reply)


def _stream(method: Any, request: Any, timeout: float, metadata: Any, max_chunks: int = MAX_CHUNKS) -> Result:
    chunks: list[Any] = []
    call = method(request, timeout=timeout, metadata=metadata)
    try:
        for chunk in call:
            chunks.append(chunk)
            if len(chunks) >= max_chunks:
                call.cancel()
                return Result("OK", reply=chunks, cut=True)
    except grpc.RpcError as err:
        return _error(err, chunks)
    return Result("OK", "", dict(call.trailing_metadata() or ()), chunks)


class ServerThread:
    """A verifier served by grpc.aio on its own event loop in a background thread."""

    def __init__(self, verifier: Verifier) -> None:
        self.loop = asyncio.new_event_loop()
        self.verifier = verifier
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-verifier", daemon=True)
        self.thread.start()

        async def start() -> tuple[ServerState, grpc.aio.Server, int]:
            state = ServerState.for_verifier(verifier)
            server, port = await start_server(state, "127.0.0.1:0")
            return state, server, port

        self.state, self.server, self.port = self._run(start())

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self) -> None:
        try:
            self._run(self.server.stop(None))
        finally:
            self.state.worker.shutdown()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            if not self.thread.is_alive():
                self.loop.close()


@dataclass(frozen=True)
class Reference:
    prompt: list[int]
    rounds: list[int]  # the greedy continuation by k = 0 rounds, on a fresh verifier
    generated: list[int]  # Generate's greedy tokens on a fresh verifier


def _limits(target: TargetEngine) -> VerifierLimits:
    """LIMITS, within the llama.cpp engine's sequences (one per session, at most MAX_SEQUENCES)."""
    if target.name == "llama.cpp":
        return replace(LIMITS, sessions=replace(LIMITS.sessions, max_sessions=MAX_SEQUENCES))
    return LIMITS


def _reference(target: TargetEngine) -> Reference:
    verifier = Verifier(target(), "reference", _limits(target))
    prompt = random_prompt(4242, length=10)
    config = protocol.SessionConfig(vocab_size=VOCAB)
    opened = verifier.open_session(protocol.OpenSessionRequest(prompt, config))
    tokens: list[int] = []
    for _ in range(48):
        tokens.append(verifier.verify(protocol.VerifyRequest(opened.session_id, len(prompt) + len(tokens), [])).next_token)
    generated = [t for chunk in verifier.generate(protocol.GenerateRequest(prompt, config, 24, [])) for t in chunk.tokens]
    return Reference(prompt, tokens, generated)


class Bystander:
    """An honest greedy session: rounds with k in 0..3 drafted from the reference continuation,
    every third with its last draft wrong; each reply must be what the reference says."""

    def __init__(self, stub: pb_grpc.VerifierStub, reference: Reference) -> None:
        self.stub = stub
        self.ref = reference
        self.session_id = ""
        self.produced = 0
        self.rounds = 0
        self.reopened = 0

    def open(self) -> None:
        reply = self.stub.OpenSession(
            pb.OpenSessionRequest(prompt_tokens=self.ref.prompt, vocab_size=VOCAB), timeout=LONG_TIMEOUT
        )
        assert reply.position == len(self.ref.prompt)
        self.session_id, self.produced = reply.session_id, 0

    def request(self) -> pb.VerifyRequest:
        k = self.rounds % 4
        drafts = list(self.ref.rounds[self.produced : self.produced + k])
        if k and self.rounds % 3 == 2:
            drafts[-1] = (drafts[-1] + 1) % VOCAB
        return pb.VerifyRequest(
            session_id=self.session_id,
            base_position=len(self.ref.prompt) + self.produced,
            draft_tokens=drafts,
            request_id=f"bystander-{self.rounds}",
        )

    def start(self) -> tuple[pb.VerifyRequest, Any]:
        req = self.request()
        return req, self.stub.Verify.future(req, timeout=LONG_TIMEOUT)

    def finish(self, req: pb.VerifyRequest, future: Any) -> None:
        try:
            reply = future.result()
        except grpc.RpcError as err:
            raise AssertionError(f"the bystander's round failed: {err.code().name} {err.details()!r}") from None
        expected_rest = self.ref.rounds[self.produced :]
        accepted = 0
        while accepted < len(req.draft_tokens) and req.draft_tokens[accepted] == expected_rest[accepted]:
            accepted += 1
        got = (reply.accepted_len, reply.next_token, reply.new_base_position)
        want = (accepted, expected_rest[accepted], req.base_position + accepted + 1)
        assert got == want, f"the bystander's round {self.rounds} changed: got {got}, a fresh verifier gives {want}"
        self.produced += accepted + 1
        self.rounds += 1
        if self.produced + 5 > len(self.ref.rounds):  # near the reference's end: close and start over
            closed = self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.session_id), timeout=LONG_TIMEOUT)
            assert closed.position == len(self.ref.prompt) + self.produced
            self.reopened += 1
            self.open()

    def round(self) -> None:
        self.finish(*self.start())


MODES = [AcceptMode.GREEDY, AcceptMode.POINT, AcceptMode.SPARSE, AcceptMode.SCALAR, AcceptMode.SHORTCUT, AcceptMode.TOP1]
MODE_TO_PB = {
    AcceptMode.POINT: pb.ACCEPT_MODE_POINT,
    AcceptMode.SPARSE: pb.ACCEPT_MODE_SPARSE,
    AcceptMode.SCALAR: pb.ACCEPT_MODE_SCALAR,
    AcceptMode.SHORTCUT: pb.ACCEPT_MODE_SHORTCUT,
    AcceptMode.TOP1: pb.ACCEPT_MODE_TOP1,
}
POOL_MAX = 12


def _refused_session(result: Result) -> bool:
    """The engine refused to open a session it cannot verify exactly (vLLM: an approximate mode),
    or the verifier a grammar its tokenizer cannot carry: FAILED_PRECONDITION without a
    position, its reason naming the engine or the grammar."""
    positioned = wire.SERVER_POSITION_KEY in result.trailing
    named = "vllm engine" in result.details or "grammar" in result.details
    return result.code == "FAILED_PRECONDITION" and not positioned and named


def _describe(message: Any) -> str:
    if isinstance(message, bytes):
        text = repr(message[:600]) + (f"... ({len(message)} bytes)" if len(message) > 600 else "")
    else:
        text = f"{type(message).__name__}({text_format.MessageToString(message, as_one_line=True)})"
    return text if len(text) < 3000 else text[:3000] + "..."


class Fuzz:
    def __init__(self, server: ServerThread, reference: Reference) -> None:
        self.server = server
        self.channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        self.stub = pb_grpc.VerifierStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.raw = {
            m: (self.channel.unary_stream if m in STREAMING else self.channel.unary_unary)(
                f"/{SERVICE_NAME}/{m}", request_serializer=None, response_deserializer=None
            )
            for m in METHODS
        }
        self.reference = reference
        self.bystander = Bystander(self.stub, reference)
        self.pool: list[Tracked] = []
        self.refused_modes: set[AcceptMode] = set()  # modes the engine refuses to open
        self.codes: dict[str, Counter[str]] = {}
        self.details: dict[str, str] = {}  # one status detail per (call, code), for the report
        self.cases = 0
        self.setup_calls = 0
        self.started = time.perf_counter()

    # ---- one case -----------------------------------------------------------------------------

    def case(self, method: str, label: str, request: Any, send: Callable[[], Result], timeout: float) -> None:
        """Send one fuzzed call (with a bystander round beside it every few cases) and check it."""
        beside = self.bystander.start() if self.cases % BYSTANDER_EVERY == 0 else None
        try:
            before = self._server_sessions() if method == "Decode" else {}
            result = send()
            if method == "Decode":
                result.created = {sid: tokens for sid, tokens in self._server_sessions().items() if sid not in before}
            self.cases += 1
            self.codes.setdefault(label, Counter())[result.code + (" (stream cut)" if result.cut else "")] += 1
            if result.details:
                self.details.setdefault(f"{label} {result.code}", result.details[:200])
            self._check_status(method, request, result, timeout)
            if _refused_session(result):  # the engine verifies no such session: nothing was opened
                assert method in ("OpenSession", "Decode", "Generate"), f"{method} refused a session: {result.details!r}"
                return
            decoded = request if isinstance(request, Message) else self._decode(method, request, result, timeout)
            if decoded is not None:
                getattr(self, f"_after_{method}")(decoded, result, timeout)
        finally:
            if beside is not None:
                self.bystander.finish(*beside)
        self.alive()

    def _check_status(self, method: str, request: Any, result: Result, timeout: float) -> None:
        where = f"{method} -> {result.code} {result.details!r}\n  request: {_describe(request)}"
        if isinstance(request, Message) and (tracked := self._tracked(getattr(request, "session_id", ""))):
            where += f"\n  on {tracked}"
        assert result.code in DOCUMENTED, f"undocumented status: {where}"
        assert len(result.details) < 1000, f"details of {len(result.details)} characters: {where}"
        assert not LEAK.search(result.details), f"details name an exception: {where}"
        if result.code != "OK":
            assert result.details, f"no reason given: {where}"
        if result.code == "DEADLINE_EXCEEDED":
            assert timeout < LONG_TIMEOUT, f"the server hung for {LONG_TIMEOUT} s: {where}"
        if result.code == "FAILED_PRECONDITION" and not _refused_session(result):
            assert int(result.trailing[wire.SERVER_POSITION_KEY]) >= 0, where
        if wire.RETRY_AFTER_MS_KEY in result.trailing:
            assert result.code == "RESOURCE_EXHAUSTED" and int(result.trailing[wire.RETRY_AFTER_MS_KEY]) >= 0, where
            assert result.trailing.get(wire.RETRY_PUSHBACK_MS_KEY) == result.trailing[wire.RETRY_AFTER_MS_KEY], where
        if result.code == "NOT_FOUND" and isinstance(request, Message):
            sid = getattr(request, "session_id", "")
            assert len(sid) < 8 or sid not in result.details, f"NOT_FOUND echoes the session id: {where}"

    def _decode(self, method: str, frame: bytes, result: Result, timeout: float) -> Message | None:
        """The raw frame as the server parses it; an undecodable one must have been refused
        (or gRPC refused it first: past its size cap, or past a short deadline)."""
        try:
            request = REQUEST_TYPES[method].FromString(frame)
        except DecodeError:
            expected = (
                {"INVALID_ARGUMENT"}
                | ({"RESOURCE_EXHAUSTED"} if len(frame) > 4 << 20 else set())
                | ({"DEADLINE_EXCEEDED"} if timeout < LONG_TIMEOUT else set())
            )
            assert result.code in expected, f"an undecodable {method} frame got {result.code}: {_describe(frame)}"
            return None
        if method in STREAMING:  # chunks come before an error too (a Decode stretch at the context limit)
            chunk_type = pb.GenerateChunk if method == "Generate" else pb.DecodeChunk
            result.reply = [chunk_type.FromString(chunk) for chunk in result.reply or []]
        elif result.code == "OK":
            response: type[Message] = {
                "OpenSession": pb.OpenSessionResponse,
                "Verify": pb.VerifyResponse,
                "CloseSession": pb.CloseSessionResponse,
            }[method]
            result.reply = response.FromString(result.reply)
        return request

    def _server_sessions(self) -> dict[str, list[int]]:
        return {s.session_id: list(s.tokens) for s in self.server.verifier.sessions.snapshot()}

    def alive(self) -> None:
        reply = self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=LONG_TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING

    # ---- what each reply must agree with, and what the fuzzer learns from it ---------------------

    def _tracked(self, session_id: str) -> Tracked | None:
        return next((t for t in self.pool if t.session_id == session_id), None)

    def _after_OpenSession(self, req: pb.OpenSessionRequest, result: Result, timeout: float) -> None:
        if result.code != "OK":
            return
        reply, where = result.reply, _describe(req)
        vocab = req.vocab_size or VOCAB
        assert req.prompt_tokens and all(0 <= t < vocab for t in req.prompt_tokens), f"accepted a bad prompt: {where}"
        assert len(req.prompt_tokens) <= LIMITS.max_context_tokens, where
        assert reply.position == len(req.prompt_tokens) and reply.vocab_size == vocab, (reply, where)
        assert reply.max_draft_tokens == MAX_K and 0 < len(reply.session_id) <= 64, (reply, where)
        assert len(req.reuse_token) <= 64 and len(reply.reuse_token) == 32, f"a bad reuse token: {where}"
        assert reply.reused_tokens < len(req.prompt_tokens), (reply, where)
        mode = wire.config_from_pb(req.sampling, req.seed, req.accept_mode, req.vocab_size).accept_mode
        self._adopt(Tracked(reply.session_id, mode, vocab, reply.position))

    def _after_Verify(self, req: pb.VerifyRequest, result: Result, timeout: float) -> None:
        tracked = self._tracked(req.session_id)
        where = f"{result.code} {result.details!r} for {_describe(req)}"
        if tracked is None:
            assert result.code != "OK", f"a round on a session nobody opened: {where}"
            return
        if result.code == "NOT_FOUND":
            raise AssertionError(f"a session the fuzzer opened vanished: {where}")
        if result.code == "DEADLINE_EXCEEDED":
            tracked.position = None  # it may have run after the caller left
        if result.code == "FAILED_PRECONDITION":
            server = int(result.trailing[wire.SERVER_POSITION_KEY])
            if tracked.position is not None:
                assert server == tracked.position, f"a failed request moved the session to {server}: {where}"
                assert req.base_position != server, f"refused a round at the server's own position: {where}"
            tracked.position = server
        if result.code != "OK":
            return
        reply, k, vocab = result.reply, len(req.draft_tokens), tracked.vocab
        if tracked.position is not None:
            assert req.base_position == tracked.position, f"served a round at a wrong position: {where}"
        assert k <= MAX_K and len(req.committed_tokens) <= LIMITS.max_catchup_tokens, where
        assert all(0 <= t < vocab for t in [*req.draft_tokens, *req.committed_tokens]), f"accepted bad ids: {where}"
        assert all(0 < q <= 1 for q in req.draft_probs) and len(req.draft_probs) in (0, k), f"accepted bad q: {where}"
        assert reply.accepted_len <= k and reply.bonus == (reply.accepted_len == k), (reply, where)
        assert 0 <= reply.next_token < vocab, (reply, where)
        assert reply.new_base_position == req.base_position + len(req.committed_tokens) + reply.accepted_len + 1, where
        mask_bits = wire.unpack_mask(req.hard_mask, k) if req.hard_mask else []
        m = reply.metrics
        assert m.hard_tokens == sum(mask_bits), (m, where)
        assert all(math.isfinite(x) for x in (m.alpha_mean, m.la_over_k, m.verify_ms, m.queue_ms, m.forward_ms)), where
        assert -1e-6 <= m.alpha_mean <= 1 + 1e-6 and 0 <= m.la_over_k <= 1, (m, where)
        assert m.HasField("alpha_prefix") == (k > 0), (m, where)
        assert not k or (math.isfinite(m.alpha_prefix) and -1e-6 <= m.alpha_prefix <= 1 + 1e-6), (m, where)
        want = min(req.want_top_k, vocab)
        assert len(reply.target_top_k) == (reply.accepted_len + 1 if want else 0), (reply, where)
        for top in reply.target_top_k:
            assert len(top.token_ids) == len(top.probs) == want, (top, where)
            assert all(0 <= t < vocab for t in top.token_ids), (top, where)
            assert all(math.isfinite(q) and -1e-6 <= q <= 1 + 1e-6 for q in top.probs), (top, where)
            assert list(top.probs) == sorted(top.probs, reverse=True), (top, where)
        tracked.position, tracked.rounds = reply.new_base_position, tracked.rounds + 1

    def _after_CloseSession(self, req: pb.CloseSessionRequest, result: Result, timeout: float) -> None:
        tracked = self._tracked(req.session_id)
        where = f"{result.code} {result.details!r} for {_describe(req)}"
        if tracked is None:
            assert result.code != "OK", f"closed a session nobody opened: {where}"
            return
        if result.code == "OK":
            if tracked.position is not None:
                assert result.reply.position == tracked.position, f"closed at {result.reply.position}: {where}"
            assert result.reply.rounds >= tracked.rounds, (result.reply, where)
            self.pool.remove(tracked)
        elif result.code == "DEADLINE_EXCEEDED":
            self.pool.remove(tracked)  # closed or not: no longer tracked
        else:
            assert result.code != "NOT_FOUND", f"a session the fuzzer opened vanished: {where}"

    def _after_Generate(self, req: pb.GenerateRequest, result: Result, timeout: float) -> None:
        chunks, where = result.reply or [], _describe(req)
        vocab = req.vocab_size or VOCAB
        if chunks:
            assert req.prompt_tokens and all(0 <= t < vocab for t in req.prompt_tokens), f"accepted a bad prompt: {where}"
            assert len(req.reuse_token) <= 64 and len(chunks[0].reuse_token) == 32, f"a bad reuse token: {where}"
            assert 0 < req.max_new_tokens <= LIMITS.max_new_tokens, where
            assert len(req.prompt_tokens) + req.max_new_tokens <= LIMITS.max_context_tokens, where
        tokens = [t for chunk in chunks for t in chunk.tokens]
        assert all(chunk.tokens for chunk in chunks), where  # several when the reader fell behind
        assert all(0 <= t < vocab for t in tokens), (tokens, where)
        assert not any(chunk.finished for chunk in chunks[:-1]), where
        assert all(math.isfinite(chunk.forward_ms) for chunk in chunks), where
        if result.code == "OK" and not result.cut:
            assert chunks and chunks[-1].finished, f"a stream ended unfinished: {where}"
        if chunks and chunks[-1].finished:
            assert len(tokens) == req.max_new_tokens or tokens[-1] in req.stop_token_ids, (tokens, where)
            assert not any(t in req.stop_token_ids for t in tokens[:-1]), (tokens, where)
        assert len(tokens) <= req.max_new_tokens, (tokens, where)

    def _after_Decode(self, req: pb.DecodeRequest, result: Result, timeout: float) -> None:
        chunks: list[pb.DecodeChunk] = result.reply or []
        opening = req.HasField("open") and not req.session_id
        tracked = None if req.HasField("open") else self._tracked(req.session_id)
        where = f"{result.code} {result.details!r} after {len(chunks)} chunks for {_describe(req)}"
        where += f"\n  on {tracked}" if tracked else ""
        refusal = _decode_refusal(req, tracked)
        prompt = list(req.open.prompt_tokens)
        left = [sid for sid, tokens in result.created.items() if opening and prompt and tokens[: len(prompt)] == prompt]
        if tracked is not None and result.code == "NOT_FOUND":
            raise AssertionError(f"a session the fuzzer opened vanished: {where}")
        relearning = tracked is not None and tracked.position is None  # (a deadline cut its last call short)
        if result.code == "FAILED_PRECONDITION" and tracked is not None:
            server = int(result.trailing[wire.SERVER_POSITION_KEY])
            if tracked.position is not None:
                assert server == tracked.position, f"a failed request moved the session to {server}: {where}"
            tracked.position = server
        if not chunks:  # refused before its first token: the status the request and its session call for
            if refusal is not None:
                expected = {refusal}
            elif relearning:  # a position this side re-learns
                expected = {"FAILED_PRECONDITION", "INVALID_ARGUMENT"}
            else:
                expected = {"INVALID_ARGUMENT"} if opening else set()  # an opening's own fields
            if timeout < LONG_TIMEOUT:  # the deadline, or (a new session) admission, which refuses a late prefill
                expected |= {"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"} if opening else {"DEADLINE_EXCEEDED"}
            assert result.code in expected, f"expected {sorted(expected) or 'a stretch'}: {where}"
            if result.code != "DEADLINE_EXCEEDED" and left:
                for session_id in left:  # closed first, so that the cases after this one find the server clean
                    self.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=LONG_TIMEOUT)
                raise AssertionError(f"a refused Decode left a session behind ({len(left)}): {where}")
            if result.code == "DEADLINE_EXCEEDED" and tracked is not None:  # its first tokens may have run, unseen
                self._forget(tracked.session_id, tracked.position or 0, where)
            return
        # a stretch ran: the request was valid, and its chunks say where the session is
        assert refusal is None, f"streamed tokens for a request it must refuse ({refusal}): {where}"
        vocab = (req.open.vocab_size or VOCAB) if opening else tracked.vocab if tracked else VOCAB
        assert opening or tracked is not None, f"a stretch on a session nobody opened: {where}"
        assert 0 < req.max_tokens <= LIMITS.max_new_tokens, where
        assert all(0 <= t < VOCAB for t in req.stop_token_ids), f"accepted bad stop ids: {where}"
        assert len(req.committed_tokens) <= LIMITS.max_catchup_tokens, where
        assert all(0 <= t < vocab for t in req.committed_tokens), f"accepted bad catch-up: {where}"
        opened = chunks[0].opened
        if opening:
            assert chunks[0].HasField("opened"), f"an opening stretch's first chunk has no session: {where}"
            assert prompt and all(0 <= t < vocab for t in prompt), f"accepted a bad prompt: {where}"
            assert opened.position == len(prompt) <= LIMITS.max_context_tokens, (opened, where)
            assert opened.vocab_size == vocab and opened.max_draft_tokens == MAX_K, (opened, where)
            assert 0 < len(opened.session_id) <= 64, (opened, where)
            assert left == [opened.session_id], f"sessions stored {left}, opened {opened.session_id!r}: {where}"
            base = opened.position
        else:
            base = req.base_position
            if tracked is not None and tracked.position is not None:
                assert base == tracked.position, f"served a stretch at a wrong position: {where}"
        assert not any(chunk.HasField("opened") for chunk in chunks[1 if opening else 0 :]), where
        tokens = [t for chunk in chunks for t in chunk.tokens]
        assert all(chunk.tokens for chunk in chunks), where  # several when the reader fell behind
        assert all(0 <= t < vocab for t in tokens), (tokens, where)
        positions = [chunk.position for chunk in chunks]
        base += len(req.committed_tokens)
        assert positions == [base + n for n in itertools.accumulate(len(c.tokens) for c in chunks)], (positions, where)
        assert not any(chunk.finished for chunk in chunks[:-1]), where
        assert all(math.isfinite(c.forward_ms) and math.isfinite(c.step_ms) and c.step_ms >= 0 for c in chunks), where
        assert len(tokens) <= req.max_tokens, (tokens, where)
        last = chunks[-1]
        if last.finished:
            assert len(tokens) == req.max_tokens or tokens[-1] in req.stop_token_ids, (tokens, where)
            assert not any(t in req.stop_token_ids for t in tokens[:-1]), (tokens, where)
        if result.code == "OK" and not result.cut:
            assert last.finished, f"a stretch ended unfinished: {where}"
        elif result.code == "INVALID_ARGUMENT":  # the next token would pass the context limit
            assert last.position + 1 > LIMITS.max_context_tokens and not last.finished, f"a stretch stopped midway: {where}"
        elif result.code == "DEADLINE_EXCEEDED":
            assert timeout < LONG_TIMEOUT, where
        else:
            assert result.code == "OK", f"a stretch failed midway: {where}"
        # Where the session is: the last chunk's position once the stretch ended on the server's
        # side; after a cut or a deadline it may have run on, so the fuzzer closes it and forgets it.
        known = last.finished or (result.code in ("OK", "INVALID_ARGUMENT") and not result.cut)
        session_id = opened.session_id if opening else req.session_id
        if opening and known:
            mode = wire.config_from_pb(req.open.sampling, req.open.seed, req.open.accept_mode, req.open.vocab_size).accept_mode
            self._adopt(Tracked(session_id, mode, vocab, last.position, rounds=len(tokens)))  # a round a token
        elif tracked is not None and known:
            tracked.position, tracked.rounds = last.position, tracked.rounds + len(tokens)
        else:
            self._forget(session_id, last.position, where)

    # ---- the pool of sessions the fuzzer opened ---------------------------------------------------

    def _forget(self, session_id: str, at_least: int, where: str) -> None:
        """Close a session whose position this side no longer knows (a Decode stretch cut midway,
        or past its deadline, may have run on): it is at `at_least` or further."""
        if (tracked := self._tracked(session_id)) is not None:
            self.pool.remove(tracked)
        closed = self.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=LONG_TIMEOUT)
        self.setup_calls += 1
        assert closed.position >= at_least, f"closed at {closed.position}: {where}"

    def _adopt(self, tracked: Tracked) -> None:
        self.pool.append(tracked)
        while len(self.pool) > POOL_MAX:
            oldest = self.pool.pop(0)
            closed = self.stub.CloseSession(pb.CloseSessionRequest(session_id=oldest.session_id), timeout=LONG_TIMEOUT)
            self.setup_calls += 1
            assert oldest.position is None or closed.position == oldest.position, (closed, oldest)

    def ensure_pool(self) -> None:
        """At least one tracked session of every accept mode, greedy ones in a smaller vocabulary too."""
        for i, mode in enumerate(MODES):
            if mode in self.refused_modes or any(t.mode is mode for t in self.pool):
                continue
            sampling = (
                pb.SamplingConfig()
                if mode is AcceptMode.GREEDY
                else pb.SamplingConfig(
                    temperature=0.9, top_k=40 if i % 2 else 0, top_p=0.95, repetition_penalty=1.1 if i % 3 else 0
                )
            )
            vocab = 64 if i % 2 else VOCAB
            prompt = [t % vocab for t in random_prompt(100 + len(self.pool) + self.setup_calls, 8)]
            req = pb.OpenSessionRequest(
                prompt_tokens=prompt,
                sampling=sampling,
                seed=i,
                vocab_size=vocab,
                accept_mode=MODE_TO_PB.get(mode, pb.ACCEPT_MODE_UNSPECIFIED),
            )
            try:
                reply = self.stub.OpenSession(req, timeout=LONG_TIMEOUT)
            except grpc.RpcError as err:  # an engine that verifies only the exact modes refuses the others
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION or mode.exact:
                    raise
                self.refused_modes.add(mode)
                continue
            finally:
                self.setup_calls += 1
            self._adopt(Tracked(reply.session_id, mode, vocab, reply.position))

    def pick(self, n: int) -> Tracked:
        self.ensure_pool()
        return self.pool[n % len(self.pool)]

    def histogram(self) -> dict[str, Any]:
        total: Counter[str] = Counter()
        for counts in self.codes.values():
            total.update(counts)
        return {
            "cases": self.cases,
            "by_code": dict(total.most_common()),
            "by_method": {m: dict(c.most_common()) for m, c in sorted(self.codes.items())},
            "bystander_rounds": self.bystander.rounds,
            "bystander_reopened": self.bystander.reopened,
            "setup_calls": self.setup_calls,
            "examples_per_property": EXAMPLES or "default",
            "details": dict(sorted(self.details.items())),
            "elapsed_s": round(time.perf_counter() - self.started, 1),
        }


@pytest.fixture(scope="module")
def fuzz(target_engine: TargetEngine, request: pytest.FixtureRequest) -> Iterator[Fuzz]:
    """The fuzzed verifier, on each engine (the properties' examples run once per engine)."""
    reference = _reference(target_engine)
    logger = logging.getLogger("cloud-verifier")
    level = logger.level
    logger.setLevel(logging.ERROR)  # a WARNING per refused call is thousands of lines; bugs log at ERROR
    server = ServerThread(Verifier(target_engine(), "tiny-target", _limits(target_engine)))
    state = Fuzz(server, reference)
    try:
        state.alive()
        state.bystander.open()
        yield state
    finally:
        report = state.histogram()
        state.channel.close()
        server.close()
        logger.setLevel(level)
        text = json.dumps(report, indent=1)
        if path := os.environ.get("SPECDEC_FUZZ_REPORT"):
            with open(path, "w") as out:
                out.write(text + "\n")
        capture = request.config.pluginmanager.getplugin("capturemanager")
        terminal = request.config.pluginmanager.getplugin("terminalreporter")
        if terminal is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                terminal.write_line(f"\nfuzz status histogram: {text}")


# ---- the properties -----------------------------------------------------------------------------


@_budget(70)
@given(req=open_requests(), timeout=TIMEOUTS, metadata=METADATA)
def test_open_session_fuzz(fuzz: Fuzz, req: pb.OpenSessionRequest, timeout: float, metadata: Any) -> None:
    fuzz.case("OpenSession", "OpenSession", req, lambda: _unary(fuzz.stub.OpenSession, req, timeout, metadata), timeout)


@_budget(120)
@given(plan=verify_plans(), pick=st.integers(0, 2**16), real=st.integers(0, 19), timeout=TIMEOUTS, metadata=METADATA)
def test_verify_fuzz(
    fuzz: Fuzz, plan: Callable[[Tracked | None], pb.VerifyRequest], pick: int, real: int, timeout: float, metadata: Any
) -> None:
    req = plan(fuzz.pick(pick) if real < 19 else None)  # one case in 20 aims at no real session at all
    fuzz.case("Verify", "Verify", req, lambda: _unary(fuzz.stub.Verify, req, timeout, metadata), timeout)


@_budget(30)
@given(plan=session_id_plans(), pick=st.integers(0, 2**16), timeout=TIMEOUTS, metadata=METADATA)
def test_close_session_fuzz(fuzz: Fuzz, plan: Callable[[str | None], str], pick: int, timeout: float, metadata: Any) -> None:
    req = pb.CloseSessionRequest(session_id=plan(fuzz.pick(pick).session_id))
    fuzz.case("CloseSession", "CloseSession", req, lambda: _unary(fuzz.stub.CloseSession, req, timeout, metadata), timeout)


@_budget(50)
@given(req=generate_requests(), chunks=st.integers(1, MAX_CHUNKS), timeout=TIMEOUTS, metadata=METADATA)
def test_generate_fuzz(fuzz: Fuzz, req: pb.GenerateRequest, chunks: int, timeout: float, metadata: Any) -> None:
    fuzz.case("Generate", "Generate", req, lambda: _stream(fuzz.stub.Generate, req, timeout, metadata, chunks), timeout)


@_budget(50)
@given(
    plan=decode_plans(),
    pick=st.integers(0, 2**16),
    real=st.integers(0, 19),
    chunks=st.integers(1, MAX_CHUNKS),
    timeout=TIMEOUTS,
    metadata=METADATA,
)
def test_decode_fuzz(
    fuzz: Fuzz,
    plan: Callable[[Tracked | None], pb.DecodeRequest],
    pick: int,
    real: int,
    chunks: int,
    timeout: float,
    metadata: Any,
) -> None:
    req = plan(fuzz.pick(pick) if real < 19 else None)  # one case in 20 aims at no real session at all
    fuzz.case("Decode", "Decode", req, lambda: _stream(fuzz.stub.Decode, req, timeout, metadata, chunks), timeout)


@st.composite
def raw_plans(draw: Any) -> tuple[str, Callable[[Tracked], bytes]]:
    method = draw(st.sampled_from(METHODS))
    if method == "OpenSession":
        message = draw(open_requests())
        valid: Callable[[Tracked], Message] = lambda target: message  # noqa: E731
    elif method == "Generate":
        message = draw(generate_requests())
        valid = lambda target: message  # noqa: E731
    elif method == "Verify":
        valid = draw(verify_plans())
    elif method == "Decode":
        valid = draw(decode_plans())
    else:
        sid = draw(session_id_plans())
        valid = lambda target: pb.CloseSessionRequest(session_id=sid(target.session_id))  # noqa: E731
    frame = draw(frame_plans(method))
    return method, lambda target: frame(valid(target).SerializeToString())


@_budget(100)
@given(plan=raw_plans(), pick=st.integers(0, 2**16), timeout=TIMEOUTS)
def test_raw_frames_fuzz(fuzz: Fuzz, plan: tuple[str, Callable[[Tracked], bytes]], pick: int, timeout: float) -> None:
    method, build = plan
    frame = build(fuzz.pick(pick))
    send = (
        (lambda: _stream(fuzz.raw[method], frame, timeout, ()))
        if method in STREAMING
        else (lambda: _unary(fuzz.raw[method], frame, timeout, ()))
    )
    fuzz.case(method, f"raw {method}", frame, send, timeout)


def test_bystander_unchanged_after_the_fuzzing(fuzz: Fuzz) -> None:
    """After everything above: the bystander's rounds, a fresh session's k = 0 rounds, a greedy
    Generate and a greedy session decoded by Decode stretches between k = 0 rounds on the fuzzed
    server give what a fresh verifier gives."""
    for _ in range(6):
        fuzz.bystander.round()
    fresh = Bystander(fuzz.stub, fuzz.reference)
    fresh.open()
    rounds = [
        fuzz.stub.Verify(
            pb.VerifyRequest(session_id=fresh.session_id, base_position=len(fresh.ref.prompt) + i), timeout=LONG_TIMEOUT
        ).next_token
        for i in range(len(fuzz.reference.rounds))
    ]
    assert rounds == fuzz.reference.rounds
    generate = pb.GenerateRequest(
        prompt_tokens=fuzz.reference.prompt, vocab_size=VOCAB, max_new_tokens=len(fuzz.reference.generated)
    )
    tokens = [t for chunk in fuzz.stub.Generate(generate, timeout=LONG_TIMEOUT) for t in chunk.tokens]
    assert tokens == fuzz.reference.generated
    assert _decoded(fuzz) == fuzz.reference.rounds
    fuzz.alive()


def _decoded(fuzz: Fuzz) -> list[int]:
    """The reference prompt's greedy continuation through Decode on the fuzzed server: a stretch
    that opens the session, k = 0 Verify rounds, a stretch that sends two reference tokens as
    catch-up, and a last stretch; each must continue exactly where the one before it left off."""
    prompt, want = fuzz.reference.prompt, fuzz.reference.rounds
    third = len(want) // 3

    def stretch(req: pb.DecodeRequest) -> list[int]:
        chunks = list(fuzz.stub.Decode(req, timeout=LONG_TIMEOUT))
        decoded = [t for chunk in chunks for t in chunk.tokens]
        assert chunks[-1].finished and chunks[-1].position == len(prompt) + len(tokens) + len(req.committed_tokens) + len(decoded)
        return decoded

    tokens: list[int] = []
    opening = pb.DecodeRequest(open=pb.OpenSessionRequest(prompt_tokens=prompt, vocab_size=VOCAB), max_tokens=third)
    chunks = list(fuzz.stub.Decode(opening, timeout=LONG_TIMEOUT))
    session_id = chunks[0].opened.session_id
    tokens += [t for chunk in chunks for t in chunk.tokens]
    for _ in range(third):
        tokens.append(
            fuzz.stub.Verify(
                pb.VerifyRequest(session_id=session_id, base_position=len(prompt) + len(tokens)), timeout=LONG_TIMEOUT
            ).next_token
        )
    catchup = want[len(tokens) : len(tokens) + 2]
    req = pb.DecodeRequest(session_id=session_id, base_position=len(prompt) + len(tokens), committed_tokens=catchup)
    req.max_tokens = (len(want) - len(tokens) - len(catchup)) // 2
    tokens += catchup + stretch(req)
    req = pb.DecodeRequest(session_id=session_id, base_position=len(prompt) + len(tokens), max_tokens=len(want) - len(tokens))
    tokens += stretch(req)
    closed = fuzz.stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=LONG_TIMEOUT)
    assert closed.position == len(prompt) + len(want), closed
    return tokens
