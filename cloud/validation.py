"""What the verifier accepts: every request checked against its limits and the model before
any model work, so a bad request fails alone with INVALID_ARGUMENT (or FAILED_PRECONDITION
for a round at the wrong position)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cloud.sessions import Session
from shared.errors import InvalidRequest, PositionMismatch
from shared.grammar import MAX_GRAMMAR_BYTES, MAX_STOP_IDS
from shared.protocol import AcceptMode, DecodeRequest, GenerateRequest, GrammarSpec, SessionConfig, VerifyRequest

if TYPE_CHECKING:
    from cloud.verifier import VerifierLimits

# Temperature and repetition penalty divide or multiply logits: inside this range every
# logit stays finite in fp32 (|logit| <= 1e2 -> at most 1e8), outside it softmax meets inf.
SAMPLING_RANGE = (1e-3, 1e3)


def check_ids(what: str, ids: list[int], vocab: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"{what} has ids outside [0, {vocab}): {bad[:5]}")


@dataclass(frozen=True)
class RequestChecks:
    """The checks of one verifier: its limits and its model's vocabulary."""

    limits: VerifierLimits
    model_vocab: int

    def vocab(self, config: SessionConfig) -> int:
        """The vocabulary a session samples from: its own, at most the model's."""
        if config.vocab_size > self.model_vocab:
            raise InvalidRequest(f"vocab_size {config.vocab_size} exceeds the model's {self.model_vocab}")
        return config.vocab_size or self.model_vocab

    def session(self, config: SessionConfig, prompt: list[int]) -> int:
        """A new session or stream: settings that sample finitely (outside these ranges
        logits overflow to inf and the probabilities to NaN) and a prompt that fits; its vocabulary."""
        s = config.sampling
        low, high = SAMPLING_RANGE
        if not (s.temperature == 0 or low <= s.temperature <= high):
            raise InvalidRequest(f"temperature must be 0 (greedy) or in [{low:g}, {high:g}]")
        if not low <= s.repetition_penalty <= high:
            raise InvalidRequest(f"repetition_penalty must be in [{low:g}, {high:g}] (1 = off)")
        if not 0 < s.top_p <= 1:
            raise InvalidRequest("top_p must be in (0, 1] (1 = off)")
        if s.top_k < 0:
            raise InvalidRequest("top_k must be >= 0 (0 = off)")
        vocab = self.vocab(config)
        if not prompt:
            raise InvalidRequest("prompt_tokens is empty")
        if len(prompt) > self.limits.max_context_tokens:
            raise InvalidRequest(f"prompt has {len(prompt)} tokens, limit {self.limits.max_context_tokens}")
        check_ids("prompt_tokens", prompt, vocab)
        if config.grammar is not None:
            _check_grammar(config.grammar, vocab, len(prompt))
        return vocab

    def generate(self, req: GenerateRequest) -> int:
        """A Generate call; its vocabulary."""
        vocab = self.session(req.config, req.prompt_tokens)
        if not 0 < req.max_new_tokens <= self.limits.max_new_tokens:
            raise InvalidRequest(f"max_new_tokens must be in [1, {self.limits.max_new_tokens}]")
        check_ids("stop_token_ids", req.stop_token_ids, self.model_vocab)
        if len(req.prompt_tokens) + req.max_new_tokens > self.limits.max_context_tokens:
            raise InvalidRequest(f"prompt + max_new_tokens pass the context limit {self.limits.max_context_tokens}")
        return vocab

    def decode(self, req: DecodeRequest) -> None:
        """A Decode stretch's own fields; its opening is checked as a session's, and each of its
        tokens as a round with no drafts."""
        if not 0 < req.max_tokens <= self.limits.max_new_tokens:
            raise InvalidRequest(f"max_tokens must be in [1, {self.limits.max_new_tokens}]")
        check_ids("stop_token_ids", req.stop_token_ids, self.model_vocab)
        if req.open is None:
            return
        if req.committed_tokens:
            raise InvalidRequest("a Decode call that opens its session sends no committed_tokens: they belong in the prompt")
        if len(req.open.prompt_tokens) + 1 > self.limits.max_context_tokens:
            limit = self.limits.max_context_tokens
            raise InvalidRequest(f"the prompt leaves no room for a token within the context limit {limit}")

    def verify(self, req: VerifyRequest, session: Session) -> None:
        """A round against its session as it is now."""
        if req.base_position != len(session.tokens):
            raise PositionMismatch(
                f"base_position {req.base_position} != server position {len(session.tokens)}", len(session.tokens)
            )
        vocab = self.vocab(session.config)
        k = len(req.draft_tokens)
        if k > self.limits.max_draft_tokens:
            raise InvalidRequest(f"{k} draft tokens, limit {self.limits.max_draft_tokens}")
        if len(req.committed_tokens) > self.limits.max_catchup_tokens:
            raise InvalidRequest(f"{len(req.committed_tokens)} catch-up tokens, limit {self.limits.max_catchup_tokens}")
        if len(session.tokens) + len(req.committed_tokens) + k + 1 > self.limits.max_context_tokens:
            raise InvalidRequest(f"the round would pass the context limit {self.limits.max_context_tokens}")
        check_ids("draft_tokens", req.draft_tokens, vocab)
        check_ids("committed_tokens", req.committed_tokens, vocab)
        if req.draft_probs and len(req.draft_probs) != k:
            raise InvalidRequest(f"{len(req.draft_probs)} draft_probs for {k} draft tokens")
        if any(not 0.0 < q <= 1.0 for q in req.draft_probs):
            raise InvalidRequest("draft_probs must lie in (0, 1]")
        if req.want_top_k > self.limits.max_top_k:
            raise InvalidRequest(f"want_top_k {req.want_top_k}, limit {self.limits.max_top_k}")
        _check_mode_inputs(req, session.config.accept_mode, vocab)


def _check_grammar(grammar: GrammarSpec, vocab: int, prompt: int) -> None:
    """A grammar's size and stop ids; what it costs is checked as it compiles (shared/grammar.py)."""
    if not grammar.text or len(grammar.text.encode()) > MAX_GRAMMAR_BYTES:
        raise InvalidRequest(f"grammar.text must hold 1 to {MAX_GRAMMAR_BYTES} bytes")
    if not 1 <= len(grammar.stop_ids) <= MAX_STOP_IDS:
        raise InvalidRequest(f"grammar.stop_token_ids must hold 1 to {MAX_STOP_IDS} ids")
    check_ids("grammar.stop_token_ids", list(grammar.stop_ids), vocab)
    if grammar.generated >= prompt:
        raise InvalidRequest("grammar.generated must be less than the prompt's length")


def _check_mode_inputs(req: VerifyRequest, mode: AcceptMode, vocab: int) -> None:
    """What the session's accept mode needs with each draft token: q(y), or a sparse support."""
    k = len(req.draft_tokens)
    if mode in (AcceptMode.SCALAR, AcceptMode.SHORTCUT) and len(req.draft_probs) != k:
        raise InvalidRequest(f"{mode.value} mode needs draft_probs for every draft token")
    if mode is not AcceptMode.SPARSE:
        if req.sparse_draft:
            raise InvalidRequest(f"sparse_draft sent to a {mode.value}-mode session")
        return
    if len(req.sparse_draft) != k:
        raise InvalidRequest(f"sparse mode needs one sparse_draft per draft token, got {len(req.sparse_draft)} for {k}")
    for i, (dist, token) in enumerate(zip(req.sparse_draft, req.draft_tokens, strict=True)):
        check_ids(f"sparse_draft[{i}]", dist.token_ids, vocab)
        if len(dist.probs) != len(dist.token_ids) or len(set(dist.token_ids)) != len(dist.token_ids):
            raise InvalidRequest(f"sparse_draft[{i}] needs unique ids and one prob each")
        if any(not 0.0 <= q <= 1.0 for q in dist.probs) or abs(sum(dist.probs) - 1.0) > 1e-3:
            raise InvalidRequest(f"sparse_draft[{i}] probs must lie in [0, 1] and sum to 1")
        support = dict(zip(dist.token_ids, dist.probs, strict=True))
        if support.get(token, 0.0) <= 0.0:
            raise InvalidRequest(f"draft token {i} has no probability in its sparse_draft")
