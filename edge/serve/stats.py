"""Per-request speculation stats of `edge-agent serve`: the `speculative_decoding` object of
a response (and of a stream's last chunk), from the generation's result and round log.

Words as in vLLM's rejection sampler: *accepted* draft tokens, and per round one more token
from the target (the recovered token on a rejection, the bonus when every draft passed);
tau, the mean tokens per round, counts that one.
"""

from __future__ import annotations

from typing import Any

from edge.config import EdgeSettings
from edge.round.generate import GenerationResult


def per_position(result: GenerationResult) -> tuple[list[int], list[int]]:
    """(drafted, accepted) counts per draft position over the rounds sent to the cloud."""
    longest = max((r.k for r in result.round_log if not r.local), default=0)
    drafted, accepted = [0] * longest, [0] * longest
    for record in result.round_log:
        if record.local:
            continue
        for i in range(record.k):
            drafted[i] += 1
            accepted[i] += i < record.accepted_len
    return drafted, accepted


def _why_not(settings: EdgeSettings, disabled_by_request: bool, result: GenerationResult) -> str | None:
    if disabled_by_request:
        return "disabled by the request (speculative.enabled false)"
    if not settings.drafts():
        return f"the server runs --mode {settings.mode}"
    if result.draft_tokens == 0 and settings.mode == "auto":
        return "auto mode decoded on the target throughout (mode_switches says why)"
    if result.draft_tokens == 0:
        return "nothing was drafted (no room before max_tokens, or the drafter proposed nothing)"
    return None


def speculation_stats(
    result: GenerationResult,
    settings: EdgeSettings,
    disabled_by_request: bool,
    draft_prompt: tuple[int, int] = (0, 0),
    k_costs_rounds: int | None = None,
) -> dict[str, Any]:
    """draft_prompt: the prompt tokens whose draft KV came from the conversation cache, and
    those the draft model computed; k_costs_rounds: the rounds whose figures the cost k policy
    started from (None: another policy)."""
    speculative = settings.drafts()
    reason = _why_not(settings, disabled_by_request, result)
    verified = result.verified_speculative_tokens()
    drafted, accepted = per_position(result)
    mode = settings.resolved_accept_mode()
    return {
        "ran": reason is None,
        "reason": reason,
        "mode": settings.mode,
        "drafter": settings.drafter if speculative else None,
        "k_policy": settings.resolved_k_policy() if speculative else None,
        "k": settings.fixed_k() if speculative and settings.resolved_k_policy() == "fixed" else None,
        "k_costs_rounds": k_costs_rounds,
        "accept_mode": mode.value,
        "seed": settings.seed,
        # Exact: the text is distributed as the target's own (greedy: equal to it).
        "exact": mode.exact and not (result.local_tokens or result.unverified_tokens),
        "rounds": result.rounds,
        "draft_tokens": result.draft_tokens,
        "accepted_tokens": result.accepted_tokens,
        "acceptance_rate": round(result.accepted_tokens / result.draft_tokens, 4) if result.draft_tokens else None,
        "tau": round(verified / result.rounds, 4) if result.rounds else None,
        "drafted_per_position": drafted,
        "accepted_per_position": accepted,
        "acceptance_per_position": [round(a / d, 4) if d else None for a, d in zip(accepted, drafted, strict=True)],
        "drafted_by": result.drafted_by,
        "accepted_by": result.accepted_by,
        "target_forward_passes": result.target_forward_passes,
        "draft_reused_tokens": draft_prompt[0],
        "draft_prefilled_tokens": draft_prompt[1],
        "bytes_up": result.bytes_up,
        "bytes_down": result.bytes_down,
        "verify_bytes_up": result.verify_bytes_up,
        "verify_bytes_down": result.verify_bytes_down,
        "provisional_tokens": result.provisional_tokens,
        "retracted_tokens": result.retracted_tokens,
        "unverified_tokens": result.unverified_tokens,
        "local_tokens": result.local_tokens,
        "reopens": result.reopens,
        # auto mode: the tokens of each mode, and every switch with its reason
        "tokens_by_mode": result.tokens_by_mode,
        "mode_switches": result.mode_switches,
        "ttft_s": round(result.ttft_s, 4),
        "elapsed_s": round(result.elapsed_s, 4),
    }


def usage(prompt_tokens: int, result: GenerationResult) -> dict[str, int]:
    completion = len(result.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
