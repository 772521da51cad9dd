"""task=precision_check: is a faster precision (:mod:`mergescope.precision`) harmless for an arm, on these models?

Every model of the check (``precision_check.models``, else the study's ``models``) reads the same
``precision_check.sentences`` FLORES lines of one language (parallel text: the models' numbers are paired over the same
sentences), once in float32 and once in each faster precision (``medium``: float32 weights with bfloat16 products;
``bfloat16``: a bfloat16 copy of the model), and the arm's own quantities are compared:

- the pooled final states (``represent.pooling`` / ``represent.layer``): their relative difference from float32;
- linear CKA of every pair: ``|CKA_p - CKA_float32|`` against the half-width of the float32 CKA's 95% jackknife interval
  (what the representation arm reports with it);
- every sentence's NLL (bits per byte without the first token, so models of different tokenizers compare): ``p -
  float32`` with its paired interval, against the half-width of the paired interval of the float32 difference between
  this model and each other one (the routing arm's comparisons; the narrowest counts).

A precision passes for an arm where every such difference is below ``precision_check.tolerance`` (0.1: a tenth) of
its half-width: the representation arms (measure, shared_space, agreement) read the CKA criterion, the NLL arms
(quality, routing) the NLL one. One run (kind=precision_check) logs every number and the verdicts
(``pass.<arm>.<precision>``: 1 or 0) with ``precision_check.csv``; the report shows them. The verdict is evidence for
the study file's ``precision:`` per arm, not applied by itself.
"""

from __future__ import annotations

import io
import itertools
import math
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from mergescope import data as data_mod
from mergescope import models
from mergescope import precision as prec_mod
from mergescope.scoring.bpb import Scores, score_sentences
from mergescope.config import plain_copy
from mergescope.documents import documents
from mergescope.errors import MergescopeError
from mergescope.evidence import paired
from mergescope.metrics.cka import cka_jackknife, linear_cka
from mergescope.progress import console
from mergescope.represent import embed
from mergescope.runs import JobResult, JobSpec, model_label, run_once

__all__ = ["ARMS", "run_precision_check", "verdicts"]

ARMS = {"measure": "cka", "shared_space": "cka", "agreement": "cka", "quality": "nll", "routing": "nll"}
"""Each forward-only arm and the criterion that decides for it."""
KEYS = ["data", "represent", "precision_check"]


def _settings(cfg: DictConfig) -> tuple[list[str], list[str], int, str, float]:
    pc = cfg.get("precision_check")
    if pc is None:
        raise MergescopeError("task=precision_check needs its settings (precision_check: in conf/config.yaml)")
    names = [str(m) for m in (pc.get("models") or cfg.get("models") or [])]
    if len(names) < 2:
        raise MergescopeError("task=precision_check compares models: give precision_check.models=[a,b,...] (two or more) "
                              "or run it in a study that lists models")
    precs = [str(p) for p in pc.get("precisions") or []]
    bad = [p for p in precs if p not in ("medium", "bfloat16")]
    if bad or not precs:
        raise MergescopeError(f"precision_check.precisions={precs}: name the faster precisions to check, medium and/or bfloat16")
    n = int(pc.sentences)
    if n < 16:
        raise MergescopeError(f"precision_check.sentences={n}: give at least 16 (the jackknife and the paired intervals need them)")
    tol = float(pc.tolerance)
    if not 0 < tol <= 1:
        raise MergescopeError(f"precision_check.tolerance={tol}: give a share of the half-width in (0, 1] (0.1 = a tenth)")
    for p in precs:
        prec_mod._check_hardware(p, str(cfg.get("device") or "cpu"))
    return names, precs, n, str(pc.lang), tol


def _forward(model, tok, sentences, cfg: DictConfig, value: str) -> tuple[np.ndarray, Scores]:
    """Pooled states and per-sentence scores of ``model`` in precision ``value``."""
    r = cfg.represent
    before = torch.get_float32_matmul_precision()
    if value == "medium":
        torch.set_float32_matmul_precision("medium")
    m = prec_mod.bfloat16_copy(model, native=True) if value == "bfloat16" else model  # checked: the units exist
    try:
        X, _ = embed(m, tok, sentences, pooling=r.pooling, layer=int(r.layer), batch_tokens=r.batch_tokens,
                     max_length=int(r.max_length), padding_side=r.padding_side, progress=bool(cfg.progress),
                     label=f"embed {value}")
        sc = score_sentences(m, tok, sentences, r.batch_tokens, int(r.max_length))
    finally:
        torch.set_float32_matmul_precision(before)
    return X, sc


def verdicts(rows: list[dict[str, Any]], precs: list[str], tol: float) -> dict[str, float]:
    """``pass.<arm>.<precision>`` (1 / 0) and ``worst.<criterion>.<precision>`` (the largest difference over its
    half-width) from the check's rows (``criterion``, ``precision``, ``ratio``)."""
    out: dict[str, float] = {}
    for p in precs:
        for crit in ("cka", "nll"):
            ratios = [r["ratio"] for r in rows if r["precision"] == p and r["criterion"] == crit]
            worst = max(ratios) if ratios and all(math.isfinite(x) for x in ratios) else math.inf
            out[f"worst.{crit}.{p}"] = worst
        for arm, crit in ARMS.items():
            out[f"pass.{arm}.{p}"] = float(out[f"worst.{crit}.{p}"] < tol)
    return out


def run_precision_check(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    from mergescope.native.spec import model_entry

    names, precs, n, lang, tol = _settings(cfg)
    entries = [model_entry(cfg, m, "precision_check.models", lang) for m in names]
    for e in entries:
        e.lang, e.dtype = lang, "float32"  # every model on the same sentences, loaded in float32 (the reference)
    refs = [models.resolve(e) for e in entries]
    dcfg = plain_copy(cfg.data)
    dcfg.max_sentences = n
    side = data_mod.load_side(dcfg, lang)
    groups, _ = documents(dcfg, lang, len(side.sentences))
    what = "article" if groups is not None else "sentence"
    labels = [model_label(e) for e in entries]

    def body(job) -> dict[str, float]:
        reps: dict[str, list[np.ndarray]] = {p: [] for p in ("float32", *precs)}
        scores: dict[str, list[Scores]] = {p: [] for p in ("float32", *precs)}
        for e, r in zip(entries, refs):
            lm = models.load(e, cfg.device, ref=r, quiet=True, dtype="float32")
            for p in ("float32", *precs):
                X, sc = _forward(lm.model, lm.tokenizer, side.sentences, cfg, p)
                reps[p].append(X)
                scores[p].append(sc)
            del lm
        rows: list[dict[str, Any]] = []
        out: dict[str, float] = {}
        blocks = min(50, len(side.sentences))
        for i, j in itertools.combinations(range(len(entries)), 2):
            est, lo, hi = cka_jackknife(reps["float32"][i], reps["float32"][j], n_blocks=blocks, device="cpu")
            half = (hi - lo) / 2
            for p in precs:
                d = abs(linear_cka(reps[p][i], reps[p][j], device="cpu") - est)
                rows.append({"criterion": "cka", "what": f"{labels[i]} ~ {labels[j]}", "precision": p, "difference": d,
                             "half_width": half, "ratio": d / half if half > 0 else math.inf})
        for i in range(len(entries)):
            ref32 = scores["float32"][i]
            halves = [paired(ref32, scores["float32"][j], groups, what, "rest", unit="byte")
                      for j in range(len(entries)) if j != i]
            half = min((h.hi - h.lo) / 2 for h in halves)
            for p in precs:
                diff = paired(scores[p][i], ref32, groups, what, "rest", unit="byte")
                rel = float(np.linalg.norm(reps[p][i] - reps["float32"][i]) / np.linalg.norm(reps["float32"][i]))
                out[f"pooled_rel_diff.{labels[i]}.{p}"] = rel
                out[f"nll_diff.{labels[i]}.{p}"] = scores[p][i].rest().nats_per_token - ref32.rest().nats_per_token
                rows.append({"criterion": "nll", "what": labels[i], "precision": p, "difference": abs(diff.estimate),
                             "half_width": half, "ratio": abs(diff.estimate) / half if half > 0 else math.inf,
                             "interval": f"[{diff.lo:+.2e}, {diff.hi:+.2e}]"})
        out.update(verdicts(rows, precs, tol))
        buf = io.StringIO()
        buf.write("criterion,what,precision,difference,half_width,ratio\n")
        for r in rows:
            buf.write(f"{r['criterion']},{r['what']},{r['precision']},{r['difference']:.6e},{r['half_width']:.6e},{r['ratio']:.4f}\n")
        job.log_text(buf.getvalue(), "tables/precision_check.csv")
        job.log_params({"models": labels, "precisions": precs, "resampled_by": what})
        for p in precs:
            ok = [a for a in ARMS if out[f"pass.{a}.{p}"] == 1.0]
            console.print(f"  precision {p}: CKA worst {out[f'worst.cka.{p}']:.3f}, NLL worst {out[f'worst.nll.{p}']:.3f} of "
                          f"the half-width (tolerance {tol:g}); harmless for: {', '.join(ok) or 'no arm'}")
        return {**out, "n_sentences": float(len(side.sentences)), "n_models": float(len(entries)), "tolerance": tol}

    tags = {"kind": "precision_check", "models": ",".join(labels), "lang": lang, "data": cfg.data.name,
            "split": cfg.data.split, "precisions": ",".join(precs)}
    return run_once(cfg, JobSpec(f"precision_check {len(labels)} models", tags, task="precision_check", keys=KEYS,
                                 reads=tuple(refs), extra={"models": labels}), body, overrides)
