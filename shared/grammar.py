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

from collections.abc import Collection, Sequence
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


def json_schema_grammar(schema: dict[str, Any], *, compact: bool = False) -> str:
    """The grammar of JSON values valid under `schema` (Draft 2020-12, llguidance's subset:
    objects with properties in the schema's order, arrays, enums, consts, anyOf, local $refs,
    string patterns and formats, number bounds). Whitespace between tokens as the model lays
    the value out (as vLLM's server allows by default): a model writes what it writes most
    likely, so drafts pass, where forcing another layout costs acceptance (measured: tau 8.0
    with the model's layout, 4.4 compact, on the packaged pair). Compact: no whitespace, every
    brace, quote and key name the only choice where it stands."""
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
    """A tokenizer as grammars see it: each id's bytes, and the width of the masks (the model's
    logits). Building it reads every token (about half a second for 152k tokens): a process
    builds one and keeps it. The ids that end a generation are each session's own
    (`Constraint`), not the tokenizer's."""

    def __init__(self, tokenizer_json: str, width: int) -> None:
        from llguidance import LLTokenizer

        self.width = width
        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=width)
        self.own_stops = tuple(self.tokenizer.eos_tokens)  # what llguidance allows at a grammar's end
        self.words = (width + 31) // 32  # int32 words per mask row

    def compile(self, grammar: str) -> Grammar:
        """The grammar, checked against the limits; GrammarRefused says why it is not one."""
        from llguidance import LLMatcher

        if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
            raise GrammarRefused(f"the grammar is larger than {MAX_GRAMMAR_BYTES} bytes", None)
        error = LLMatcher.validate_grammar(grammar, self.tokenizer, limits=_limits())
        if error:
            raise GrammarRefused(f"the grammar was refused: {_short(error)}", None)
        return Grammar(self, grammar)


@dataclass(frozen=True)
class Grammar:
    """A checked grammar on its vocabulary: what every generation of it starts from."""

    vocab: GrammarVocab
    text: str

    def start(self, stop_ids: Collection[int]) -> Constraint:
        return Constraint(self, stop_ids)


class Constraint:
    """One generation's place in its grammar: the tokens generated so far (after the prompt)
    consumed. Drafts are consumed to read the masks after them and taken back; `sync` moves
    the place to any committed sequence (rolling back to the shared prefix).

    The generation's stop ids are allowed exactly where the grammar is complete (and are then
    the only tokens allowed once it can go no further); a stop id ends the generation, so it is
    never consumed."""

    def __init__(self, grammar: Grammar, stop_ids: Collection[int]) -> None:
        from llguidance import LLMatcher

        self.grammar, self.vocab = grammar, grammar.vocab
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        if not self.stop_ids or max(self.stop_ids) >= grammar.vocab.width or min(self.stop_ids) < 0:
            raise GrammarRefused("a grammar needs the ids that end a generation, inside the vocabulary", None)
        self._stop_bits = _bits(self.stop_ids, grammar.vocab.words)
        self._own_bits = _bits(set(grammar.vocab.own_stops) - self.stop_ids, grammar.vocab.words)
        self.matcher = LLMatcher(grammar.vocab.tokenizer, grammar.text, log_level=0, limits=_limits())
        self.consumed: list[int] = []
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarRefused(f"the grammar failed: {_short(self.matcher.get_error())}", None)

    def sync(self, generated: Sequence[int]) -> None:
        """Move to `generated` (every token after the prompt; a stop id at its end is the
        generation's end, not the grammar's): roll back to the shared prefix, consume the rest.
        GrammarRefused when a token is not the grammar's."""
        tokens = list(generated)
        if tokens and tokens[-1] in self.stop_ids:
            tokens.pop()
        keep = min(len(self.consumed), len(tokens))
        if self.consumed[:keep] != tokens[:keep]:
            keep = next(i for i, (a, b) in enumerate(zip(self.consumed, tokens, strict=False)) if a != b)
        self._rollback(len(self.consumed) - keep)
        rest = tokens[keep:]
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

    def mask_rows(self, drafts: Sequence[int]) -> np.ndarray:
        """[len(drafts) + 1, words] int32 bitmasks: row i allows what may follow the committed
        tokens and drafts[:i]. After the first draft the grammar refuses (or a stop id), the
        rows allow everything: that draft's own row decides it (rejected, or the end), and the
        rows after it are never read."""
        import llguidance.numpy as lln

        rows = lln.allocate_token_bitmask(len(drafts) + 1, self.vocab.width)
        self._fill(rows, 0)
        taken = 0
        for i, token in enumerate(drafts):
            if int(token) in self.stop_ids or not self.matcher.try_consume_tokens([int(token)]):
                break
            taken += 1
            self._fill(rows, i + 1)
        if taken:
            self.matcher.rollback(taken)
        return rows

    def _fill(self, rows: np.ndarray, row: int) -> None:
        import llguidance.numpy as lln

        lln.fill_next_token_bitmask(self.matcher, rows, row)
        words = rows[row].view(np.uint32)
        words &= ~self._own_bits
        if self.matcher.is_accepting():
            words |= self._stop_bits
        else:
            words &= ~self._stop_bits

    def allowed(self) -> np.ndarray:  # [width] bool: the tokens the grammar allows next
        return unpack(self.mask_rows([])[0], self.vocab.width)

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many of the drafts the grammar allows, in order (a stop id where it may end)."""
        count = 0
        for token in drafts:
            if not self.push(token):
                break
            count += 1
        ends = count < len(drafts) and int(drafts[count]) in self.stop_ids and self.matcher.is_accepting()
        self.pop(count)
        return count + 1 if ends else count

    def push(self, token: int) -> bool:
        """Consume one drafted token (taken back by `pop`); False when the grammar refuses it
        (or it is a stop id: nothing follows it)."""
        if int(token) in self.stop_ids or not self.matcher.try_consume_tokens([int(token)]):
            return False
        self.consumed.append(int(token))
        return True

    def pop(self, count: int) -> None:
        self._rollback(count)

    def forced(self) -> int | None:
        """The one token the grammar allows next, if only one and not a stop id; None otherwise."""
        if self.matcher.is_stopped() or self.matcher.is_accepting():
            return None
        ff = self.matcher.compute_ff_tokens()
        if not ff:
            return None
        rows = self.mask_rows([])
        return int(ff[0]) if popcount(rows[0]) == 1 else None


def _bits(ids: set[int] | frozenset[int], words: int) -> np.ndarray:  # [words] uint32 with the ids' bits set
    out = np.zeros(words, dtype=np.uint32)
    for token in ids:
        out[token // 32] |= np.uint32(1 << (token % 32))
    return out


def unpack(row: np.ndarray, vocab: int) -> np.ndarray:  # [vocab] bool
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def allowed_rows(rows: np.ndarray, vocab: int) -> np.ndarray:  # [n, vocab] bool
    """Bitmask rows [n, words] as booleans over the first `vocab` ids."""
    return np.unpackbits(rows.view(np.uint8), axis=-1, bitorder="little")[:, :vocab].astype(bool)


def popcount(row: np.ndarray) -> int:
    return int(np.unpackbits(row.view(np.uint8)).sum())


def masked(logits: np.ndarray, row: np.ndarray) -> np.ndarray:
    """logits [V] with every token the mask row refuses set to -inf (a new array)."""
    return np.where(unpack(row, logits.shape[-1]), logits, np.float32(-np.inf)).astype(np.float32, copy=False)
