"""Sentence representations: batched, length-sorted forward passes (per-token NLL is :mod:`mergescope.scoring.bpb`'s).

Pooling over the sentence's own tokens of a chosen hidden state:
- ``sgpt``: position-weighted mean (Muennighoff 2022), weight of the i-th pooled token = i;
- ``mean``: plain mean; ``last``: the last real token.
A leading special token the tokenizer adds (BOS: Gemma's, Llama's ``<s>``) is fed to the model but left out of the
pooling (:func:`leading_special`, :func:`pooling_mask`), so a tokenizer that adds one pools the same tokens, with the
same weights, as one that does not; the BOS state is the same for every sentence (Gemma-3's has a norm far above its
other tokens' and would dominate a mean).
``layer=-1`` is the final pre-logit hidden state, after the final norm (what the LM head
receives); any other index selects ``hidden_states[layer]`` (0 = embeddings).
Position ids are computed from the attention mask, so left and right padding give the same vector.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mergescope.errors import MergescopeError
from mergescope.progress import bar
from mergescope.scoring.batching import (batch_token_budget, leading_special, length_batches, pad_batch,  # noqa: F401 (re-exported)
                                       pad_id, tokenize)

POOLINGS = ("sgpt", "mean", "last")


def pooling_mask(mask: torch.Tensor, lead: np.ndarray) -> torch.Tensor:
    """The attention mask without each flagged sentence's first real token (``lead``: :func:`leading_special` of the
    batch's rows), for either padding side."""
    out = mask.clone()
    rows = torch.as_tensor(np.flatnonzero(lead), device=mask.device, dtype=torch.long)
    if rows.numel():
        out[rows, mask[rows].argmax(1)] = 0  # argmax of a 0/1 row: its first real position
    return out


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """Pool (B, T, d) hidden states over real tokens in float64; pad positions never contribute."""
    h = hidden.to(torch.float64).masked_fill(~mask.bool().unsqueeze(-1), 0.0)
    m = mask.to(torch.float64)
    if pooling == "sgpt":
        w = m.cumsum(1) * m
    elif pooling == "mean":
        w = m
    elif pooling == "last":
        w = (m.cumsum(1) == m.sum(1, keepdim=True)).to(torch.float64) * m
    else:
        raise MergescopeError(f"unknown pooling '{pooling}': choose one of {', '.join(POOLINGS)}")
    w = w / w.sum(1, keepdim=True)
    return torch.einsum("bt,btd->bd", w, h)


def final_hidden(model, ids, mask, pos, layer: int) -> torch.Tensor:
    """Hidden state ``layer`` of the base model; -1 = post-final-norm (the LM head's input)."""
    base = model.base_model
    out = base(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=layer != -1, use_cache=False)
    if layer == -1:
        return out.last_hidden_state
    n = len(out.hidden_states)
    if not -n <= layer < n:
        raise MergescopeError(f"layer={layer} is out of range for a model with {n} hidden states (0..{n - 1}, or -1)")
    return out.hidden_states[layer]


@torch.inference_mode()
def embed(
    model,
    tokenizer,
    sentences: list[str] | tuple[str, ...],
    pooling: str = "sgpt",
    layer: int = -1,
    batch_tokens: int | str = "auto",
    max_length: int = 512,
    padding_side: str = "right",
    progress: bool = True,
    label: str = "embed",
) -> tuple[np.ndarray, dict[str, Any]]:
    """(n, d) float64 pooled representations in input order, plus stats (``n_tokens``: the tokens fed, a leading
    special token included; ``n_leading_special``: how many sentences had one, left out of the pooling)."""
    if pooling not in POOLINGS:
        raise MergescopeError(f"unknown pooling '{pooling}': choose one of {', '.join(POOLINGS)}")
    device = next(model.parameters()).device
    ids, n_trunc = tokenize(tokenizer, sentences, max_length)
    lead = leading_special(ids, tokenizer)
    lengths = np.array([len(s) for s in ids])
    out: np.ndarray | None = None
    pad = pad_id(tokenizer)
    batches = length_batches(lengths, batch_token_budget(batch_tokens, device))
    with bar() as pb:
        task = pb.add_task(label, total=len(sentences), visible=progress)
        for b in batches:
            x, m, p = pad_batch([ids[i] for i in b], pad, padding_side, device)
            pooled = pool(final_hidden(model, x, m, p, layer), pooling_mask(m, lead[b]), pooling).cpu().numpy()
            if out is None:
                out = np.empty((len(sentences), pooled.shape[1]), dtype=np.float64)
            out[b] = pooled
            pb.advance(task, len(b))
    assert out is not None
    return out, {"n_tokens": int(lengths.sum()), "n_truncated": int(n_trunc), "n_batches": len(batches),
                 "n_leading_special": int(lead.sum())}
