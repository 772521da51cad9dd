"""One forward pass of a model over one side of the data serves every arm that reads it (``represent.one_forward``).

Per (model by content, data digest, language, split, precision, max_length) ONE pass over the sentences gives:

- each sentence's scores under the project's one definition of NLL (:mod:`mergescope.scoring.bpb`: fed from the
  model's start token, every token of the sentence predicted, the first apart, padded vocabulary rows out);
- the pooled states at every layer (embeddings to the final post-norm state) for each pooling asked.

Both come from the same input: ``[start] + the sentence's tokens``, the scoring input. The start token is fed but
never pooled (as a tokenizer's own BOS is on the separate path, :func:`mergescope.represent.forward.pooling_mask`).
For a tokenizer that puts its own BOS first (Gemma, Llama's ``<s>``) that is exactly the separate path's input, and
the states are equal to it; for one that adds none (Qwen2.5, SmolLM2) the states are those of a sentence read after
the document separator the model saw before each document in pretraining, where the separate path feeds the sentence
with nothing before it. A study that sets ``represent.one_forward: true`` measures its representations this way;
its measure, agreement, shared-space and routing jobs carry ``forward: one`` in their identity, so no run measured
the other way is reused for them.

Quality (``task=quality``) and routing read the scores, the measure and shared-space arms the states: one forward
per model and side instead of two to four. Cached by content (:class:`ForwardKey`, one entry per pooling and one for
the scores), each entry checksummed and checked against its key on read (a damaged or misfiled entry is recomputed,
never used), and written only once the whole pass has succeeded.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from mergescope.errors import MergescopeError
from mergescope.progress import bar
from mergescope.represent.cache import ReprCache
from mergescope.represent.forward import POOLINGS, pool, pooling_mask
from mergescope.scoring.batching import batch_token_budget, length_batches, pad_batch, pad_id
from mergescope.scoring.bpb import Head, Scores, FinalHidden, prepare, real_vocab, window_scores

VERSION = 1
SCORE_COLUMNS = ("nll", "tokens", "bytes", "truncated", "first_nll", "first_bytes")


@dataclass(frozen=True)
class ForwardKey:
    """Cache key of one part (``what``: ``scores`` or ``layers:<pooling>``) of one model's forward over one side."""

    model: str
    data: str
    lang: str
    split: str
    dtype: str
    max_length: int
    what: str

    @property
    def digest(self) -> str:
        blob = json.dumps({**self.__dict__, "kind": "one_forward", "v": VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]


def enabled(cfg: DictConfig) -> bool:
    """Whether a study reads its representations and scores from the one forward (``represent.one_forward``)."""
    return bool((cfg.get("represent") or {}).get("one_forward"))


def identity(cfg: DictConfig) -> dict[str, str]:
    """What a job that reads representations adds to its identity when they come from the one forward (nothing
    otherwise: every run measured on the separate path keeps its identity)."""
    return {"forward": "one"} if enabled(cfg) else {}


def hidden_states(model, out, ids: torch.Tensor, last: torch.Tensor) -> list[torch.Tensor]:
    """The L+1 states of one batch from a causal LM's output with ``output_hidden_states``, laid out as the all-layer
    path lays them (:func:`mergescope.represent.layers.layout`)."""
    from mergescope.represent.layers import layout

    return layout(list(out.hidden_states), last, model.get_input_embeddings()(ids))


class Checkpoint:
    """A long forward's partial results on disk, so that a killed launch resumes where it stopped: the sentences done
    so far with their scores and states, written at most every ``every_s`` seconds (atomically, checksummed:
    :mod:`mergescope.integrity`) under the entry's own key, and deleted once the entry is written. A checkpoint that
    is damaged, or of another batching (another ``batch_tokens``), is ignored and the pass starts over."""

    def __init__(self, path: Path, ident: str, every_s: float = 300.0):
        self.path, self.ident, self.every_s = Path(path), ident, float(every_s)
        self.last = time.monotonic()

    def load(self, n: int, poolings: Sequence[str]) -> dict[str, np.ndarray] | None:
        from mergescope.integrity import read_entry

        payload = read_entry(self.path) if self.path.is_file() else None
        if payload is None:
            return None
        try:
            got = dict(np.load(io.BytesIO(payload), allow_pickle=False))
        except (ValueError, OSError, EOFError):
            return None
        if str(got.get("ident", np.array(""))) != self.ident or got["done"].shape != (n,) or \
                any(f"layers:{p}" not in got for p in poolings):
            return None
        return got

    def due(self) -> bool:
        return time.monotonic() - self.last >= self.every_s

    def save(self, state: dict[str, np.ndarray]) -> None:
        from mergescope.integrity import write_entry

        buf = io.BytesIO()
        np.savez(buf, ident=np.array(self.ident), **state)
        write_entry(self.path, buf.getvalue())
        self.last = time.monotonic()

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


@torch.inference_mode()
def forward_all(model, tokenizer, sentences: Sequence[str], poolings: Sequence[str] = ("sgpt",), batch_tokens="auto",
                max_length: int = 512, progress: bool = True, label: str = "forward",
                checkpoint: Checkpoint | None = None) -> tuple[Scores, dict[str, np.ndarray], dict[str, Any]]:
    """One pass: :class:`~mergescope.scoring.bpb.Scores` of ``sentences`` (equal to
    :func:`~mergescope.scoring.bpb.score_sentences`) and ``{pooling: (L+1, n, d) float64}`` of the same forward, the
    start token left out of every pooling; plus stats. With ``checkpoint`` the batches done are saved as it goes and
    a pass killed midway resumes from them (the same numbers: each batch is computed alone)."""
    bad = [p for p in poolings if p not in POOLINGS]
    if bad:
        raise MergescopeError(f"unknown pooling '{bad[0]}': choose one of {', '.join(POOLINGS)}")
    device = next(model.parameters()).device
    prep = prepare(tokenizer, sentences, max_length)
    lengths = np.array([len(s) for s in prep.ids])
    head = Head(model, real_vocab(tokenizer, model.get_output_embeddings().weight.shape[0]))
    n = len(prep.ids)
    nll, nll0 = np.zeros(n), np.zeros(n)
    layers: dict[str, np.ndarray] = {}
    batches = length_batches(lengths, batch_token_budget(batch_tokens, device))
    done = np.zeros(n, dtype=bool)
    resumed = checkpoint.load(n, poolings) if checkpoint is not None else None
    if resumed is not None:
        done, nll, nll0 = resumed["done"].astype(bool), resumed["nll"], resumed["nll0"]
        layers = {p: resumed[f"layers:{p}"] for p in poolings}

    def state() -> dict[str, np.ndarray]:
        return {"done": done, "nll": nll, "nll0": nll0, **{f"layers:{p}": a for p, a in layers.items()}}

    with bar() as pb:
        task = pb.add_task(label, total=n, visible=progress, completed=int(done.sum()))
        for b in batches:
            if done[b].all():  # a resumed pass: this batch was computed before the kill
                continue
            x, m, p = pad_batch([prep.ids[i] for i in b], pad_id(tokenizer), "right", device)
            targets = torch.nn.functional.pad(x[:, 1:], (0, 1), value=0)
            scored = torch.nn.functional.pad(m[:, 1:], (0, 1), value=0)
            kept: dict[str, Any] = {}

            def call(**kw):  # the scorer's own forward, asked for every hidden state as well
                with FinalHidden(model) as fin:
                    kept["out"] = model(**kw, output_hidden_states=True)
                kept["last"] = fin.value
                return kept["out"]

            got = window_scores(_Calling(model, call), head, x, m, p, targets, scored, first=True)
            nll[b], nll0[b] = got[0].cpu().numpy(), got[2].cpu().numpy()
            states = hidden_states(model, kept["out"], x, kept["last"])
            pm = pooling_mask(m, np.ones(len(b), dtype=bool))  # the start token: fed, never pooled
            for name in poolings:
                pooled = torch.stack([pool(h, pm, name) for h in states]).cpu().numpy()
                if name not in layers:
                    layers[name] = np.empty((pooled.shape[0], n, pooled.shape[2]), dtype=np.float64)
                layers[name][:, b] = pooled
            kept.clear()
            done[b] = True
            pb.advance(task, len(b))
            if checkpoint is not None and checkpoint.due() and not done.all():
                checkpoint.save(state())
    scores = Scores(nll, (lengths - 1).astype(np.float64), prep.bytes, prep.truncated, nll0, prep.first_bytes)
    return scores, layers, {"n_tokens": int(lengths.sum()), "n_truncated": int(prep.truncated.sum()),
                            "n_batches": len(batches), "n_leading_special": n, "start_token": "scoring"}


class _Calling:
    """``model`` as :func:`~mergescope.scoring.bpb.window_scores` calls it, the call routed through ``call`` (so the
    scorer's forward also returns every hidden state), every other attribute the model's own."""

    def __init__(self, model, call):
        self._model, self._call = model, call

    def __call__(self, **kw):
        return self._call(**kw)

    def __getattr__(self, name):
        return getattr(self._model, name)


def scores_array(s: Scores) -> np.ndarray:
    return np.stack([np.asarray(getattr(s, c), dtype=np.float64) for c in SCORE_COLUMNS], axis=1)


def scores_of(a: np.ndarray) -> Scores:
    cols = {c: a[:, i].copy() for i, c in enumerate(SCORE_COLUMNS)}
    cols["truncated"] = cols["truncated"].astype(bool)
    return Scores(**cols)


def poolings_of(cfg: DictConfig) -> list[str]:
    """Every pooling a study's arms read (the measure arm's, the shared space's), the measure arm's first."""
    r, sh = cfg.represent, cfg.get("shared") or {}
    return list(dict.fromkeys([str(r.pooling), str(sh.get("pooling") or r.pooling), *map(str, sh.get("poolings") or [])]))


def keys(cfg: DictConfig, entry: Any, ref, side, poolings: Sequence[str]) -> dict[str, ForwardKey]:
    from mergescope import models, precision

    base = dict(model=models.fingerprint(ref), data=side.digest, lang=side.lang, split=str(cfg.data.split),
                dtype=precision.dtype_tag(cfg, entry), max_length=int(cfg.represent.max_length))
    return {"scores": ForwardKey(**base, what="scores"), **{p: ForwardKey(**base, what=f"layers:{p}") for p in poolings}}


def one_forward(cfg: DictConfig, entry: Any, ref, side, poolings: Sequence[str] | None = None,
                pending: list | None = None) -> tuple[Scores, dict[str, np.ndarray], dict[str, Any]]:
    """The one forward of ``entry`` over ``side``: its scores and its all-layer states for ``poolings`` (every pooling
    the study reads by default), from the cache or ONE pass that computes every part (``no_cache``: always a pass,
    nothing written). With ``pending`` (a list) the fresh entries are appended as callables instead of written, so a
    job writes them only once every side has succeeded."""
    from mergescope import models, precision
    from mergescope.represent.cache import cache_enabled, representation_problem
    from mergescope.represent.job import repr_cache

    poolings = list(dict.fromkeys(poolings or poolings_of(cfg)))
    ks = keys(cfg, entry, ref, side, poolings_of(cfg) + [p for p in poolings if p not in poolings_of(cfg)])
    cache: ReprCache = repr_cache(cfg)
    use = cache_enabled(cfg)
    hits = {name: cache.get(k) for name, k in ks.items()} if use else {}
    if use and all(hits.get(name) is not None for name in ["scores", *poolings]):
        meta = {**hits["scores"][1], "cache": "hit"}
        return scores_of(hits["scores"][0]), {p: hits[p][0] for p in poolings}, meta
    r = cfg.represent
    lm = models.load(precision.forward_entry(cfg, entry), cfg.device, ref=ref)
    every = [name for name in ks if name != "scores"]
    ck = None
    if use:  # a killed pass resumes: its batches so far, under the scores entry's key, the poolings and the batching
        ident = f"{ks['scores'].digest}:{','.join(every)}:{r.batch_tokens}:{cfg.device}"
        ck = Checkpoint(cache.root / "partial" / f"{ks['scores'].digest}.npz", ident)
    with precision.active(cfg):
        scores, layers, stats = forward_all(lm.model, lm.tokenizer, side.sentences, poolings=every,
                                            batch_tokens=r.batch_tokens, max_length=int(r.max_length),
                                            progress=bool(cfg.get("progress", True)), label=f"forward {ref.label}",
                                            checkpoint=ck)
    for name, arr in layers.items():
        problem = representation_problem(arr[-1])
        if problem:
            raise MergescopeError(f"{ref.label} on {side.source}: {problem} (pooling {name}); nothing was measured or "
                                  "cached: check the model's weights and dtype (float32 avoids overflow)")
    if not np.isfinite(scores.nll).all():
        raise MergescopeError(f"{ref.label} on {side.source}: a sentence's NLL is not finite; nothing was measured or "
                              "cached: check the model's weights and dtype (float32 avoids overflow)")
    meta = {"true_config": lm.true_config, **stats}
    del lm
    if use:
        writes = [lambda: cache.put(ks["scores"], scores_array(scores), meta)]
        writes += [(lambda k=ks[name], a=layers[name]: cache.put(k, a, meta)) for name in every]
        writes.append(ck.clear)  # the entry written: its partial pass is no longer needed
        for w in writes:
            w() if pending is None else pending.append(w)
    return scores, {p: layers[p] for p in poolings}, {**meta, "cache": "miss" if use else "off"}
