"""TextStreamer: verified tokens to text for `edge-agent serve`, on a real byte-level BPE
tokenizer (trained here) whose emoji spans four tokens: whole characters only, stop strings
cut across token boundaries, previews of provisional tokens."""

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from edge.serve.text import TextStreamer
from edge.tokenizer import EdgeTokenizer

TEXT = "日本語 and café 🙂 then the end"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> EdgeTokenizer:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"])
    backend.train_from_iterator(["hello world", "naïve café", "日本語 テキスト", "then the end"], trainer)
    folder: Path = tmp_path_factory.mktemp("bbpe")
    backend.save(str(folder / "tokenizer.json"))
    return EdgeTokenizer(folder)


def _stream(streamer: TextStreamer, ids: list[int], step: int = 1) -> list[str]:
    pieces = [streamer.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    return [p for p in [*pieces, streamer.finish()] if p]


@pytest.mark.parametrize("step", [1, 2, 3])
def test_pieces_are_whole_characters_and_add_up(tokenizer: EdgeTokenizer, step: int) -> None:
    ids = tokenizer.encode(TEXT)
    assert sum(tokenizer.decode([i]) == "\ufffd" for i in ids) >= 2  # the emoji is split into byte tokens
    pieces = _stream(TextStreamer(tokenizer), ids, step)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == TEXT


@pytest.mark.parametrize("stop", ["🙂 th", "é 🙂", "the end", "nd"])
def test_stop_string_cut_across_tokens(tokenizer: EdgeTokenizer, stop: str) -> None:
    ids = tokenizer.encode(TEXT)
    streamer = TextStreamer(tokenizer, ["never", stop])
    pieces = []
    for token in ids:
        pieces.append(streamer.push([token]))
        if streamer.stopped:
            break
    pieces.append(streamer.finish())
    assert streamer.stopped and "".join(pieces) == TEXT[: TEXT.index(stop)]


def test_text_that_might_start_a_stop_is_held_then_released(tokenizer: EdgeTokenizer) -> None:
    ids = tokenizer.encode("then the end")
    streamer = TextStreamer(tokenizer, ["the end!"])  # never completed
    released = "".join(streamer.push([t]) for t in ids)
    assert released == "then "  # "the end" could still become the stop string
    assert streamer.finish() == "the end" and not streamer.stopped


def test_preview_shows_provisional_text_without_releasing_it(tokenizer: EdgeTokenizer) -> None:
    ids = tokenizer.encode("café 🙂 then")
    emoji_start = next(i for i, t in enumerate(ids) if tokenizer.decode([t]) == "\ufffd")
    streamer = TextStreamer(tokenizer, ["then"])
    streamer.push(ids[:emoji_start])
    streamer.push(ids[emoji_start : emoji_start + 1])  # part of the emoji committed: not released yet
    assert streamer.released_text() == "café "
    assert streamer.preview(ids[emoji_start + 1 :]) == "🙂 "  # cut before the stop string
    assert streamer.released_text() == "café "
