"""`edge-agent serve`'s HTTP app over a scripted engine: each generation says the text a test
gives it, so the request side (fields, templates, grammars asked for) and the reply side
(chat, tool calls, Responses shapes and events) are tested with the real openai client in
process, without a model or a verifier (starlette's TestClient carries the requests)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from openai import OpenAI
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from edge.config import EdgeSettings
from edge.round.generation import GenerationResult
from edge.serve.app import ServeInfo, create_app
from edge.serve.engine import Event, Generation
from edge.serve.text import TextStreamer
from edge.tokenizer import EdgeTokenizer
from shared.api_keys import ApiKeys
from shared.errors import SpecDecError

QWEN_TEMPLATE = (Path(__file__).parent / "data" / "qwen2.5-coder_chat_template.jinja").read_text()


@dataclass
class Started:
    """What one request asked of the engine."""

    prompt: str
    settings: EdgeSettings
    stop: list[str]
    grammar: str


@dataclass
class _Ctx:
    settings: EdgeSettings
    tokenizer: EdgeTokenizer
    draft_lm: Any = None


@dataclass
class ScriptedEngine:
    """Says `pieces` (one text event each) and ends with `finish`; or fails with `error` after
    them; `refuse` is raised by start (as a grammar that does not compile is)."""

    ctx: _Ctx
    pieces: list[str] = field(default_factory=list)
    finish: str = "stop"
    error: SpecDecError | None = None
    refuse: Exception | None = None
    started: list[Started] = field(default_factory=list)
    running: set[Any] = field(default_factory=set)

    def say(self, *pieces: str, finish: str = "stop") -> None:
        self.pieces, self.finish, self.error, self.refuse = list(pieces), finish, None, None

    def start(
        self,
        request_id: str,
        settings: EdgeSettings,
        prompt_ids: list[int],
        stop: list[str],
        previews: bool,
        *,
        caller: str,
        grammar: str = "",
    ) -> Generation:
        if self.refuse is not None:
            raise self.refuse
        tokenizer = self.ctx.tokenizer
        self.started.append(Started(tokenizer.decode(prompt_ids), settings, list(stop), grammar))
        gen = Generation(request_id, settings, len(prompt_ids), TextStreamer(tokenizer, stop), caller=caller)
        for piece in self.pieces:
            gen.queue.put_nowait(Event("text", piece))
        if self.error is not None:
            gen.queue.put_nowait(Event("error", error=self.error))
        else:
            result = GenerationResult(token_ids=list(range(len("".join(self.pieces)))), finish_reason=self.finish)
            gen.queue.put_nowait(Event("done", result=result))
        return gen

    async def close(self) -> None:
        await asyncio.sleep(0)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (GPT-2's byte alphabet) and an EOS: any text encodes and decodes
    back unchanged, and a grammar engine sees every byte."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(BPE(vocab={"<eos>": 0, **{ch: i + 1 for i, ch in enumerate(alphabet)}}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


def scripted_app(folder: Path) -> tuple[ScriptedEngine, TestClient]:
    """A scripted engine behind the app; a byte tokenizer with Qwen2.5's chat template, so
    the prompt an engine is given decodes to the rendered text."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(folder)
    engine = ScriptedEngine(_Ctx(EdgeSettings(), EdgeTokenizer(folder)))
    app = create_app(engine, ServeInfo("qwen2.5-coder-1.5b-instruct", ApiKeys(), "nowhere:1"))  # type: ignore[arg-type]
    return engine, TestClient(app)


def openai_client(http: TestClient) -> OpenAI:
    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
