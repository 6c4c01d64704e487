"""Tiny random causal LMs for tests; they live in bench/ so `python -m bench --quick` can build them too."""

from bench.tiny_models import VOCAB, save_gguf, save_pair, tiny_draft, tiny_target, tiny_tokenizer

__all__ = ["VOCAB", "save_gguf", "save_pair", "tiny_draft", "tiny_target", "tiny_tokenizer"]
