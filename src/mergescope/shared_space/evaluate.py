"""Held-out retrieval of the shared space against pairwise linear maps, over k folds; the D sweep; transfer
across FLORES domains (fit on two, test on the third, then refit including it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mergescope.shared_space.gpa import (GPAFit, Reduction, apply_map, folds, gpa, linear_map, pca_reduce, pooled_hits, pooled_p1,
                                   ridge_lambda, select_ridge)

DEFAULT_RIDGES = (1e-4, 1e-3, 1e-2, 1e-1)


@dataclass
class Space:
    """A fitted shared space: one reduction and one rotation per model."""

    reductions: list[Reduction]
    fit: GPAFit

    def project(self, i: int, X: np.ndarray) -> np.ndarray:
        return self.reductions[i].apply(X) @ self.fit.rotations[i]


def effective_dim(Xs: Sequence[np.ndarray], dim: int) -> int:
    """The D a space fitted on these rows really has: ``dim`` capped at the smallest width and at n - 1 (beyond a
    model's rank its coordinates are zero, the rotations there are arbitrary and GPA would iterate without
    converging). A D sweep above the cap repeats the capped D's numbers."""
    return int(min(int(dim), *(min(x.shape[1], x.shape[0] - 1) for x in Xs)))


def fit_space(Xs: Sequence[np.ndarray], dim: int, tol: float = 1e-7) -> Space:
    """PCA per model to a common D (``effective_dim``), then GPA."""
    dim = effective_dim(Xs, dim)
    reduced = [pca_reduce(x, dim) for x in Xs]
    return Space([r for r, _ in reduced], gpa([z for _, z in reduced], tol=tol))


def pool_label(size: int | None) -> str:
    return "all" if size is None else str(int(size))


@dataclass
class Retrieval:
    """Held-out P@1 matrices (``gpa@<pool>``, ``pairwise@<pool>``; row = query model, column = gallery model) averaged
    over the folds; the pairwise maps' ridge chosen per fold and ordered pair on a validation part of that fold's
    training rows (``ridges``: folds x N x N), its lambda (same shape), and the D the spaces really had."""

    mats: dict[str, np.ndarray]
    ridges: np.ndarray
    lambdas: np.ndarray
    dim: int
    dim_requested: int
    hits: dict[str, np.ndarray] | None = None   # per sentence (held out in its fold): hits over every ordered pair
    scored: dict[str, np.ndarray] | None = None  # and how many retrievals it was scored in (the pairs x its pool)


def _fold_matrices(Xs, train, test, dim, sizes, seed, ridges, hits=None, scored=None
                   ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    space = fit_space([x[train] for x in Xs], dim)
    shared = [space.project(i, x[test]) for i, x in enumerate(Xs)]
    reduced_train = [r.apply(x[train]) for r, x in zip(space.reductions, Xs)]
    reduced_test = [r.apply(x[test]) for r, x in zip(space.reductions, Xs)]
    n = len(Xs)
    out = {f"{kind}@{pool_label(s)}": np.full((n, n), np.nan) for kind in ("gpa", "pairwise") for s in sizes}
    chosen, lams = np.full((n, n), np.nan), np.full((n, n), np.nan)
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            r = select_ridge(reduced_train[a], reduced_train[b], ridges, seed=seed)
            chosen[a, b], lams[a, b] = r, ridge_lambda(reduced_train[a], r)
            mapped = apply_map(linear_map(reduced_train[a], reduced_train[b], r), reduced_test[a])
            for s in sizes:
                for kind, q, g in (("gpa", shared[a], shared[b]), ("pairwise", mapped, reduced_test[b])):
                    key = f"{kind}@{pool_label(s)}"
                    hit, done = pooled_hits(q, g, s, seed)
                    out[key][a, b] = float(hit.sum() / done.sum())
                    if hits is not None:
                        hits.setdefault(key, np.zeros(len(train) + len(test)))[test] += hit
                        scored.setdefault(key, np.zeros(len(train) + len(test)))[test] += done
    return out, chosen, lams


def retrieval_eval(Xs: Sequence[np.ndarray], dim: int, k: int = 5, sizes: Sequence[int | None] = (10, 32, None),
                   seed: int = 0, ridges: Sequence[float] = DEFAULT_RIDGES) -> Retrieval:
    """GPA against pairwise ridge maps by held-out retrieval over k folds (``Retrieval``). The ridge of each map is
    picked inside the fold's training rows; the held-out fold only scores."""
    n_rows = Xs[0].shape[0]
    parts = folds(n_rows, k, seed)
    acc: dict[str, list[np.ndarray]] = {}
    chosen, lams, dims = [], [], []
    hits: dict[str, np.ndarray] = {}
    scored: dict[str, np.ndarray] = {}
    for f, test in enumerate(parts):
        train = np.setdiff1d(np.arange(n_rows), test)
        dims.append(effective_dim([x[train] for x in Xs], dim))
        mats, r, lam = _fold_matrices(Xs, train, test, dim, sizes, seed + f, ridges, hits, scored)
        chosen.append(r)
        lams.append(lam)
        for key, m in mats.items():
            acc.setdefault(key, []).append(m)
    return Retrieval({key: np.mean(ms, axis=0) for key, ms in acc.items()}, np.stack(chosen), np.stack(lams),
                     int(min(dims)), int(dim), hits, scored)


def retrieval_matrices(Xs: Sequence[np.ndarray], dim: int, k: int = 5, sizes: Sequence[int | None] = (10, 32, None),
                       seed: int = 0, ridges: Sequence[float] = DEFAULT_RIDGES) -> dict[str, np.ndarray]:
    """The P@1 matrices of ``retrieval_eval``."""
    return retrieval_eval(Xs, dim, k, sizes, seed, ridges).mats


def off_diagonal_mean(m: np.ndarray) -> float:
    return float(np.nanmean(m[~np.eye(m.shape[0], dtype=bool)]))


def shared_p1(Xs, train, test, dim, size, seed) -> float:
    """Mean over ordered pairs of the shared space's P@1 on ``test`` when fitted on ``train``."""
    space = fit_space([x[train] for x in Xs], dim)
    z = [space.project(i, x[test]) for i, x in enumerate(Xs)]
    n = len(Xs)
    return float(np.mean([pooled_p1(z[a], z[b], size, seed) for a in range(n) for b in range(n) if a != b]))


def domain_transfer(Xs: Sequence[np.ndarray], domains: Sequence[str], dim: int, size: int | None = 32,
                    test_frac: float = 0.3, seed: int = 0) -> list[dict]:
    """For each domain h: fit on the training parts of the other domains, then on those of all domains;
    test both fits on h's held-out part (unseen / refit) and on the other domains' held-out parts."""
    dom = np.asarray(domains)
    rng = np.random.default_rng(seed)
    train_idx, test_idx = {}, {}
    for d in sorted(set(dom)):
        idx = rng.permutation(np.flatnonzero(dom == d))
        cut = int(round(len(idx) * test_frac))
        test_idx[d], train_idx[d] = idx[:cut], idx[cut:]
    rows = []
    for h in sorted(train_idx):
        others = [d for d in sorted(train_idx) if d != h]
        excl = np.concatenate([train_idx[d] for d in others])
        incl = np.concatenate([excl, train_idx[h]])
        seen = np.concatenate([test_idx[d] for d in others])
        rows.append({"held_out": h, "n_fit_excl": len(excl), "n_fit_incl": len(incl),
                     "held_out_excl": shared_p1(Xs, excl, test_idx[h], dim, size, seed),
                     "held_out_incl": shared_p1(Xs, incl, test_idx[h], dim, size, seed),
                     "seen_excl": shared_p1(Xs, excl, seen, dim, size, seed),
                     "seen_incl": shared_p1(Xs, incl, seen, dim, size, seed)})
    return rows
