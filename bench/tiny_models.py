"""Tiny random causal LMs: real transformers code paths, milliseconds per forward. The tests and
`bench --quick` use them."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

VOCAB = 96


def tiny_target(seed: int = 0, vocab: int = VOCAB) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).float().eval()
    # Random init gives near-uniform logits; sharpen them so greedy and sampling have structure.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def tiny_draft(target: PreTrainedModel, noise: float = 0.5, seed: int = 1) -> PreTrainedModel:
    """A perturbed copy of the target: partial agreement, like a real draft/target pair."""
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * noise * param.std())
    return draft.eval()


def tiny_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `vocab` ids with a chat template and an EOS token."""
    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(vocab - 2)]
    model = WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>")
    backend = Tokenizer(model)
    backend.pre_tokenizer = WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    tokenizer.chat_template = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}w3"
    return tokenizer


def save_pair(folder: Path, noise: float = 0.2) -> tuple[Path, Path]:
    """Save a tiny target and draft (with the tokenizer) as HF folders; returns (draft, target)."""
    target = tiny_target()
    draft = tiny_draft(target, noise)
    paths = folder / "draft", folder / "target"
    for model, path in zip((draft, target), paths, strict=True):
        model.generation_config.eos_token_id = 1
        model.save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
    return paths
