"""The forecast's statistics, in float64 numpy: a sparse linear model (lasso on standardised features, its penalty
chosen by an inner leave-one-group-out split of the training rows only), a single-best-feature baseline, held-out
validation by leaving one group out (a family of merges, or an operator), Spearman and AUROC with intervals from a
bootstrap over clusters (the pairs: a pair's merges share its features), a shuffled-target control and a calibration
table.

Nothing here reads MLflow or torch: :mod:`mergescope.forecast.table` builds the rows, :mod:`mergescope.forecast.job`
logs what these functions return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.stats import rankdata

__all__ = ["Lasso", "fit_lasso", "fit_lassos", "coordinate_descent", "average_ranks", "spearman", "auroc", "cluster_bootstrap", "leave_group_out", "inner_folds", "paired_spearman_gap", "best_feature",
           "calibration", "Validation", "validate", "LAMBDAS", "MIN_CLASS"]

LAMBDAS = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3)  # penalties on standardised features and a centred target
MIN_CLASS = 10  # an AUROC is read only with at least this many rows of each outcome
EXTRAPOLATION_SD = 3.0  # a kept diagnostic this many sd from the benchmark's mean: the forecast extrapolates, said


def _standardise(X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mu = X.mean(axis=0)
    sd = X.std(axis=0)
    sd = np.where(sd > 0, sd, 1.0)  # a constant column stays 0 after centring: its weight is 0
    return (X - mu) / sd, mu, sd


@dataclass
class Lasso:
    """A fitted model: ``y ~ intercept + sum(coef * (x - mu) / sd)``."""

    coef: np.ndarray
    intercept: float
    mu: np.ndarray
    sd: np.ndarray
    lam: float
    features: list[str] = field(default_factory=list)

    def predict(self, X: np.ndarray) -> np.ndarray:
        return self.intercept + ((np.asarray(X, dtype=np.float64) - self.mu) / self.sd) @ self.coef

    def contributions(self, x: np.ndarray) -> dict[str, float]:
        """Each feature's share of one prediction (coefficient x standardised value), largest magnitude first."""
        c = self.coef * (np.asarray(x, dtype=np.float64) - self.mu) / self.sd
        order = np.argsort(-np.abs(c))
        return {self.features[i]: float(c[i]) for i in order if self.coef[i] != 0}

    def carried_by(self, x: np.ndarray, k: int = 3) -> dict[str, float]:
        """The ``k`` diagnostics with the largest share of one prediction. The operator indicators are left out: they
        say which setting the row is (an alpha, a mix), and one that is off for this row still moves it against the
        benchmark's average merge, which reads as if another setting carried the forecast."""
        return dict(list({n: c for n, c in self.contributions(x).items() if not n.startswith("operator=")}.items())[:k])

    def far(self, x: np.ndarray, limit: float) -> dict[str, float]:
        """The kept diagnostics (operator indicators apart) that lie more than ``limit`` standard deviations from the
        training rows' mean, each with its distance: where a prediction extrapolates."""
        z = (np.asarray(x, dtype=np.float64) - self.mu) / self.sd
        return {n: float(z[i]) for i, n in enumerate(self.features)
                if self.coef[i] != 0 and not n.startswith("operator=") and abs(z[i]) > limit}

    def as_dict(self) -> dict[str, Any]:
        return {"features": self.features, "coef": self.coef.tolist(), "intercept": self.intercept,
                "mu": self.mu.tolist(), "sd": self.sd.tolist(), "lambda": self.lam}


def fit_lasso(X: np.ndarray, y: np.ndarray, lam: float, features: list[str] | None = None, iters: int = 5000,
              tol: float = 1e-10) -> Lasso:
    """``(1 / 2n) |y - Z w|^2 + lam |w|_1`` (Z: the standardised features, y centred): coordinate descent on the Gram
    matrix (p x p, so a sweep costs O(p^2) whatever n is); at ``lam`` = 0 the least-squares solution of least norm."""
    return fit_lassos(X, y, [lam], features, iters, tol)[0]


def _gram(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
    """A problem's standardised features Z, their mean and sd, the Gram matrix Z'Z / n, Z'(y - mean) / n, and the mean."""
    Z, mu, sd = _standardise(X)
    yc = y - y.mean()
    n = Z.shape[0]
    return Z, mu, sd, Z.T @ Z / n, Z.T @ yc / n, float(y.mean())


def fit_lassos(X: np.ndarray, y: np.ndarray, lams, features: list[str] | None = None, iters: int = 5000,
               tol: float = 1e-10) -> list[Lasso]:
    """:func:`fit_lasso` at each penalty of ``lams`` on the same rows: one standardisation and Gram matrix for them all,
    each penalty's descent the same arithmetic as alone."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    Z, mu, sd, G, c, mean = _gram(X, y)
    names = list(features or [f"x{i}" for i in range(Z.shape[1])])
    lams = [float(v) for v in lams]
    pos = [i for i, v in enumerate(lams) if v != 0]
    W = coordinate_descent(np.broadcast_to(G, (len(pos), *G.shape)), np.broadcast_to(c, (len(pos), len(c))),
                           np.array([lams[i] for i in pos]), iters, tol) if pos else None
    out = []
    for i, v in enumerate(lams):
        w = np.linalg.lstsq(Z, y - mean, rcond=None)[0] if v == 0 else W[pos.index(i)].copy()
        out.append(Lasso(w, mean, mu, sd, v, names))
    return out


def coordinate_descent(G: np.ndarray, c: np.ndarray, lam: np.ndarray, iters: int = 5000, tol: float = 1e-10) -> np.ndarray:
    """K lasso problems ``(1/2) w'G w - c'w + lam |w|_1`` (G: K x p x p, c: K x p, lam: K) by cyclic coordinate
    descent, each stopped at the first sweep whose largest change is below ``tol``. Returns the K x p weights.

    The sweeps run on Python floats (a few hundred nanoseconds a coordinate, where indexing numpy scalars costs
    microseconds): the same IEEE double operations in the same order as a numpy formulation, so the same bits."""
    K, p = c.shape
    out = np.zeros((K, p))
    for k in range(K):
        cols = [j for j in range(p) if G[k, j, j] != 0]  # a constant column keeps its weight 0
        Gc = [G[k, :, j].tolist() for j in range(p)]   # column j of G as a list
        d, ck, lk = G[k].diagonal().tolist(), c[k].tolist(), float(lam[k])
        w, Gw = [0.0] * p, [0.0] * p  # G @ w, kept up to date
        rows = range(p)
        for _ in range(iters):
            biggest = 0.0
            for j in cols:
                old = w[j]
                rho = ck[j] - Gw[j] + d[j] * old
                new = (rho - lk if rho > lk else rho + lk if rho < -lk else 0.0) / d[j]
                if new != old:
                    step = new - old
                    g = Gc[j]
                    for i in rows:
                        Gw[i] += g[i] * step
                    w[j] = new
                    if abs(step) > biggest:
                        biggest = abs(step)
            if biggest < tol:
                break
        out[k] = w
    return out


def average_ranks(a: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties given their average (scipy's ``rankdata``, the same values: every rank is a whole or half
    number, exact in float64), without its per-call overhead (a bootstrap ranks thousands of resamples)."""
    a = np.asarray(a, dtype=np.float64)
    if np.isnan(a).any():
        return rankdata(a)
    order = np.argsort(a, kind="mergesort")
    s = a[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], len(a)]
    out = np.empty(len(a))
    out[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return out


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho (average ranks for ties); NaN when either side is constant or fewer than 3 rows."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(np.corrcoef(average_ranks(a), average_ranks(b))[0, 1])


def auroc(score: np.ndarray, label: np.ndarray) -> float:
    """The probability that a random positive scores above a random negative (ties count half); NaN without both."""
    score, label = np.asarray(score, dtype=np.float64), np.asarray(label, dtype=bool)
    pos, neg = label.sum(), (~label).sum()
    if pos == 0 or neg == 0:
        return float("nan")
    ranks = rankdata(score)
    return float((ranks[label].sum() - pos * (pos + 1) / 2) / (pos * neg))


def cluster_bootstrap(stat, clusters: np.ndarray, arrays: tuple[np.ndarray, ...], n_boot: int = 2000,
                      seed: int = 0) -> tuple[float, float]:
    """The 95% percentile interval of ``stat(*arrays)`` over ``n_boot`` resamples of whole clusters (with
    replacement); resamples where the statistic is undefined are dropped."""
    rng = np.random.default_rng(seed)
    ids, inv = np.unique(clusters, return_inverse=True)
    members = [np.flatnonzero(inv == k) for k in range(len(ids))]
    out = []
    for _ in range(n_boot):
        pick = np.concatenate([members[k] for k in rng.integers(0, len(ids), len(ids))])
        v = stat(*(a[pick] for a in arrays))
        if np.isfinite(v):
            out.append(v)
    if len(out) < n_boot // 2:
        return float("nan"), float("nan")
    return float(np.percentile(out, 2.5)), float(np.percentile(out, 97.5))


def inner_folds(groups: np.ndarray, pairs: np.ndarray | None = None, k: int = 5) -> list[np.ndarray]:
    """The folds a penalty is chosen on: leave one group out; with a single group, ``k`` folds of whole pairs (the
    merges of one pair, several operators on the same two models, never on both sides of a fold: a row split would
    let a pair's other merges vouch for it and drive the penalty to 0); without pairs, of rows."""
    uniq = np.unique(groups)
    if len(uniq) > 1:
        return [groups == g for g in uniq]
    if pairs is None:
        return [np.arange(len(groups)) % k == i for i in range(k)]
    _, which = np.unique(np.asarray(pairs).astype(str), return_inverse=True)
    return [which.reshape(-1) % k == i for i in range(k)]


def choose_lambda(X: np.ndarray, y: np.ndarray, groups: np.ndarray, lambdas=LAMBDAS, pairs: np.ndarray | None = None) -> float:
    """The penalty with the lowest leave-one-group-out squared error on these (training) rows only; with a single
    group, folds of whole pairs (:func:`inner_folds`)."""
    folds = [t for t in inner_folds(groups, pairs) if t.any() and not t.all()]
    fits = [fit_lassos(X[~t], y[~t], lambdas) for t in folds]  # one Gram matrix per fold, every penalty on it
    best, best_err = lambdas[0], np.inf
    for li, lam in enumerate(lambdas):
        err = 0.0
        for test, per_lambda in zip(folds, fits):
            err += float(((per_lambda[li].predict(X[test]) - y[test]) ** 2).sum())
        if err < best_err - 1e-15:
            best, best_err = lam, err
    return float(best)


def best_feature(X: np.ndarray, y: np.ndarray) -> tuple[int, float]:
    """The single feature with the largest |Spearman| against ``y`` on these rows, and its sign."""
    rhos = [spearman(X[:, j], y) for j in range(X.shape[1])]
    j = int(np.nanargmax(np.abs(np.nan_to_num(rhos, nan=0.0))))
    return j, float(np.sign(rhos[j]) or 1.0)


def leave_group_out(X: np.ndarray, y: np.ndarray, groups: np.ndarray, inner: np.ndarray, features: list[str],
                    lambdas=LAMBDAS, strata: np.ndarray | None = None, pairs: np.ndarray | None = None,
                    operators: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Held-out predictions of every row: for each group, the lasso (penalty chosen on the other groups by their own
    ``inner`` groups) and the single best feature (chosen on the other groups) fitted without it. With ``strata`` (a
    route per row) each held-out row is predicted by a model of its own stratum's training rows only (a row whose
    stratum has fewer than 3 training rows stays NaN)."""
    pred = np.full(len(y), np.nan)
    base = np.full(len(y), np.nan)
    nodiag = np.full(len(y), np.nan)  # reads no diagnostic: the training rows' mean gain of the row's operator
    ops = np.zeros(len(y), dtype=object) if operators is None else np.asarray(operators, dtype=object)
    levels = np.zeros(len(y), dtype=int) if strata is None else np.unique(strata, return_inverse=True)[1]
    for g in np.unique(groups):
        for s_ in np.unique(levels[groups == g]):
            test = (groups == g) & (levels == s_)
            train = (groups != g) & (levels == s_)
            if train.sum() < 3:
                continue
            lam = choose_lambda(X[train], y[train], inner[train], lambdas, None if pairs is None else pairs[train])
            pred[test] = fit_lasso(X[train], y[train], lam, features).predict(X[test])
            j, s = best_feature(X[train], y[train])
            base[test] = s * X[test, j]
            for op in set(ops[test].tolist()):
                same = train & (ops == op)
                nodiag[test & (ops == op)] = y[same].mean() if same.any() else y[train].mean()
    return {"lasso": pred, "single": base, "nodiag": nodiag}


def paired_spearman_gap(a: np.ndarray, b: np.ndarray, y: np.ndarray, clusters: np.ndarray, n_boot: int = 2000,
                        seed: int = 0) -> tuple[float, float, float]:
    """Spearman(a, y) minus Spearman(b, y) over the same rows, with its 95% interval over resamples of whole clusters
    (pairs): two forecasts compared on the same merges."""
    ok = np.isfinite(a) & np.isfinite(b) & np.isfinite(y)
    gap = lambda p, q, t: spearman(p, t) - spearman(q, t)  # noqa: E731
    est = gap(a[ok], b[ok], y[ok])
    lo, hi = cluster_bootstrap(gap, clusters[ok], (a[ok], b[ok], y[ok]), n_boot, seed)
    return float(est), lo, hi


def calibration(pred: np.ndarray, y: np.ndarray, bins: int = 5) -> list[dict[str, float]]:
    """Predicted against measured by quantile bins of the prediction: mean of each, and the rows in the bin."""
    ok = np.isfinite(pred) & np.isfinite(y)
    pred, y = pred[ok], y[ok]
    if len(pred) < bins:
        return []
    edges = np.quantile(pred, np.linspace(0, 1, bins + 1))
    which = np.clip(np.searchsorted(edges, pred, side="right") - 1, 0, bins - 1)
    return [{"bin": float(b), "n": float((which == b).sum()), "predicted": float(pred[which == b].mean()),
             "measured": float(y[which == b].mean())} for b in range(bins) if (which == b).any()]


@dataclass
class Validation:
    """One held-out validation (one way of leaving groups out): scores with their intervals."""

    scheme: str
    n: int
    spearman: float
    spearman_ci: tuple[float, float]
    auroc: float
    auroc_ci: tuple[float, float]
    single_spearman: float
    single_ci: tuple[float, float]
    shuffled_mean: float
    shuffled_range: tuple[float, float]
    by_operator: dict[str, tuple[float, float, float, int]]
    calibration: list[dict[str, float]]
    predictions: np.ndarray
    n_positive: int = 0  # rows with the binary outcome (AUROC needs enough of both kinds: MIN_CLASS)
    by_route: dict[str, tuple[float, float, float, int]] = field(default_factory=dict)  # (only with two routes or more)
    by_route_operator: dict[str, tuple[float, float, float, int]] = field(default_factory=dict)  # "route|operator"
    shuffled_by_route: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # (mean, 2.5%, 97.5%) per route
    nodiag_spearman: float = float("nan")  # the forecast that reads no diagnostic (each operator's training mean)
    nodiag_ci: tuple[float, float] = (float("nan"), float("nan"))
    lasso_minus_nodiag: tuple[float, float, float] = (float("nan"), float("nan"), float("nan"))  # paired, over pairs
    lasso_minus_single: tuple[float, float, float] = (float("nan"), float("nan"), float("nan"))
    by_group: dict[str, tuple[float, float, float, int, float, float]] = field(default_factory=dict)
    """Each held-out group alone: (Spearman within it, 95% interval over its pairs, rows, mean prediction, mean
    measured): the ranking inside a group the model never saw, apart from whether its level was foreseen."""

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "predictions"}


def validate(scheme: str, X: np.ndarray, y: np.ndarray, beats: np.ndarray, groups: np.ndarray, inner: np.ndarray,
             clusters: np.ndarray, operators: np.ndarray, features: list[str], n_boot: int = 2000, n_shuffles: int = 20,
             seed: int = 0, lambdas=LAMBDAS, routes: np.ndarray | None = None, by_route: bool = False) -> Validation:
    """Leave each of ``groups`` out in turn; pooled held-out Spearman (and per operator), AUROC of the prediction for
    ``beats``, the single-best-feature baseline, each with a cluster-bootstrap interval (and per route, ``routes``, when
    the rows hold two or more; ``by_route``: each route predicted by models of its own rows); the shuffled-target control
    (the targets permuted over every row -- within each route under ``by_route``, so that the routes' typical gains are
    kept and the control says how much of the pooled score they alone give --, ``n_shuffles`` times, the same
    leave-group-out fits made on them, their held-out predictions scored against the true targets: must sit near 0
    within a route)."""
    strata = routes if by_route and routes is not None else None
    held = leave_group_out(X, y, groups, inner, features, lambdas, strata, clusters, operators)
    pred = held["lasso"]
    ok = np.isfinite(pred)
    rho = spearman(pred[ok], y[ok])
    ci = cluster_bootstrap(spearman, clusters[ok], (pred[ok], y[ok]), n_boot, seed)
    auc = auroc(pred[ok], beats[ok])
    auc_ci = cluster_bootstrap(auroc, clusters[ok], (pred[ok], beats[ok]), n_boot, seed)
    single = held["single"]
    sok = np.isfinite(single)
    s_rho = spearman(single[sok], y[sok])
    s_ci = cluster_bootstrap(spearman, clusters[sok], (single[sok], y[sok]), n_boot, seed)
    rng = np.random.default_rng(seed + 1)
    shuffled, within = [], {}
    for _ in range(n_shuffles):
        if strata is None:
            yp = y[rng.permutation(len(y))]
        else:  # within each route: its typical gain kept, what ranks merges inside it destroyed
            yp = y.copy()
            for r in np.unique(strata):
                idx = np.flatnonzero(strata == r)
                yp[idx] = y[idx[rng.permutation(len(idx))]]
        p = leave_group_out(X, yp, groups, inner, features, lambdas, strata, clusters)["lasso"]
        k = np.isfinite(p)
        shuffled.append(spearman(p[k], y[k]))
        if strata is not None:
            for r in np.unique(strata):
                m = k & (strata == r)
                within.setdefault(str(r), []).append(spearman(p[m], y[m]))
    sh = np.array([v for v in shuffled if np.isfinite(v)] or [np.nan])
    shuffled_by_route = {r: (float(np.nanmean(v)), float(np.nanpercentile(v, 2.5)), float(np.nanpercentile(v, 97.5)))
                         for r, v in within.items() if np.isfinite(v).any()}

    def by(labels: np.ndarray) -> dict[str, tuple[float, float, float, int]]:
        out = {}
        for g in sorted(set(labels.tolist())):
            m = ok & (labels == g)
            out[str(g)] = (spearman(pred[m], y[m]), *cluster_bootstrap(spearman, clusters[m], (pred[m], y[m]), n_boot, seed),
                           int(m.sum()))
        return out

    by_group = {str(g): (*by(np.where(groups == g, "in", "out").astype(object)).get("in", (np.nan, np.nan, np.nan, 0)),
                         float(np.nanmean(pred[groups == g])) if ok[groups == g].any() else np.nan, float(np.mean(y[groups == g])))
                for g in sorted(set(groups.tolist()))}
    nd = held["nodiag"]
    nok = np.isfinite(nd)
    extra = {"nodiag_spearman": spearman(nd[nok], y[nok]),
             "nodiag_ci": cluster_bootstrap(spearman, clusters[nok], (nd[nok], y[nok]), n_boot, seed),
             "lasso_minus_nodiag": paired_spearman_gap(pred, nd, y, clusters, n_boot, seed),
             "lasso_minus_single": paired_spearman_gap(pred, single, y, clusters, n_boot, seed)}
    return Validation(scheme, int(ok.sum()), rho, ci, auc, auc_ci, s_rho, s_ci, float(np.nanmean(sh)),
                      (float(np.nanpercentile(sh, 2.5)), float(np.nanpercentile(sh, 97.5))), by(operators),
                      calibration(pred, y), pred, int(np.asarray(beats, dtype=bool)[ok].sum()),
                      *((by(routes), by(np.array([f"{r}|{o}" for r, o in zip(routes, operators)], dtype=object)))
                        if routes is not None and len(set(routes.tolist())) > 1 else ({}, {})), shuffled_by_route,
                      by_group=by_group, **extra)
