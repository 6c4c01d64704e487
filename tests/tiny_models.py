"""Tiny random causal LMs for tests; most live in bench/ so `python -m bench --quick` can build
them too. The convertible pair here is for llama.cpp's own converter, which needs a tokenizer it
knows: a byte-fallback BPE in the Llama style."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.tiny_models import (
    VOCAB,
    llama_bpe_tokenizer,
    save_gguf,
    save_model,
    save_pair,
    tiny_draft,
    tiny_target,
    tiny_tokenizer,
    tiny_vllm_target,
)

__all__ = [
    "VOCAB",
    "llama_bpe_tokenizer",
    "save_convertible_pair",
    "save_gguf",
    "save_model",
    "save_pair",
    "tiny_draft",
    "tiny_target",
    "tiny_tokenizer",
    "tiny_vllm_target",
]


def _convertible_llama(seed: int, vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # structure for greedy, as tiny_target
        for param in model.parameters():  # f16-exact weights: an f16 GGUF holds the very same model
            param.copy_(param.half().float())
    return model


def save_convertible_pair(folder: Path) -> tuple[Path, Path]:
    """A tiny target and a perturbed draft sharing llama_bpe_tokenizer(), as HF folders with no
    GGUF; returns (draft, target)."""
    tokenizer = llama_bpe_tokenizer()
    target = _convertible_llama(0, len(tokenizer))
    draft = tiny_draft(target, noise=0.2)
    with torch.no_grad():
        for param in draft.parameters():
            param.copy_(param.half().float())
    paths = folder / "draft", folder / "target"
    for model, path in zip((draft, target), paths, strict=True):
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return paths
