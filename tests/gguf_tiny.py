"""Tiny GGUF files written by the tests themselves: a small transformers model of one family (llama, qwen2, gemma3)
and a small tokenizer, saved through the ``gguf`` package's writer the way llama.cpp's converter lays them out
(tensor names from gguf's own name map; llama's q/k rows permuted for its rotary layout; Gemma's RMSNorm weights
stored as 1 + w), all tensors float32. Loading such a file back through transformers must give the source model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

ARCH = {"llama": "LLAMA", "qwen2": "QWEN2", "gemma3": "GEMMA3"}

CONFIGS = {
    "llama": dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                  intermediate_size=96, tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5,
                  max_position_embeddings=256),
    "qwen2": dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
                  max_position_embeddings=256),
    # six layers: five sliding-window layers then one full one (Gemma 3's pattern); a window of 4 tokens so that a
    # sentence longer than 4 tokens exercises it; query_pre_attn_scalar and the local rope base at their defaults,
    # which GGUF does not carry (transformers fills them in on load)
    "gemma3": dict(hidden_size=32, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                   intermediate_size=64, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                   sliding_window=4, max_position_embeddings=256),
}


def tiny_model(family: str, vocab_size: int, seed: int = 0, **changes):
    """A randomly initialised tiny causal LM of ``family`` with its norm weights and biases perturbed (so that a
    layout mistake in any of them shows in the logits)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = "gemma3_text" if family == "gemma3" else family
    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                  **{**CONFIGS[family], **changes})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _bpe_vocab(tok) -> tuple[list[str], list[str]]:
    """A byte-level BPE tokenizer's tokens in id order and its merges as 'a b' strings."""
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, merges


SPM_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]


def spm_tokens(vocab_size: int) -> list[str]:
    """A small sentencepiece-style vocabulary (Gemma's layout: <pad>, <eos>, <bos>, <unk> first, then pieces)."""
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyz.,", "\u2581t", "he", "\u2581the", "\u2581a", "in", "\u2581c",
              "at", "\u2581cat", "on", "\u2581on", "\u2581s", "it", "\u2581sat", "\u2581m", "\u2581mat"]
    out = SPM_SPECIAL + pieces
    out += [f"<unused{i}>" for i in range(vocab_size - len(out))]
    return out[:vocab_size]


def write_gguf(model, path: Path, family: str, tokenizer=None) -> Path:
    """``model`` (and ``tokenizer``: a byte-level BPE for llama / qwen2; Gemma gets ``spm_tokens``) as an all-F32
    GGUF file at ``path``, in llama.cpp's layout for ``family``."""
    import gguf

    c = model.config
    arch = getattr(gguf.MODEL_ARCH, ARCH[family])
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    w = gguf.GGUFWriter(str(path), arch_name)
    w.add_name(f"tiny {family}")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_context_length(c.max_position_embeddings)
    w.add_block_count(c.num_hidden_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    w.add_rope_freq_base(float((rope.get("full_attention") or rope)["rope_theta"]))  # Gemma 3: per layer type
    w.add_vocab_size(c.vocab_size)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if family == "llama":
        w.add_rope_dimension_count(head_dim)
    if family == "gemma3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(c.sliding_window)
    # the tokenizer
    if family == "gemma3":
        tokens = spm_tokens(c.vocab_size)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([0.0] * len(tokens))
        w.add_token_types([3 if t in SPM_SPECIAL[:3] else 2 if t == "<unk>" else 1 for t in tokens])
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_pad_token_id(0)
        w.add_unk_token_id(3)
        w.add_add_bos_token(True)
    else:
        tokens, merges = _bpe_vocab(tokenizer)
        tokens = tokens + [f"[PAD{i}]" for i in range(c.vocab_size - len(tokens))]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if family == "qwen2" else "smollm")
        w.add_token_list(tokens)
        w.add_token_types([3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens])
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    tied = bool(c.tie_word_embeddings)
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        base, suffix = name.rsplit(".", 1)
        gname = names.get_name(base)
        assert gname is not None, f"no GGUF name for {name}"
        a = t.detach().to(torch.float32).numpy().copy()
        if family == "llama" and gname.endswith(("attn_q", "attn_k")) and suffix == "weight":
            n = c.num_attention_heads if gname.endswith("attn_q") else c.num_key_value_heads
            a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if family == "gemma3" and "norm" in gname:
            a = a + 1.0  # llama.cpp stores Gemma's (1 + w) RMSNorm scale
        w.add_tensor(f"{gname}.{suffix}", np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
