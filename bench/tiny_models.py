"""Tiny random causal LMs: real transformers code paths, milliseconds per forward. The tests and
`python -m bench --quick` use them."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, normalizers
from tokenizers.models import BPE, WordLevel
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


def save_model(model: PreTrainedModel, path: Path, tokenizer: PreTrainedTokenizerFast | None = None) -> Path:
    """A model and a tokenizer of its vocabulary (a tiny word-level one unless given) as an HF folder."""
    tokenizer = tokenizer or tiny_tokenizer(model.config.vocab_size)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_draft(target: PreTrainedModel, noise: float = 0.5, seed: int = 1) -> PreTrainedModel:
    """A perturbed copy of the target: partial agreement, like a real draft/target pair."""
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * noise * param.std())
    return draft.eval()


_PIECES = ["▁", "a", "b", "c", "d", "e", "▁a", "▁b", "▁c", "ab", "cd", "▁ab", "▁cd", "abcd", "▁abcd"]
_MERGES = [("▁", "a"), ("▁", "b"), ("▁", "c"), ("a", "b"), ("c", "d"), ("▁a", "b"), ("▁c", "d"), ("ab", "cd"), ("▁ab", "cd")]


def llama_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """<unk> <s> </s>, the 256 byte tokens, a few pieces and merges; what llama.cpp's converter
    reads as a Llama (SentencePiece-style) vocabulary."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + _PIECES
    bpe = BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=_MERGES, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    backend = Tokenizer(bpe)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    return tokenizer


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


def save_pair(folder: Path, noise: float = 0.2, vllm: bool = False, bpe: bool = False) -> tuple[Path, Path]:
    """Save a tiny target and draft (with the tokenizer) as HF folders, and the draft as a GGUF
    inside its folder; returns (draft, target). vllm: the target of tiny_vllm_target's shape;
    bpe: on llama_bpe_tokenizer() (bytes: text such as JSON, which grammars need) instead of words."""
    tokenizer = llama_bpe_tokenizer() if bpe else tiny_tokenizer()
    vocab = len(tokenizer)
    target = tiny_vllm_target(vocab=vocab) if vllm else tiny_target(vocab=vocab)
    draft = tiny_draft(target, noise)
    paths = folder / "draft", folder / "target"
    for model, path in zip((draft, target), paths, strict=True):
        save_model(model, path, llama_bpe_tokenizer() if bpe else None)
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
