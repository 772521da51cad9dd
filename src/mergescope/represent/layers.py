"""Every layer from one forward pass: pooled representations at every hidden state (0 = the embeddings,
L = the final post-norm state, the LM head's input, as ``layer=-1``), for several poolings at once, cached
on disk once per model, data and pooling. The single-layer path (``embed``, ``ReprKey``) is unchanged.

Hidden states are laid out the same for every family: transformers return (embeddings, block 1..L-1,
final normed) and Mamba (block 1..L-1, block L, final normed) without the embeddings, which are then taken
from the input embedding layer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mergescope.errors import MergescopeError
from mergescope.progress import bar
from mergescope.represent.cache import CACHE_VERSION, ReprCache
from mergescope.represent.forward import (POOLINGS, batch_token_budget, leading_special, length_batches, pad_batch, pad_id,
                                         pool, pooling_mask, tokenize)


@dataclass(frozen=True)
class LayersKey:
    """Cache key of all-layer representations (a different namespace from single-layer ``ReprKey``s)."""

    model: str
    data: str
    lang: str
    split: str
    pooling: str
    dtype: str
    max_length: int
    layers: str = "all"

    @property
    def digest(self) -> str:
        blob = json.dumps({**self.__dict__, "v": CACHE_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]


def all_hidden(model, ids, mask, pos) -> list[torch.Tensor]:
    """The L+1 hidden states of one batch: embeddings, blocks 1..L-1, the final post-norm state."""
    base = model.base_model
    out = base(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True, use_cache=False)
    return layout(list(out.hidden_states), out.last_hidden_state, base.get_input_embeddings()(ids))


def layout(hs: list[torch.Tensor], last: torch.Tensor, emb: torch.Tensor) -> list[torch.Tensor]:
    """A forward's hidden states as L+1 layers: the embeddings, blocks 1..L-1, the final post-norm state ``last``."""
    if hs[0].shape == emb.shape and torch.equal(hs[0], emb):
        return [emb, *hs[1:-1], last]
    return [emb, *hs[:-2], last]  # Mamba: no embeddings among its hidden states


@torch.inference_mode()
def embed_layers(model, tokenizer, sentences, poolings=POOLINGS, batch_tokens="auto", max_length: int = 512,
                 padding_side: str = "right", progress: bool = True, label: str = "embed layers") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """{pooling: (L+1, n, d) float64} in input order from one forward pass per batch, plus stats."""
    bad = [p for p in poolings if p not in POOLINGS]
    if bad:
        raise MergescopeError(f"unknown pooling '{bad[0]}': choose one of {', '.join(POOLINGS)}")
    device = next(model.parameters()).device
    ids, n_trunc = tokenize(tokenizer, sentences, max_length)
    lead = leading_special(ids, tokenizer)  # a leading BOS is fed but not pooled (forward.pooling_mask)
    lengths = np.array([len(s) for s in ids])
    out: dict[str, np.ndarray] = {}
    batches = length_batches(lengths, batch_token_budget(batch_tokens, device))
    with bar() as pb:
        task = pb.add_task(label, total=len(sentences), visible=progress)
        for b in batches:
            x, m, p = pad_batch([ids[i] for i in b], pad_id(tokenizer), padding_side, device)
            stacked = torch.stack(all_hidden(model, x, m, p))  # (L+1, B, T, d)
            pm = pooling_mask(m, lead[b])
            for name in poolings:
                pooled = torch.stack([pool(h, pm, name) for h in stacked]).cpu().numpy()
                if name not in out:
                    out[name] = np.empty((pooled.shape[0], len(sentences), pooled.shape[2]), dtype=np.float64)
                out[name][:, b] = pooled
            pb.advance(task, len(b))
    return out, {"n_tokens": int(lengths.sum()), "n_truncated": int(n_trunc), "n_batches": len(batches),
                 "n_leading_special": int(lead.sum())}


def cached_layers(cache: ReprCache, keys: dict[str, LayersKey], compute) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """All-layer representations for each pooling in ``keys``, from the cache, or from ONE call of
    ``compute(missing poolings)`` that stores every pooling it returns."""
    out, meta, missing = {}, {}, []
    for name, key in keys.items():
        hit = cache.get(key)
        if hit is None:
            missing.append(name)
        else:
            out[name], meta = hit[0], {**hit[1], "cache": "hit"}
    if missing:
        fresh, meta = compute(missing)
        for name in missing:
            cache.put(keys[name], fresh[name], meta)
            out[name] = fresh[name]
        meta = {**meta, "cache": "miss"}
    return out, meta
