"""Grammars that constrain what a generation may say (a JSON schema, a tool call's envelope),
in llguidance: one grammar, one tokenizer file and one set of stop ids on both sides.

Why llguidance: MIT-licensed, no Python dependencies (the edge stays torch-free), masks in tens
of microseconds on one CPU core for a 152k vocabulary, unlimited rollback (a round's drafts are
consumed, then taken back), and resource limits that bound what a hostile grammar can cost
(`GRAMMAR_LIMITS`). xgrammar needs torch and triton; outlines-core compiles JSON schemas to one
regular expression (no recursion, minutes for large schemas).

The edge masks its draft model with the grammar and the verifier masks the target with the
same grammar at every verified position (row i after the committed tokens and drafts 1..i), so
the accept/reject test compares the *constrained* target with the draft's true, constrained q:
the output is the target's own constrained distribution (greedy: the target alone under the
grammar, token for token).

A grammar is llguidance's grammar text: what `json_schema_grammar` and `lark_grammar` return
(JSON of its TopLevelGrammar) or a Lark grammar with `%json{...}` inside.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.errors import InvalidParameter

MAX_GRAMMAR_BYTES = 64 * 1024  # the grammar text a session may carry
MAX_STOP_IDS = 8  # stop ids the grammar ends with


def _limits() -> Any:
    """What one grammar may cost: its size, the lexer's work to build it and per token, the
    parser's items per token. Tighter than llguidance's defaults (a compile stays well under a
    second, a mask step under a few ms); verbose errors off, so that no error echoes the grammar."""
    from llguidance import LLParserLimits

    return LLParserLimits(
        max_items_in_row=500,
        initial_lexer_fuel=200_000,
        step_lexer_fuel=100_000,
        step_max_items=20_000,
        max_lexer_states=50_000,
        max_grammar_size=50_000,
        verbose_errors=False,
    )


class GrammarRefused(InvalidParameter):
    """A grammar that does not compile, or costs more than the limits allow."""


def json_schema_grammar(schema: dict[str, Any] | bool, *, compact: bool = True) -> str:
    """The grammar of JSON values valid under `schema` (Draft 2020-12, llguidance's subset:
    objects with properties in the schema's order, arrays, enums, consts, anyOf, local $refs,
    string patterns and formats, number bounds). compact: no whitespace between tokens (what a
    model writes most likely is then the only choice, and forced tokens ride free)."""
    from llguidance import LLMatcher

    try:
        return str(LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": not compact}))
    except (ValueError, TypeError) as err:
        raise GrammarRefused(f"not a JSON schema: {_short(err)}", None) from None


def lark_grammar(lark: str) -> str:
    """A Lark grammar (llguidance's dialect: `%json{schema}` for a JSON value inside)."""
    from llguidance import LLMatcher

    return str(LLMatcher.grammar_from_lark(lark))


def _short(err: BaseException | str, limit: int = 200) -> str:
    return " ".join(str(err).split())[:limit]


class GrammarVocab:
    """A tokenizer as grammars see it: each id's bytes, the ids that end a generation, and the
    width of the masks (the session's vocabulary). Building it reads every token (about half a
    second for 152k tokens): build once per tokenizer and keep it."""

    def __init__(self, tokenizer_json: str, vocab: int, stop_ids: Sequence[int]) -> None:
        from llguidance import LLTokenizer

        stops = sorted(set(stop_ids))
        if not stops:
            raise GrammarRefused("a grammar needs the tokens that end a generation (none given)", None)
        self.vocab, self.stop_ids = vocab, tuple(stops)
        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=stops)
        self.words = (vocab + 31) // 32  # int32 words per mask row

    def compile(self, grammar: str) -> Grammar:
        """The grammar, checked against the limits; GrammarRefused says why it is not one."""
        from llguidance import LLMatcher

        if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
            raise GrammarRefused(f"the grammar is larger than {MAX_GRAMMAR_BYTES} bytes", None)
        error = LLMatcher.validate_grammar(grammar, self.tokenizer, limits=_limits())
        if error:
            raise GrammarRefused(f"the grammar was refused: {_short(error)}", None)
        return Grammar(self, grammar)


class VocabCache:
    """GrammarVocabs by (vocabulary, stop ids), built on first use, a few at most (one process
    serves one tokenizer)."""

    def __init__(self, tokenizer_json: str, capacity: int = 4) -> None:
        self.tokenizer_json, self.capacity = tokenizer_json, capacity
        self._vocabs: dict[tuple[int, tuple[int, ...]], GrammarVocab] = {}
        self._lock = threading.Lock()  # built from worker threads

    def get(self, vocab: int, stop_ids: Sequence[int]) -> GrammarVocab:
        key = (vocab, tuple(sorted(set(stop_ids))))
        with self._lock:
            found = self._vocabs.get(key)
            if found is None:
                found = GrammarVocab(self.tokenizer_json, vocab, stop_ids)
                if len(self._vocabs) >= self.capacity:
                    self._vocabs.pop(next(iter(self._vocabs)))
                self._vocabs[key] = found
            return found


@dataclass(frozen=True)
class Grammar:
    """A checked grammar on its vocabulary: what every session of it starts from."""

    vocab: GrammarVocab
    text: str

    def start(self) -> Constraint:
        return Constraint(self)


class Constraint:
    """One generation's place in its grammar: the tokens generated so far (after the prompt)
    consumed. Drafts are consumed to read the masks after them and taken back; `sync` moves
    the place to any committed sequence (rolling back to the shared prefix)."""

    def __init__(self, grammar: Grammar) -> None:
        from llguidance import LLMatcher

        self.grammar, self.vocab = grammar, grammar.vocab
        self.matcher = LLMatcher(grammar.vocab.tokenizer, grammar.text, log_level=0, limits=_limits())
        self.consumed: list[int] = []
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarRefused(f"the grammar failed: {_short(self.matcher.get_error())}", None)

    def sync(self, generated: Sequence[int]) -> None:
        """Move to `generated` (every token after the prompt): roll back to the shared prefix,
        consume the rest. GrammarRefused when a token is not the grammar's."""
        keep = 0
        limit = min(len(self.consumed), len(generated))
        if self.consumed[:limit] == list(generated[:limit]):
            keep = limit
        else:
            while keep < limit and self.consumed[keep] == generated[keep]:
                keep += 1
        self._rollback(len(self.consumed) - keep)
        rest = list(generated[keep:])
        if rest:
            taken = self.matcher.try_consume_tokens(rest)
            self.consumed.extend(rest[:taken])
            if taken < len(rest):
                raise GrammarRefused(f"token {rest[taken]} breaks the grammar after {len(self.consumed)} tokens", None)

    def _rollback(self, count: int) -> None:
        if count > 0:
            if not self.matcher.rollback(count):
                self._check()
            del self.consumed[len(self.consumed) - count :]

    def allowed(self) -> np.ndarray:  # [vocab] bool: the tokens the grammar allows next
        return unpack(self.mask_rows([])[0], self.vocab.vocab)

    def mask_rows(self, drafts: Sequence[int]) -> np.ndarray:
        """[len(drafts) + 1, words] int32 bitmasks: row i allows what may follow the committed
        tokens and drafts[:i]. After the first draft the grammar refuses, the rows allow
        everything (that draft's own row already rejects it; the rows after are never read)."""
        import llguidance.numpy as lln

        rows = lln.allocate_token_bitmask(len(drafts) + 1, self.vocab.vocab)
        lln.fill_next_token_bitmask(self.matcher, rows, 0)
        taken = 0
        for i, token in enumerate(drafts):
            if not self.matcher.try_consume_tokens([int(token)]):
                break
            taken += 1
            lln.fill_next_token_bitmask(self.matcher, rows, i + 1)
        if taken:
            self.matcher.rollback(taken)
        return rows

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many of the drafts the grammar allows, in order."""
        return int(self.matcher.validate_tokens([int(t) for t in drafts])) if drafts else 0

    def push(self, token: int) -> bool:
        """Consume one drafted token (taken back by `pop`); False when the grammar refuses it."""
        if not self.matcher.try_consume_tokens([int(token)]):
            return False
        self.consumed.append(int(token))
        return True

    def pop(self, count: int) -> None:
        self._rollback(count)

    def forced(self) -> int | None:
        """The one token the grammar allows next, if only one (a stop id never: the generation's
        end is the model's to read); None otherwise."""
        if self.matcher.is_stopped():
            return None
        ff = self.matcher.compute_ff_tokens()
        if not ff:
            return None
        row = self.mask_rows([])[0]
        token = int(ff[0])
        if popcount(row) != 1 or token in self.vocab.stop_ids:
            return None
        return token

    def done(self) -> bool:
        """The grammar is complete and allows nothing but a stop id."""
        return bool(self.matcher.is_stopped())


def unpack(row: np.ndarray, vocab: int) -> np.ndarray:  # [vocab] bool
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def popcount(row: np.ndarray) -> int:
    return int(np.unpackbits(row.view(np.uint8)).sum())


def apply_mask_numpy(logits: np.ndarray, row: np.ndarray) -> np.ndarray:
    """logits [V] with every token the mask row refuses set to -inf (a copy)."""
    allowed = unpack(row, logits.shape[-1]) if logits.shape[-1] <= row.size * 32 else None
    out = np.array(logits, dtype=np.float32, copy=True)
    if allowed is None:
        allowed = np.zeros(logits.shape[-1], dtype=bool)
        allowed[: row.size * 32] = unpack(row, row.size * 32)
    out[~allowed] = -np.inf
    return out


def describe_schema_error(schema: Any) -> str | None:
    """Why `schema` is not a JSON object or boolean schema, or None."""
    if isinstance(schema, bool | dict):
        return None
    return f"a JSON schema is an object or a boolean, not {type(schema).__name__}"


def grammar_json(text: str) -> dict[str, Any] | None:
    """The grammar's JSON form, or None for Lark text."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
