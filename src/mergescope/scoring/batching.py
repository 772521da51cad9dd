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


def pack_batch(seqs: list[list[int]], device: torch.device, pad_id: int = 0,
               row_tokens: int = 512) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, position_ids, sentence) for one batch packed into rows: the sentences end to end in their order,
    a new row when the next would take a row past ``row_tokens`` (or past the longest sentence, if longer), positions
    counting from 0 in each sentence, ``sentence`` each token's index in ``seqs`` (-1 on padding). The rows are padded
    on the right to the longest, the padding a segment of its own (its positions from 0 again). A model given these
    positions and no attention mask sees each sentence alone (transformers builds the block-diagonal causal mask from
    the positions' restarts); :data:`mergescope.transport.finetune.PACKED_FAMILIES` are the families checked to. The
    cap bounds the attention's cost, which grows with the square of a row's length."""
    cap = max(int(row_tokens), max(len(s) for s in seqs))
    rows: list[list[int]] = [[]]
    used = [0]  # tokens in each row
    for i, s in enumerate(seqs):
        if rows[-1] and used[-1] + len(s) > cap:
            rows.append([])
            used.append(0)
        rows[-1].append(i)
        used[-1] += len(s)
    width = max(used)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    sent = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, members in enumerate(rows):
        o = 0
        for j in members:
            n = len(seqs[j])
            ids[r, o:o + n], pos[r, o:o + n], sent[r, o:o + n] = torch.tensor(seqs[j]), torch.arange(n), j
            o += n
        pos[r, o:] = torch.arange(width - o)
    return ids.to(device), pos.to(device), sent.to(device)


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
