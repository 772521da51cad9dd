"""The data statistics of the data-aware merges (RegMean, Fisher merging), each model on its own data.

Each model is read on the first ``merge_stats.sentences`` sentences of its own language in ``merge_stats.split``
(FLORES dev by default), which must differ from ``data.split`` (the split the merged model is scored on): the merge
never sees the text it is judged on. Sentences are tokenised as everywhere else (:func:`mergescope.scoring.bpb.sentence_ids`:
the start token, then the sentence's own tokens).

- ``gram`` (RegMean): for every linear layer whose weight is merged, the inner-product matrix G = X^T X (float64) of
  its inputs over every real token (padding masked), from forward pre-hooks on padded batches. A linear with a bias
  (Qwen2's q/k/v) computes y = [x, 1] [W, b]^T, so its matrix is that of the bias-augmented input [X, 1] ((in + 1)
  square: G, the column sums of X, and the token count), stored under the weight's and the bias's names: RegMean then
  solves weight and bias together (``merge.merge_state_dicts``). Layers fed the same tensor (q/k/v, gate/up) share
  one accumulation. A linear whose weight is tied to another parameter (a head tied to the embedding) gets none: it is
  merged through its partner, by the plain average.
- ``fisher`` (Fisher merging): the diagonal empirical Fisher, the mean over sentences of the squared gradient of the
  sentence's log-likelihood (sum over its tokens), accumulated in float32. A squared per-example gradient cannot be
  read from a batch's summed gradient, so this is one backward pass per sentence (the only per-sentence loop of the
  project, and why the default ``merge_stats.sentences`` is small).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from omegaconf import DictConfig

from mergescope import data as data_mod
from mergescope.scoring.bpb import real_vocab, sentence_ids
from mergescope.config import plain_copy
from mergescope.errors import MergescopeError
from mergescope.progress import console
from mergescope.scoring.batching import batch_token_budget, length_batches, pad_batch, pad_id

KINDS = ("gram", "fisher")
GRAM_RULE = "bias_augmented"  # in the identity of every run a gram (RegMean) merge feeds: a biased layer's [X, 1]
"""How a biased linear layer's Gram is formed (and its bias merged); earlier runs, hashed without it, averaged the bias."""
STATS_KEYS = ["merge_stats"]  # in the identity of a data-aware merge only (and of a native job that lists one)


def check_stats(cfg: DictConfig) -> None:
    """The statistics' split differs from the scored one, and a count is set (before any run exists)."""
    ms = cfg.get("merge_stats") or {}
    split, scored = str(ms.get("split") or ""), str(cfg.data.get("split"))
    if not split:
        raise MergescopeError("a data-aware merge needs merge_stats.split (e.g. dev): the split its statistics are read on")
    why = data_mod.split_overlap(cfg.data, split, scored)
    if why:
        raise MergescopeError(f"merge_stats.split={split} and the scored split data.split={scored}: {why}; the statistics "
                              "must come from a disjoint split (e.g. merge_stats.split=dev, data.split=devtest)")
    n = ms.get("sentences")
    if n is None or int(n) < 1:
        raise MergescopeError(f"merge_stats.sentences={n}: give at least 1")


def stats_sentences(cfg: DictConfig, lang: str) -> tuple[str, ...]:
    c = plain_copy(cfg.data)
    c.split = str(cfg.merge_stats.split)
    return tuple(data_mod.load_side(c, lang).sentences[: int(cfg.merge_stats.sentences)])


def tied_names(model) -> set[str]:
    """Parameter names that share their tensor with another named parameter (every member of a tie)."""
    by: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by.setdefault(id(p), []).append(n)
    return {n for ns in by.values() if len(ns) > 1 for n in ns}


class _Grams:
    """Forward pre-hooks accumulating [X, 1]^T [X, 1] per linear input (the bias-augmented Gram; a linear without a bias
    reads its X^T X block); the first batch decides which layers share an input."""

    def __init__(self, model, names: Iterable[str]):
        wanted, tied = set(names), tied_names(model)
        self.mods = {f"{n}.weight": m for n, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and f"{n}.weight" in wanted and f"{n}.weight" not in tied}
        self.biased = {k for k, m in self.mods.items() if m.bias is not None and f"{k[:-len('weight')]}bias" in wanted}
        self.grams: dict[str, torch.Tensor] = {}
        self.alias: dict[str, str] = {}
        self.mask: torch.Tensor | None = None
        self.first = True
        self.held: list[tuple[torch.Tensor, str]] = []  # this batch's inputs, held so that no two share an id
        self.handles = [m.register_forward_pre_hook(self._hook(k)) for k, m in self.mods.items()]

    def _hook(self, key: str):
        def f(module, args):
            x = args[0]
            if self.first:
                same = next((k for t, k in self.held if t is x), None)
                if same is not None:
                    self.alias[key] = same
                    return
                self.held.append((x, key))
            elif key in self.alias:
                return
            rows = x[self.mask] if x.shape[:-1] == self.mask.shape else x.reshape(-1, x.shape[-1])
            rows = torch.cat([rows.to(torch.float64), torch.ones((rows.shape[0], 1), dtype=torch.float64, device=rows.device)], 1)
            g = rows.T @ rows
            if key in self.grams:
                self.grams[key].add_(g)
            else:
                self.grams[key] = g
        return f

    def done_batch(self) -> None:
        self.first, self.held = False, []

    def result(self) -> dict[str, torch.Tensor]:
        """weight name -> X^T X (no bias) or the augmented [X, 1]^T [X, 1] (a bias, also under the bias's name)."""
        for h in self.handles:
            h.remove()
        full = {**self.grams, **{k: self.grams[v] for k, v in self.alias.items()}}
        out = {}
        for k, g in full.items():
            if k in self.biased:
                out[k] = out[f"{k[:-len('weight')]}bias"] = g
            else:
                out[k] = g[:-1, :-1].contiguous()
        return out


@torch.no_grad()
def gram_stats(model, tokenizer, sentences: Sequence[str], names: Iterable[str], max_length: int = 512,
               batch_tokens="auto") -> tuple[dict[str, torch.Tensor], int]:
    """(weight name -> G = X^T X of that linear layer's inputs, or for a linear with a bias the augmented
    [X, 1]^T [X, 1] under its weight's and its bias's names; real tokens read)."""
    device = next(model.parameters()).device
    ids = sentence_ids(tokenizer, sentences, max_length)
    lengths = np.array([len(s) for s in ids])
    hooks = _Grams(model, names)
    try:
        for b in length_batches(lengths, batch_token_budget(batch_tokens, device)):
            x, m, p = pad_batch([ids[i] for i in b], pad_id(tokenizer), "right", device)
            hooks.mask = m.bool()
            model(input_ids=x, attention_mask=m, position_ids=p, use_cache=False)
            hooks.done_batch()
    finally:
        out = hooks.result()
    return out, int(lengths.sum())


def fisher_stats(model, tokenizer, sentences: Sequence[str], names: Iterable[str],
                 max_length: int = 512) -> tuple[dict[str, torch.Tensor], int]:
    """(parameter name -> diagonal empirical Fisher, tokens read); tied names share one Fisher."""
    wanted = set(names)
    named = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if n in wanted and p.dtype.is_floating_point]
    unique = list({id(p): p for _, p in named}.values())
    acc = {id(p): torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in unique}
    flags = {id(p): p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in acc)
    device = next(model.parameters()).device
    ids = sentence_ids(tokenizer, sentences, max_length)
    try:
        with torch.enable_grad():
            for s in ids:  # one backward per sentence: per-example squared gradients (module doc)
                x = torch.tensor([s], device=device)
                logits = model(input_ids=x, use_cache=False).logits[:, :-1]
                logits = logits[..., : real_vocab(tokenizer, logits.shape[-1])].float()
                loss = torch.nn.functional.cross_entropy(logits[0], x[0, 1:], reduction="sum")
                for p, g in zip(unique, torch.autograd.grad(loss, unique)):
                    acc[id(p)].add_(g.float().square())
    finally:
        for p in model.parameters():
            p.requires_grad_(flags[id(p)])
    n = max(len(ids), 1)
    return {name: acc[id(p)] / n for name, p in named}, int(sum(len(s) for s in ids))


def model_stats(kind: str, model, tokenizer, sentences: Sequence[str], names: Iterable[str],
                max_length: int) -> tuple[dict[str, torch.Tensor], int]:
    if kind == "gram":
        return gram_stats(model, tokenizer, sentences, names, max_length)
    if kind == "fisher":
        return fisher_stats(model, tokenizer, sentences, names, max_length)
    raise MergescopeError(f"unknown statistics '{kind}': choose one of {', '.join(KINDS)}")


def each_model(kind: str, cfg: DictConfig, host, tokenizer, langs: Sequence[str], write, restore,
               names: Sequence[str]) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
    """The statistics of every model in turn: ``write(i)`` puts model i's tensors into ``host``, read on model i's own
    language ``langs[i]``; ``restore()`` after. Returns the per-model statistics and the metrics that say what was read
    (``stats_tokens``, ``stats_sentences``, ``stats_s``)."""
    started = time.perf_counter()
    out, tokens, n_sent = [], 0, 0
    try:
        for i, lang in enumerate(langs):
            write(i)
            sents = stats_sentences(cfg, lang)
            s, t = model_stats(kind, host, tokenizer, sents, names, int(cfg.represent.max_length))
            out.append(s)
            tokens, n_sent = tokens + t, n_sent + len(sents)
    finally:
        restore()
    secs = time.perf_counter() - started
    console.print(f"  {kind} statistics of {len(langs)} models on {cfg.merge_stats.split}: {n_sent} sentences, "
                  f"{tokens} tokens ({secs:.1f} s)")
    return out, {"stats_tokens": float(tokens), "stats_sentences": float(n_sent), "stats_s": secs}


def pair_stats(cfg: DictConfig, pair, entry) -> tuple[list[dict[str, torch.Tensor]] | None, dict[str, float]]:
    """A data-aware operator's statistics of both models of a native pair (a :class:`mergescope.native.pair.Loaded`),
    each on its own language, computed once per kind for the job's pair and kept on it (``pair.merge_stats``), and what
    was read, as metrics. ``(None, {})`` for the other operators."""
    kind = entry.meta.get("needs_stats")
    if not kind:
        return None, {}
    if kind not in pair.merge_stats:
        sides = (pair.restore, lambda: pair.interpolate(1.0))  # model a is the host; t = 1 writes b's shared tensors
        pair.merge_stats[kind] = each_model(kind, cfg, pair.host, pair.tok, [str(cfg.pair.a.lang), str(cfg.pair.b.lang)],
                                            lambda i: sides[i](), pair.restore, pair.coverage.shared)
    return pair.merge_stats[kind]
