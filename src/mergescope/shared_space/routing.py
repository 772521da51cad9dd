"""Routing (the paper's §8) with bits per byte as the gradeable task: every sentence is scored by every
model (:mod:`mergescope.scoring.bpb`, the project's one definition: comparable across tokenizers, each sentence starts from the
model's start token, so every one of its tokens is predicted). Per held-out fold, routers pick one model per sentence:

- ``always_best``: the model with the lowest bits per byte on the training fold;
- ``space``: the majority label of the sentence's k nearest training-fold neighbours in the shared space
  (fitted on the training fold; a sentence's position is the mean of its models' positions), each labelled
  with the model that was best on it;
- ``domain``: the best model of the sentence's category on the training fold (the paper's confound: a signal
  that is category membership);
- ``oracle``: the best model for each sentence (an upper bound, not a router).

Every bits-per-byte figure over a set of sentences (a model's, a router's, a fold's) is the total NLL in bits over
the total bytes scored, never a mean of per-sentence ratios; a sentence's own bits per byte only picks its best model.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from mergescope.shared_space.evaluate import fit_space
from mergescope.shared_space.gpa import folds

def knn_labels(Q: np.ndarray, G: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """Majority label of each query's k cosine nearest gallery rows (ties: the nearest's label)."""
    qn = Q / np.maximum(np.linalg.norm(Q, axis=1, keepdims=True), 1e-300)
    gn = G / np.maximum(np.linalg.norm(G, axis=1, keepdims=True), 1e-300)
    near = np.argsort(-(qn @ gn.T), axis=1)[:, :k]
    out = []
    for row in labels[near]:
        counts = Counter(row.tolist())
        top = max(counts.values())
        out.append(next(v for v in row if counts[v] == top))
    return np.array(out)


def pooled(bits: np.ndarray, nbytes: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """(N,) each model's bits per byte over ``rows`` (all when None): total bits over total bytes."""
    sel = slice(None) if rows is None else rows
    return bits[sel].sum(axis=0) / nbytes[sel].sum(axis=0)


def route(bits: np.ndarray, nbytes: np.ndarray, Xs, doms, dim: int, k_folds: int, knn: int, seed: int) -> dict[str, np.ndarray]:
    """Per sentence (held-out in its fold): the model each router picks. ``bits`` and ``nbytes`` are (n, N models): each
    sentence's NLL in bits and the UTF-8 bytes scored under each model (a sentence with no bytes left, e.g. its one
    token set apart, counts as a tie: model 0)."""
    n = bits.shape[0]
    picks = {name: np.zeros(n, dtype=int) for name in ("always_best", "space", "domain", "oracle")}
    best = np.divide(bits, nbytes, out=np.zeros_like(bits), where=nbytes > 0).argmin(axis=1)
    picks["oracle"] = best
    for test in folds(n, k_folds, seed):
        train = np.setdiff1d(np.arange(n), test)
        picks["always_best"][test] = int(pooled(bits, nbytes, train).argmin())
        space = fit_space([x[train] for x in Xs], dim)
        g = np.mean([space.project(i, x[train]) for i, x in enumerate(Xs)], axis=0)
        q = np.mean([space.project(i, x[test]) for i, x in enumerate(Xs)], axis=0)
        picks["space"][test] = knn_labels(q, g, best[train], knn)
        if doms is not None:
            d = np.asarray(doms)
            for name in set(d[test]):
                sel = train[d[train] == name]
                chosen = int(pooled(bits, nbytes, sel).argmin()) if len(sel) else picks["always_best"][test][0]
                picks["domain"][test[d[test] == name]] = chosen
    if doms is None:
        del picks["domain"]
    return picks


def summarise(bits: np.ndarray, nbytes: np.ndarray, picks: dict[str, np.ndarray]) -> dict[str, float]:
    """Bits per byte of each router (total bits of the picked models over their total bytes), its gain over
    always-best (positive = better), agreement with the oracle."""
    rows = np.arange(bits.shape[0])
    out = {}
    for name, p in picks.items():
        out[f"bpb_{name}"] = float(bits[rows, p].sum() / nbytes[rows, p].sum())
        out[f"oracle_agreement_{name}"] = float(np.mean(p == picks["oracle"]))
    for name in picks:
        out[f"gain_{name}"] = out["bpb_always_best"] - out[f"bpb_{name}"]
    return out


def gain_intervals(bits: np.ndarray, nbytes: np.ndarray, picks: dict[str, np.ndarray], groups, what: str,
                   suffix: str = "") -> dict[str, float]:
    """Each router's gain over always-best (bits per byte, positive = better) with its paired 95% interval: the two
    routers' picked sentences resampled together by document (:mod:`mergescope.intervals`)."""
    from mergescope.intervals import paired_difference

    rows = np.arange(bits.shape[0])
    ab = picks["always_best"]
    out: dict[str, float] = {}
    for name, p in picks.items():
        if name == "always_best":
            continue
        d = paired_difference(bits[rows, ab], bits[rows, p], nbytes[rows, ab], nbytes[rows, p], groups=groups, resampled=what)
        out.update(d.metrics(f"gain_{name}{suffix}"))
    return out
