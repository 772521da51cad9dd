"""Batching shared by every forward over sentences (representations, NLL scoring, statistics, lm-eval): a token
budget per batch, length-sorted batches (little padding) and padding on either side."""

from __future__ import annotations

import numpy as np
import torch

from mergescope.errors import MergescopeError


def tokenize(tokenizer, sentences: list[str] | tuple[str, ...], max_length: int) -> tuple[list[list[int]], int]:
    """Token ids with the tokenizer's default special tokens; truncation only above ``max_length``.

    Returns (ids, n_truncated).
    """
    enc = tokenizer(list(sentences), add_special_tokens=True, truncation=False)["input_ids"]
    n_trunc = sum(len(e) > max_length for e in enc)
    ids = [e[:max_length] for e in enc]
    if any(len(e) == 0 for e in ids):
        raise MergescopeError("a sentence tokenised to zero tokens; remove empty lines from the data")
    return ids, n_trunc


def batch_token_budget(value: int | str, device: torch.device) -> int:
    """Padded tokens per forward batch; ``auto`` = 2048 on CPU (cache-friendly, measured best on
    2 cores) and 16384 on CUDA."""
    if str(value) == "auto":
        return 16384 if device.type == "cuda" else 2048
    return int(value)


def length_batches(lengths: np.ndarray, batch_tokens: int, max_batch: int = 256) -> list[np.ndarray]:
    """Indices grouped longest-first so that each batch's padded size stays within ``batch_tokens``."""
    order = np.argsort(-lengths, kind="stable")
    batches, cur, cur_max = [], [], 0
    for i in order:
        longest = max(cur_max, int(lengths[i]))
        if cur and (longest * (len(cur) + 1) > batch_tokens or len(cur) >= max_batch):
            batches.append(np.array(cur))
            cur, longest = [], int(lengths[i])
        cur.append(i)
        cur_max = longest
    if cur:
        batches.append(np.array(cur))
    return batches


def pad_batch(seqs: list[list[int]], pad_id: int, side: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids) for one batch; positions count real tokens only."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        if side == "left":
            ids[r, width - len(s):] = torch.tensor(s)
            mask[r, width - len(s):] = 1
        else:
            ids[r, : len(s)] = torch.tensor(s)
            mask[r, : len(s)] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), pos.to(device)


def pack_batch(seqs: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids, sentence) for one batch packed into a single row with no padding: the sentences end
    to end, positions counting from 0 in each, ``sentence`` each token's index in ``seqs``. A model given these
    positions and no attention mask sees each sentence alone (transformers builds the block-diagonal causal mask from
    the positions' restarts); :data:`mergescope.transport.finetune.PACKED_FAMILIES` are the families checked to."""
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    sent = torch.cat([torch.full((len(s),), i, dtype=torch.long) for i, s in enumerate(seqs)])
    return ids[None].to(device), pos[None].to(device), sent[None].to(device)


def pad_id(tokenizer) -> int:
    for attr in ("pad_token_id", "eos_token_id", "unk_token_id"):
        v = getattr(tokenizer, attr, None)
        if v is not None:
            return int(v)
    return 0


def leading_special(ids: list[list[int]], tokenizer) -> np.ndarray:
    """Per sentence: does it start with a special token (BOS, ...)? Never for a sentence of one token (it
    would have nothing left to pool)."""
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    return np.array([len(s) > 1 and s[0] in special for s in ids], dtype=bool)
