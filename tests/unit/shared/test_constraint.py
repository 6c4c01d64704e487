"""A generation's place in its grammar (shared/grammar.py), on the byte-level tiny tokenizer:
masks of a round's rows, stop ids where the grammar may end, forced tokens, moving to any
committed sequence, and the limits a grammar is refused by."""

from __future__ import annotations

import pytest

from shared.grammar import GrammarRefused, GrammarVocab, allowed_rows, json_schema_grammar, lark_grammar, popcount
from tests.tiny_models import llama_bpe_tokenizer

STOP = 2  # </s>
BYTE = 3  # the id of byte 0: ids 3..258 are the 256 bytes


def _byte(char: str) -> int:
    return BYTE + ord(char)


@pytest.fixture(scope="module")
def vocab() -> GrammarVocab:
    tokenizer = llama_bpe_tokenizer()
    return GrammarVocab(tokenizer.backend_tokenizer.to_str(), len(tokenizer))


def test_rows_follow_the_drafts_and_allow_stops_only_at_the_end(vocab: GrammarVocab) -> None:
    # x, y, z, q are byte tokens only (no merges): one token a character
    constraint = vocab.compile(lark_grammar('start: "xy" | "xyz"')).start([STOP])
    a, b, c, x = _byte("x"), _byte("y"), _byte("z"), _byte("q")
    rows = allowed_rows(constraint.mask_rows([a, b, c]), vocab.width)
    assert rows[0, a] and not rows[0, STOP] and not rows[0, x]
    assert rows[2, c] and rows[2, STOP]  # after "ab": the end, or "c"
    assert rows[3, STOP] and rows[3].sum() == 1  # after "abc": only the end
    rows = allowed_rows(constraint.mask_rows([a, x, b]), vocab.width)
    assert not rows[1, x] and rows[2].all() and rows[3].all()  # after a refused draft: never read
    assert constraint.consumed == []  # drafts are taken back


def test_sync_moves_to_any_committed_sequence(vocab: GrammarVocab) -> None:
    constraint = vocab.compile(lark_grammar('start: "xy" "z"*')).start([STOP])
    a, b, c = _byte("x"), _byte("y"), _byte("z")
    constraint.sync([a, b, c, c])
    assert constraint.consumed == [a, b, c, c]
    constraint.sync([a, b])  # a round undone: back to the shared prefix
    assert constraint.consumed == [a, b]
    constraint.sync([a, b, c, STOP])  # the stop id ends the generation: not consumed
    assert constraint.consumed == [a, b, c]
    with pytest.raises(GrammarRefused, match="breaks the grammar"):
        constraint.sync([a, c])
    assert constraint.consumed == [a]  # the valid prefix stays
    assert constraint.valid_prefix([b, c, STOP]) == 3 and constraint.valid_prefix([b, a]) == 1


def test_a_token_the_grammar_allows_alone_is_forced(vocab: GrammarVocab) -> None:
    grammar = vocab.compile(
        json_schema_grammar({"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}, compact=True)
    )
    constraint = grammar.start([STOP])
    forced = []
    while (token := constraint.forced()) is not None:
        forced.append(token)
        assert constraint.push(token)
    assert llama_bpe_tokenizer().decode(forced) == '{"k":'
    assert popcount(constraint.mask_rows([])[0]) > 1  # true or false: the model's to choose
    constraint.pop(len(forced))
    assert constraint.consumed == []


def test_grammars_past_the_limits_are_refused(vocab: GrammarVocab) -> None:
    with pytest.raises(GrammarRefused, match="larger than"):
        vocab.compile("x" * (64 * 1024 + 1))
    with pytest.raises(GrammarRefused, match="refused"):
        vocab.compile(lark_grammar("start: %json{"))
    big = {"type": "object", "properties": {f"p{i}": {"enum": [f"v{j}" for j in range(60)]} for i in range(300)}}
    with pytest.raises(GrammarRefused):  # too many grammar symbols for the limits
        vocab.compile(json_schema_grammar(big, compact=True))
    with pytest.raises(GrammarRefused, match="not a JSON schema"):
        json_schema_grammar({"type": "integer", "minimum": 10**40}, compact=True)
    with pytest.raises(GrammarRefused, match="ids that end"):
        vocab.compile(lark_grammar('start: "a"')).start([])


def test_json_takes_the_models_layout_unless_compact(vocab: GrammarVocab) -> None:
    schema = {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}
    space = llama_bpe_tokenizer().convert_tokens_to_ids("▁")

    def takes(text: str, compact: bool = False) -> bool:  # a token a character: none of these has a merge
        ids = [space if char == " " else _byte(char) for char in text]
        constraint = vocab.compile(json_schema_grammar(schema, compact=compact)).start([STOP])
        return constraint.valid_prefix([*ids, STOP]) == len(ids) + 1

    assert takes('{"k":7}') and takes('{\n  "k": 7\n}') and takes('{ "k" : 7 }')
    assert takes('{"k":7}', compact=True) and not takes('{"k": 7}', compact=True)
