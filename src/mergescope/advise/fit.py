"""One route's forecast, fitted and validated like the native merge forecast (:mod:`mergescope.forecast.fit`: a
lasso on standardised diagnostics with one indicator per alpha, its penalty chosen on the training families only),
held out three ways:

- **by family**: every merge into one target model predicted by models fitted without it;
- **by pair**: every merge of one unordered pair (both directions) predicted without that pair;
- **by member**: every merge of one pair predicted by models fitted on the rows that involve neither of its two
  models, as target or donor (the strictest: the advisor meets two models it has never seen).

Each with Spearman and Pearson of predicted against measured gain (pooled over the held-out folds), a 95% interval
from a bootstrap over pairs, the shuffled-target control, the two baselines (the single best feature; each alpha's
training mean, which reads no diagnostic) and, per held-out family, its ranking and its level (mean forecast against
mean measured).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mergescope.advise.bench import RouteBench
from mergescope.forecast.fit import LAMBDAS, Lasso, choose_lambda, cluster_bootstrap, fit_lasso, spearman, validate
from mergescope.forecast.job import design

__all__ = ["pearson", "leave_members_out", "validate_route", "final_model", "scores"]


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def leave_members_out(X: np.ndarray, y: np.ndarray, a: np.ndarray, b: np.ndarray, inner: np.ndarray, pairs: np.ndarray,
                      lambdas=LAMBDAS) -> np.ndarray:
    """Each pair's rows predicted by a lasso fitted on the rows that involve neither of its models (NaN where fewer
    than 3 such rows remain)."""
    pred = np.full(len(y), np.nan)
    for p in np.unique(pairs):
        test = pairs == p
        members = set(a[test].tolist()) | set(b[test].tolist())
        train = ~np.isin(a, list(members)) & ~np.isin(b, list(members))
        if train.sum() < 3:
            continue
        lam = choose_lambda(X[train], y[train], inner[train], lambdas, pairs[train])
        pred[test] = fit_lasso(X[train], y[train], lam).predict(X[test])
    return pred


def scores(pred: np.ndarray, y: np.ndarray, clusters: np.ndarray, n_boot: int, seed: int) -> dict[str, float]:
    """Spearman and Pearson of held-out predictions against outcomes, pooled, each with its interval over pairs."""
    ok = np.isfinite(pred) & np.isfinite(y)
    out = {"n": float(ok.sum())}
    if ok.sum() < 3:  # e.g. holding out both members of a pair among three models leaves nothing to fit on
        return {**out, **{f"{n}{s}": float("nan") for n in ("spearman", "pearson") for s in ("", "_lo", "_hi")}}
    for name, fn in (("spearman", spearman), ("pearson", pearson)):
        est = fn(pred[ok], y[ok])
        lo, hi = cluster_bootstrap(fn, clusters[ok], (pred[ok], y[ok]), n_boot, seed)
        out.update({name: est, f"{name}_lo": lo, f"{name}_hi": hi})
    return out


def final_model(bench: RouteBench, lambdas=LAMBDAS) -> Lasso:
    X, names = design(bench)
    lam = choose_lambda(X, bench.y, bench.family, lambdas, bench.pair)
    return fit_lasso(X, bench.y, lam, names)


def validate_route(bench: RouteBench, n_boot: int = 2000, n_shuffles: int = 20, seed: int = 0, lambdas=LAMBDAS) -> dict[str, Any]:
    """The three held-out validations, the final model and its held-out residuals (by family: the forecast
    interval's)."""
    X, names = design(bench)
    common = dict(n_boot=n_boot, n_shuffles=n_shuffles, seed=seed, lambdas=lambdas)
    fam = validate("leave one family out", X, bench.y, bench.beats, bench.family, bench.family, bench.pair, bench.operator,
                   names, **common)
    pair = validate("leave one pair out", X, bench.y, bench.beats, bench.pair, bench.family, bench.pair, bench.operator,
                    names, **common)
    member = leave_members_out(X, bench.y, bench.target, bench.donor, bench.family, bench.pair, lambdas)
    out = {"family": fam, "pair": pair, "member_predictions": member,
           "scores": {"family": scores(fam.predictions, bench.y, bench.pair, n_boot, seed),
                      "pair": scores(pair.predictions, bench.y, bench.pair, n_boot, seed),
                      "member": scores(member, bench.y, bench.pair, n_boot, seed)},
           "final": final_model(bench, lambdas), "names": names}
    out["residuals"] = bench.y - fam.predictions
    out["member_by_operator"] = {str(op): scores(np.where(bench.operator == op, member, np.nan), bench.y, bench.pair, n_boot, seed)
                                 for op in sorted(set(bench.operator.tolist()))}  # the ranking within one alpha
    return out
