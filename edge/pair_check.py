"""The draft against the verifier's target, before the first session.

The edge tokenizes for the target, so both must share one tokenizer: the same token at every id
and the same special tokens. The verifier's Describe sends its tokenizer as block digests; the
edge compares them with its own, fetches the first block that differs and names the first id
whose token differs, in one line. When the chat templates differ (a base draft beside an
instruct target, or two releases of one family), the edge renders prompts with the target's:
the target writes the answer. Then one startup line: the two models, their size ratio and the measured
c, a draft token's time over one target decode step, with a hint when c is too high for
speculation to pay.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

from edge.context import EdgeContext
from edge.drafting.drafter import DraftLM
from edge.transport.client import VerifierClient
from shared.errors import CloudUnavailable, ConfigError
from shared.protocol import ModelDescription
from shared.tokenizer_card import TokenizerCard, first_token_difference, shown_token, special_difference

log = logging.getLogger("edge-agent")

# Above this, a draft token costs more than half a target step: with the acceptance a good pair
# reaches (70-80% per token), no k then saves more than a few percent over the target alone.
C_PAYS = 0.5
WARMUP_TOKENS = 8
TIMED_STEPS = 3


@dataclass(frozen=True)
class PairCheck:
    line: str | None  # the startup line (None: the verifier could not describe its model)
    chat_template: str | None = None  # the target's, when it differs from the draft's: render with it


async def check_pair(ctx: EdgeContext, client: VerifierClient) -> PairCheck:
    """Raise ConfigError (one line) when the tokenizers differ. When the chat templates differ,
    the target's is the one to render prompts with (the target generates the answer)."""
    try:
        target = await client.describe()
    except CloudUnavailable as err:  # the sessions' own retries deal with an absent verifier
        log.warning("the verifier could not be asked about its model (%s): tokenizers not compared", err)
        return PairCheck(None)
    if target is None:
        log.info("the verifier does not describe its model (an older version): tokenizers not compared")
        return PairCheck(None)
    if not target.has_tokenizer:
        log.info("the verifier's model has no tokenizer.json beside it: tokenizers not compared")
        return PairCheck(pair_line(ctx, target))
    draft = TokenizerCard.of(ctx.tokenizer.backend, ctx.tokenizer.chat_template)
    await _same_tokens(draft, target, client, ctx.draft_name)
    if (difference := special_difference(draft.specials, target.special_tokens)) is not None:
        raise ConfigError(f"the draft's tokenizer is not the target's: {difference} ({ctx.draft_name} / {target.model_id})")
    template = None
    if target.chat_template_sha256 and draft.template_digest() != target.chat_template_sha256:
        described = await client.describe(chat_template=True)
        template = described.chat_template if described else None
        log.info("the draft's chat template differs from the target's: prompts are rendered with the target's")
    return PairCheck(pair_line(ctx, target), template or None)


def apply_pair_check(ctx: EdgeContext, check: PairCheck) -> None:
    """Log the startup line; render prompts with the target's chat template when it differs."""
    if check.line:
        log.info("%s", check.line)
    if check.chat_template is not None:
        ctx.tokenizer.use_chat_template(check.chat_template)


async def _same_tokens(draft: TokenizerCard, target: ModelDescription, client: VerifierClient, draft_name: str) -> None:
    digests = draft.digests()
    for index in range(max(len(digests), len(target.block_digests))):
        mine = digests[index] if index < len(digests) else None
        theirs = target.block_digests[index] if index < len(target.block_digests) else None
        if mine == theirs:
            continue
        start = index * target.block_size
        fetched = await client.describe(start, target.block_size) if theirs is not None else None
        found = first_token_difference(draft.block(index), fetched.tokens if fetched else (), offset=start)
        if found is None:  # digests differ, tokens not: cannot be, unless the verifier changed meanwhile
            continue
        token_id, a, b = found
        raise ConfigError(
            f"the draft's tokenizer is not the target's: id {token_id} is {shown_token(a)} in the draft ({draft_name}), "
            f"{shown_token(b)} in the target ({target.model_id}); use a draft of the target's model family"
        )


def pair_line(ctx: EdgeContext, target: ModelDescription) -> str:
    """`draft X (494M) / target Y (1.54B): size ratio 0.32, c = 0.21 (...)`, and a hint when c is high."""
    lm = ctx.draft_lm
    parts = [f"draft {ctx.draft_name}" + (f" ({_count(lm.parameters)})" if lm else " (no draft model)")]
    parts.append(f"target {target.model_id}" + (f" ({_count(target.parameters)})" if target.parameters else ""))
    line = " / ".join(parts)
    if lm is None or not target.parameters:
        return line
    line += f": size ratio {lm.parameters / target.parameters:.2f}"
    if target.decode_step_ms <= 0:
        return line
    step_ms = draft_step_ms(lm)
    c = step_ms / target.decode_step_ms
    line += f", c = {c:.2f} (a draft token {step_ms:.1f} ms, a target step {target.decode_step_ms:.1f} ms)"
    if c > C_PAYS:
        line += (
            f"; c above {C_PAYS} means a draft token costs over half a target step: speculation gains little "
            "with this pair on this machine (auto mode decodes on the target when speculating does not pay)"
        )
    return line


def _count(parameters: int) -> str:
    """1.54B, 494M, 42K parameters."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if parameters >= scale:
            return f"{parameters / scale:.3g}{unit}"
    return str(parameters)


def draft_step_ms(lm: DraftLM) -> float:
    """One draft token's time: a short prefill, then the median of a few single-token steps."""
    cache = lm.new_cache(0)
    cache.feed([0] * WARMUP_TOKENS)
    times = []
    for _ in range(TIMED_STEPS):
        start = time.perf_counter()
        cache.feed([0])
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)
