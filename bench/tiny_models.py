"""Tiny random causal LMs: real transformers code paths, milliseconds per forward. The tests and
`python -m bench --quick` use them."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

VOCAB = 96


def random_llama(
    seed: int, *, vocab: int, hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, positions: int = 1024
) -> LlamaForCausalLM:
    """A Llama of this shape with transformers' random initialisation, fp32, in eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
    )
    return LlamaForCausalLM(config).float().eval()


def tiny_target(seed: int = 0, vocab: int = VOCAB) -> PreTrainedModel:
    model = random_llama(seed, vocab=vocab, hidden=32, mlp=64, layers=2, heads=4, kv_heads=2)
    # Random init gives near-uniform logits; sharpen them so greedy and sampling have structure.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def tiny_vllm_target(seed: int = 0, vocab: int = VOCAB) -> PreTrainedModel:
    """A tiny target in a shape vLLM's CPU attention runs (heads of 64 dimensions)."""
    model = random_llama(seed, vocab=vocab, hidden=128, mlp=256, layers=2, heads=2, kv_heads=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def save_model(model: PreTrainedModel, path: Path) -> Path:
    """A model and a tiny tokenizer of its vocabulary as an HF folder."""
    model.generation_config.eos_token_id = 1
    model.save_pretrained(path)
    tiny_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


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


def save_pair(folder: Path, noise: float = 0.2, vllm: bool = False) -> tuple[Path, Path]:
    """Save a tiny target and draft (with the tokenizer) as HF folders, and the draft as a GGUF
    inside its folder; returns (draft, target). vllm: the target of tiny_vllm_target's shape."""
    target = tiny_vllm_target() if vllm else tiny_target()
    draft = tiny_draft(target, noise)
    paths = folder / "draft", folder / "target"
    for model, path in zip((draft, target), paths, strict=True):
        save_model(model, path)
    save_gguf(draft, paths[0] / "draft.gguf")  # what the edge's llama.cpp runtime loads
    return paths


def _rope_pairs(weight: torch.Tensor, heads: int) -> np.ndarray:
    """HF rotates the two halves of each head; llama.cpp's llama graph rotates adjacent pairs.
    Reorder the rows of q/k projections the way llama.cpp's own converter does."""
    rows = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape).numpy()


def save_gguf(model: PreTrainedModel, path: Path) -> Path:
    """Write a tiny Llama as an f32 GGUF that llama.cpp loads: the same weights, so its logits
    match transformers' to float rounding. No vocabulary inside ("none"): the edge feeds
    llama.cpp the HF tokenizer's ids."""
    import gguf  # the model store's dependency; only the tests and python -m bench --quick write GGUFs

    cfg = model.config
    heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("none")
    weights = {name: tensor.detach().float() for name, tensor in model.state_dict().items()}
    tensors = {
        "token_embd.weight": weights["model.embed_tokens.weight"].numpy(),
        "output_norm.weight": weights["model.norm.weight"].numpy(),
        "output.weight": weights["lm_head.weight"].numpy(),
    }
    for i in range(cfg.num_hidden_layers):
        hf = f"model.layers.{i}."
        tensors |= {
            f"blk.{i}.attn_norm.weight": weights[hf + "input_layernorm.weight"].numpy(),
            f"blk.{i}.attn_q.weight": _rope_pairs(weights[hf + "self_attn.q_proj.weight"], heads),
            f"blk.{i}.attn_k.weight": _rope_pairs(weights[hf + "self_attn.k_proj.weight"], kv_heads),
            f"blk.{i}.attn_v.weight": weights[hf + "self_attn.v_proj.weight"].numpy(),
            f"blk.{i}.attn_output.weight": weights[hf + "self_attn.o_proj.weight"].numpy(),
            f"blk.{i}.ffn_norm.weight": weights[hf + "post_attention_layernorm.weight"].numpy(),
            f"blk.{i}.ffn_gate.weight": weights[hf + "mlp.gate_proj.weight"].numpy(),
            f"blk.{i}.ffn_up.weight": weights[hf + "mlp.up_proj.weight"].numpy(),
            f"blk.{i}.ffn_down.weight": weights[hf + "mlp.down_proj.weight"].numpy(),
        }
    for name, array in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
