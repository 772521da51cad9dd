"""Scoring a model of the adapt arm: NLL per language and per FLORES domain (nats per token and bits per
byte, as :mod:`mergescope.scoring.bpb` defines them: every token predicted from the start token, padded vocabulary rows
out of the softmax), on a validation and a disjoint test split, and the diagnostics read against the collapse: attention
entropy per layer (mean over heads and real query tokens) and the residual-stream norm per layer.

A "task" of the seesaw is one language or one FLORES domain (wikinews / wikivoyage / wikibooks, from the
``metadata_<split>.tsv`` beside the FLORES files; pooled over the languages).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mergescope import data as data_mod
from mergescope.config import plain_copy
from mergescope.scoring.bpb import Scores, score_sentences
from mergescope.documents import documents
from mergescope.errors import MergescopeError
from mergescope.scoring.batching import pad_batch, pad_id, tokenize


@dataclass(frozen=True)
class Text:
    """One split of one language: the sentences and their FLORES domains."""

    split: str
    lang: str
    sentences: tuple[str, ...]
    domains: tuple[str, ...] | None
    documents: tuple[str, ...] | None = None   # each sentence's FLORES article (what a paired interval resamples)

    @property
    def key(self) -> str:
        """``<split>.<lang>``: the stratum of its per-sentence scores."""
        return f"{self.split}.{self.lang}"


def domains_of(root: Path, split: str, n: int) -> tuple[str, ...] | None:
    """The FLORES domain of each of the first ``n`` lines of ``split`` (None when there is no metadata)."""
    from mergescope.documents import metadata_column

    col = metadata_column(root, split, "domain")
    return None if col is None else tuple(col)[:n]


def sample_rows(n: int, limit: int | None, how: str = "spread") -> list[int]:
    """Which of ``n`` lines to score: all (no ``limit``), the first ``limit`` (``first``), or ``limit`` lines evenly
    spread over the file (``spread``: FLORES files run article by article and domain by domain, so the first 200
    lines of devtest are all wikinews, and a per-domain seesaw needs every domain)."""
    if not limit or int(limit) >= n:
        return list(range(n))
    if how == "first":
        return list(range(int(limit)))
    if how != "spread":
        raise MergescopeError(f"adaptation.sample must be 'spread' or 'first', got {how!r}")
    return sorted({int(round(x)) for x in np.linspace(0, n - 1, int(limit))})


def load_texts(data_cfg, langs: list[str], splits: dict[str, str], limit: int | None, sample: str = "first") -> list[Text]:
    """The ``val`` and ``test`` splits (names from ``splits``) of every language, ``limit`` sentences chosen by
    ``sample`` (:func:`sample_rows`), with their FLORES domains."""
    why = data_mod.split_overlap(data_cfg, splits["val"], splits["test"])
    if why:
        raise MergescopeError(f"adaptation.val_split={splits['val']} and test_split={splits['test']}: {why}; the best ratio "
                              "must be chosen on one split and reported on a disjoint one (use dev and devtest)")
    out = []
    for role, split in splits.items():
        c = plain_copy(data_cfg)
        c.split = split
        for lang in langs:
            side = data_mod.load_side(c, lang)
            rows = sample_rows(len(side.sentences), limit, sample)
            sents = [side.sentences[i] for i in rows]
            every = domains_of(Path(str(c.root)), split, len(side.sentences)) if c.get("source") != "hub" else None
            doms = tuple(every[i] for i in rows) if every and len(every) == len(side.sentences) else None
            docs, _ = documents(c, lang, len(side.sentences))
            out.append(Text(role, lang, tuple(sents), doms, tuple(docs[i] for i in rows) if docs is not None else None))
    return out


def score(model, tokenizer, texts: list[Text], batch_tokens="auto", max_length: int = 512,
          kept: dict[str, Scores] | None = None) -> dict[str, float]:
    """``{val,test}_nll`` / ``_bpb`` (mean over languages), per language ``{split}_nll.<lang>``, and on every
    split per FLORES domain ``{split}_nll.<domain>`` (pooled over languages: total NLL over total tokens, total bits
    over total bytes); ``{split}_truncated``: how many sentences ``max_length`` cut (their cut-off bytes are not counted);
    ``{split}_nll_rest`` and per language ``{split}_nll_rest.<lang>``: the same without each sentence's first token.
    ``kept``: each text's per-sentence scores, by :attr:`Text.key`."""
    out: dict[str, float] = {}
    by_domain: dict[tuple[str, str], list[Scores]] = {}
    for t in texts:
        sc = score_sentences(model, tokenizer, t.sentences, batch_tokens, max_length)
        if kept is not None:
            kept[t.key] = sc
        out[f"{t.split}_nll_rest.{t.lang}"] = sc.rest().nats_per_token
        out[f"{t.split}_nll.{t.lang}"], out[f"{t.split}_bpb.{t.lang}"] = sc.nats_per_token, sc.bits_per_byte
        out[f"{t.split}_truncated"] = out.get(f"{t.split}_truncated", 0.0) + sc.n_truncated
        for dom in sorted(set(t.domains or ())):
            by_domain.setdefault((t.split, dom), []).append(sc.select(np.array([d == dom for d in t.domains])))
    for (split, dom), parts in by_domain.items():
        pooled = Scores.concat(parts)
        out[f"{split}_nll.{dom}"], out[f"{split}_bpb.{dom}"] = pooled.nats_per_token, pooled.bits_per_byte
    for split in sorted({t.split for t in texts}):
        langs = [t.lang for t in texts if t.split == split]
        out[f"{split}_nll"] = float(np.mean([out[f"{split}_nll.{lang}"] for lang in langs]))
        out[f"{split}_nll_rest"] = float(np.mean([out[f"{split}_nll_rest.{lang}"] for lang in langs]))
        out[f"{split}_bpb"] = float(np.mean([out[f"{split}_bpb.{lang}"] for lang in langs]))
    return out


def _blocks(model):
    base = model.base_model
    return base.layers, (base.norm if hasattr(base, "norm") else base.final_layer_norm)


def _out_proj(layer) -> torch.Tensor:
    attn = layer.self_attn if hasattr(layer, "self_attn") else layer.attention
    return (attn.o_proj if hasattr(attn, "o_proj") else attn.dense).weight


def contributing_heads(model) -> list[torch.Tensor]:
    """Per layer, which query heads reach the residual stream: a head whose columns of the attention output
    projection are all zero (a new head of Expand(zero), every head of an identity layer) attends uniformly but
    changes nothing, so it is left out of the entropy."""
    c = model.config
    heads = int(c.num_attention_heads)
    out = []
    for layer in _blocks(model)[0]:
        w = _out_proj(layer).detach()
        hd = w.shape[1] // heads
        out.append(w.reshape(w.shape[0], heads, hd).abs().amax(dim=(0, 2)) > 0)
    return out


@torch.inference_mode()
def attention_diagnostics(model, tokenizer, sentences, max_length: int = 512) -> dict[str, list[float]]:
    """Per layer: attention entropy (nats; mean over the heads that contribute, :func:`contributing_heads`, and real
    query tokens, attention over real keys; NaN for a layer with none, which the mean over layers skips), the same
    over every head (``attn_entropy_all``), and the residual-stream norm (mean L2 norm per real token of each
    layer's output, the last one BEFORE the final norm: the residual stream, not the norm's gamma)."""
    device = next(model.parameters()).device
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    layers, final_norm = _blocks(model)
    captured: list[torch.Tensor] = []
    hook = final_norm.register_forward_hook(lambda mod, args, out: captured.append(args[0]))
    try:
        ids, _ = tokenize(tokenizer, sentences, max_length)
        x, m, p = pad_batch(ids, pad_id(tokenizer), "right", device)
        out = model(input_ids=x, attention_mask=m, position_ids=p, output_attentions=True, output_hidden_states=True,
                    use_cache=False)
    finally:
        hook.remove()
        model.set_attn_implementation(previous)
    real = m.bool()
    live = contributing_heads(model)
    ent, ent_all = [], []
    for a, keep in zip(out.attentions, live):  # (B, H, T, T)
        h = -(a.double() * torch.log(a.double().clamp_min(1e-30))).sum(-1)  # (B, H, T)
        ent_all.append(float(h.mean(1)[real].mean()))
        keep = keep.to(h.device)
        ent.append(float(h[:, keep].mean(1)[real].mean()) if bool(keep.any()) else float("nan"))
    pre_norm = [*out.hidden_states[1:len(layers)], captured[-1]]  # HF's last hidden state is after the final norm
    norms = [float(hs.double().norm(dim=-1)[real].mean()) for hs in pre_norm]
    return {"attn_entropy": ent, "attn_entropy_all": ent_all, "resid_norm": norms}
