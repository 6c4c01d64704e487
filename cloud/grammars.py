"""The grammars sessions carry (shared/grammar.py), on the verifier's own tokenizer: its
vocabulary built once, at warm-up, and each session's grammar checked and started when the
session opens, so that a round only reads masks."""

from __future__ import annotations

import logging
import threading

from shared.errors import SessionRefused
from shared.grammar import Constraint, GrammarVocab
from shared.protocol import GrammarSpec

log = logging.getLogger("cloud-verifier")


class SessionGrammars:
    def __init__(self, tokenizer_json: str, width: int) -> None:
        self.tokenizer_json, self.width = tokenizer_json, width
        self._vocab: GrammarVocab | None = None
        self._refusal = "" if tokenizer_json else "the verifier's model has no tokenizer.json: it cannot apply grammars"
        self._lock = threading.Lock()

    def warm_up(self) -> None:
        """Build the vocabulary now (about half a second for 152k tokens), not on the first
        session that needs it."""
        try:
            self._grammar_vocab()
        except SessionRefused as err:
            log.info("grammars: %s", err)

    def _grammar_vocab(self) -> GrammarVocab:
        with self._lock:
            if self._vocab is None and not self._refusal:
                try:
                    self._vocab = GrammarVocab(self.tokenizer_json, self.width)
                except Exception as err:  # noqa: BLE001 - llguidance's own errors: a tokenizer it cannot read
                    self._refusal = f"the verifier's tokenizer cannot carry grammars ({' '.join(str(err).split())[:160]})"
            if self._vocab is None:
                raise SessionRefused(self._refusal)
            return self._vocab

    def start(self, spec: GrammarSpec, prompt: list[int]) -> Constraint:
        """A new session's place in its grammar, after the prompt's last `spec.generated`
        tokens (GrammarRefused: INVALID_ARGUMENT)."""
        constraint = self._grammar_vocab().compile(spec.text).start(spec.stop_ids)
        constraint.sync(prompt[len(prompt) - spec.generated :] if spec.generated else [])
        return constraint
