"""Tiny random causal LMs for tests: real transformers code paths, milliseconds per forward."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

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
