"""A pair's data-aware pre-merge diagnostics, measured on sentences disjoint from every merge's outcome: the anchor's
kind of metric (Zhou et al.: gradient distances, activation similarity), read on ``forecast.premerge_split`` (FLORES
dev), never on ``data.split`` (devtest, where the merges are scored: refused when the two share a line).

``task=premerge`` (one run per pair: kind=measure, metric=premerge, route=native), on the first
``forecast.premerge_sentences`` sentences of each language the pair is scored on (:func:`~mergescope.native.pair.
outcome_langs`: the host's; both experts' under ``native.outcome=both``):

- ``dev_nll_gap``: |NLL(a) - NLL(b)| in nats/token (the first token apart) on those sentences: how far apart the two
  experts' quality is before merging (a merge's gain over the *better* one is bounded by it);
- ``dev_act_cosine``: the mean over sentences of the cosine between a's and b's final hidden states, each mean-pooled
  over the sentence's tokens (the start token left out);
- ``dev_grad_cosine`` and ``dev_grad_relative_l2``: each model's gradient of its mean token NLL on its own language's
  sentences (its task: model a on the host's language, model b on its own), over the tensors the pair shares, as one
  flat float64 vector: their cosine, and |g_a - g_b| / ((|g_a| + |g_b|) / 2).

Everything is batched by length (no loop over sentences) and deterministic (no dropout: ``eval()``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from omegaconf import DictConfig

from mergescope.errors import MergescopeError
from mergescope.forecast.table import PREMERGE as PREMERGE_FEATURES

__all__ = ["PREMERGE_FEATURES", "premerge_values", "run_premerge"]

EVIDENCE = 1


def _split_sentences(cfg: DictConfig, lang: str, split: str, n: int) -> tuple[str, ...]:
    from mergescope import data as data_mod
    from mergescope.config import plain_copy

    c = plain_copy(cfg.data)
    c.split = split
    return tuple(data_mod.load_side(c, lang).sentences[:n])


def _pass(model, tok, sentences, max_length: int, grad: bool) -> tuple[float, float, np.ndarray]:
    """One model over ``sentences`` in length batches: (summed NLL of every token but the first, their count, each
    sentence's mean-pooled final hidden state (float64)); with ``grad`` the parameters' ``.grad`` then hold the
    gradient of the mean NLL."""
    from mergescope.scoring.batching import length_batches, pad_batch, pad_id
    from mergescope.scoring.bpb import prepare, real_vocab

    device = next(model.parameters()).device
    prep = prepare(tok, sentences, max_length)
    lengths = np.array([len(s) for s in prep.ids])
    vocab = real_vocab(tok, model.get_output_embeddings().weight.shape[0])
    n_rest = float(np.maximum(lengths - 2, 0).sum())  # tokens predicted after the first one
    if n_rest == 0:
        raise MergescopeError("premerge: every sentence is a single token; nothing to score after the first token")
    pooled = np.zeros((len(prep.ids), 0))
    total = 0.0
    model.zero_grad(set_to_none=True)
    for b in length_batches(lengths, 2048):
        x, m, p = pad_batch([prep.ids[i] for i in b], pad_id(tok), "right", device)
        with torch.set_grad_enabled(grad):
            out = model(input_ids=x, attention_mask=m, position_ids=p, use_cache=False, output_hidden_states=True)
            logp = torch.log_softmax(out.logits[:, :-1, :vocab].float(), -1)
            nll = -logp.gather(2, x[:, 1:, None]).squeeze(2)
            keep = m[:, 1:].clone()
            keep[:, 0] = 0  # the first token (predicted from the start token) apart
            s = (nll * keep).sum()
            if grad:
                (s / n_rest).backward()
        total += float(s.detach())
        h = out.hidden_states[-1].detach().double()
        body = m.clone().double()
        body[:, 0] = 0  # the start token is not the sentence
        vec = (h * body[..., None]).sum(1) / body.sum(1, keepdim=True).clamp(min=1)
        if pooled.shape[1] == 0:
            pooled = np.zeros((len(prep.ids), vec.shape[1]))
        pooled[b] = vec.cpu().numpy()
    return total, n_rest, pooled


def _flat_grads(model, names: list[str]) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    return {n: params[n].grad.detach().double().flatten() if params[n].grad is not None else torch.zeros(params[n].numel(), dtype=torch.float64)
            for n in names if n in params}


def premerge_values(cfg: DictConfig) -> dict[str, float]:
    """The pair's :data:`PREMERGE_FEATURES` (and the counts they rest on), computed now."""
    from mergescope import models
    from mergescope.forecast.settings import ForecastSettings
    from mergescope.native.pair import outcome_langs
    from mergescope.native.weights import coverage

    fs = ForecastSettings.from_cfg(cfg)
    split, n = fs.premerge_split, fs.premerge_sentences
    langs = outcome_langs(cfg)
    union = tuple(s for lang in langs for s in _split_sentences(cfg, lang, split, n))
    own = {"a": _split_sentences(cfg, str(cfg.pair.a.lang), split, n), "b": _split_sentences(cfg, str(cfg.pair.b.lang), split, n)}
    max_length = int(cfg.represent.max_length)
    loaded, nll, pooled = {}, {}, {}
    for side in ("a", "b"):
        lm = models.load(cfg.pair[side], cfg.device, quiet=True, dtype="float32")
        loaded[side] = lm.model.eval()
        for prm in lm.model.parameters():
            prm.requires_grad_(True)
        if own[side] == union:  # a checkpoint pair (one language): the gradient's forward gives the rest too
            tot, cnt, pooled[side] = _pass(lm.model, lm.tokenizer, union, max_length, grad=True)
        else:
            tot, cnt, pooled[side] = _pass(lm.model, lm.tokenizer, union, max_length, grad=False)
            _pass(lm.model, lm.tokenizer, own[side], max_length, grad=True)
        nll[side] = tot / cnt
    shared = coverage({k: v.detach() for k, v in loaded["a"].named_parameters()},
                      {k: v.detach() for k, v in loaded["b"].named_parameters()}).shared
    ga, gb = _flat_grads(loaded["a"], shared), _flat_grads(loaded["b"], shared)
    dot = sum(float(ga[k] @ gb[k]) for k in shared)
    na = math.sqrt(sum(float(ga[k] @ ga[k]) for k in shared))
    nb = math.sqrt(sum(float(gb[k] @ gb[k]) for k in shared))
    diff = math.sqrt(sum(float((ga[k] - gb[k]) @ (ga[k] - gb[k])) for k in shared))
    if pooled["a"].shape != pooled["b"].shape:
        raise MergescopeError(f"premerge: the two models' hidden states differ in width ({pooled['a'].shape[1]} vs "
                              f"{pooled['b'].shape[1]}); activation cosine needs a shared space (a native pair)")
    pa, pb = pooled["a"], pooled["b"]
    cos = (pa * pb).sum(1) / np.maximum(np.linalg.norm(pa, axis=1) * np.linalg.norm(pb, axis=1), 1e-300)
    return {"dev_nll_gap": abs(nll["a"] - nll["b"]), "dev_nll_a": nll["a"], "dev_nll_b": nll["b"],
            "dev_act_cosine": float(cos.mean()),
            "dev_grad_cosine": dot / (na * nb) if na > 0 and nb > 0 else float("nan"),
            "dev_grad_relative_l2": diff / ((na + nb) / 2) if na + nb > 0 else float("nan"),
            "dev_grad_norm_a": na, "dev_grad_norm_b": nb, "n_premerge_sentences": float(len(union)),
            "n_grad_tensors": float(len(shared))}


def run_premerge(cfg: DictConfig, overrides: list[str] | None = None):
    """One run of the pair's pre-merge diagnostics (refused, with no run, when the split overlaps the scored one)."""
    from mergescope.data import split_overlap
    from mergescope.forecast.settings import ForecastSettings
    from mergescope.native.merges import outcome_part, outcome_tags
    from mergescope.native.pair import check_pair
    from mergescope.runs import JobSpec, pair_tags, pair_text, run_once

    fs = ForecastSettings.from_cfg(cfg)
    if (why := split_overlap(cfg.data, fs.premerge_split, str(cfg.data.split))):
        raise MergescopeError(f"forecast.premerge_split={fs.premerge_split} and data.split={cfg.data.split}: {why}; a pre-merge "
                              "diagnostic must not read the sentences a merge is scored on (use forecast.premerge_split=dev "
                              "with data.split=devtest)")
    refs = check_pair(cfg)[:2]
    from mergescope import data as data_mod
    from mergescope.native.pair import outcome_langs

    langs = sorted({*outcome_langs(cfg), str(cfg.pair.b.lang)})  # what it reads of the premerge split: in its identity
    dev = data_mod.content_digest(cfg.data, langs, [fs.premerge_split])
    tags = {"kind": "measure", "metric": "premerge", "route": "native", **pair_tags(cfg), "seed": cfg.seed, **outcome_tags(cfg)}
    spec = JobSpec(f"premerge {pair_text(cfg)}", tags, task="premerge",
                   keys=["pair", "data", "forecast.premerge_split", "forecast.premerge_sentences", "represent.max_length"],
                   reads=refs, extra={"evidence": EVIDENCE, "premerge_data": dev, **outcome_part(cfg)})
    return run_once(cfg, spec, lambda job: premerge_values(cfg), overrides)
