"""The advisor checked against merges it did not see: every route's forecast of a pair made by the fit that held that
pair out (its leave-one-pair-out prediction, both directions and every operator unseen), the pair's routes ranked by
it as ``task=advise`` ranks them, then read against what the merges measured.

- **Coverage**: each held-out merge's forecast interval is its held-out prediction plus the ``(1 - level) / 2`` and
  ``(1 + level) / 2`` quantiles of the same route's held-out residuals of the *other* pairs (a jackknife interval:
  the pair's own residual never sets its width). Its coverage is the share of merges whose measured gain lies inside,
  with a 95% interval from a bootstrap over pairs (the merges of one pair are not independent); per route and pooled.
- **Advised against the runner-up**: per held-out pair, the advised merge is the route and operator with the highest
  forecast; the other is the best-forecast merge of the next-ranked route. How often the advised merge measured the
  larger gain, with its interval over pairs, beside 1/2 (a coin) and the oracle's choice; and how often each helped
  (the lower end of its paired interval above zero).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mergescope.forecast.fit import cluster_bootstrap

__all__ = ["Merge", "jackknife_intervals", "held_out_check"]


@dataclass(frozen=True)
class Merge:
    """One benchmark merge as the check reads it: its route (``transport a<-b`` names a direction), its pair, its
    operator, the held-out-by-pair forecast and what it measured (gain and the lower end of its interval)."""

    route: str
    pair: str
    operator: str
    predicted: float
    gain: float
    gain_lo: float


def jackknife_intervals(pred: np.ndarray, y: np.ndarray, pairs: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Each merge's interval: its prediction plus the quantiles of the residuals of every other pair's merges (NaN
    where fewer than 10 such residuals remain)."""
    resid = y - pred
    lo, hi = np.full(len(y), np.nan), np.full(len(y), np.nan)
    for p in np.unique(pairs):
        me = pairs == p
        other = resid[~me & np.isfinite(resid)]
        if len(other) < 10:
            continue
        q_lo, q_hi = np.quantile(other, [(1 - level) / 2, (1 + level) / 2])
        lo[me], hi[me] = pred[me] + q_lo, pred[me] + q_hi
    return lo, hi


def _rate(x: np.ndarray, clusters: np.ndarray, n_boot: int, seed: int) -> tuple[float, float, float]:
    if len(x) == 0:
        return float("nan"), float("nan"), float("nan")
    lo, hi = cluster_bootstrap(lambda v: float(np.mean(v)), clusters, (x.astype(np.float64),), n_boot, seed)
    return float(np.mean(x)), lo, hi


def _route_kind(route: str) -> str:
    """A route's kind as a metric name holds it: ``transport+adapt a<-b`` -> ``transport_adapt``, ``adapt union`` ->
    ``adapt_union``."""
    kind = route.split(" ", 1)[0] if route.startswith("transport") else route
    return kind.replace("+", "_").replace(" ", "_")


def held_out_check(merges: list[Merge], level: float = 0.9, n_boot: int = 2000, seed: int = 0) -> dict[str, float]:
    """Coverage (per route kind and pooled) and the advised-against-runner-up comparison over the held-out pairs."""
    out: dict[str, float] = {"level": level}
    ok = [m for m in merges if np.isfinite(m.predicted) and np.isfinite(m.gain)]
    if not ok:
        return {**out, "n_pairs": 0.0, "n_merges": 0.0}
    kinds = np.array([_route_kind(m.route) for m in ok], dtype=object)
    pairs = np.array([m.pair for m in ok], dtype=object)
    pred = np.array([m.predicted for m in ok])
    y = np.array([m.gain for m in ok])
    lo, hi = np.full(len(ok), np.nan), np.full(len(ok), np.nan)
    for k in np.unique(kinds):  # each route's residuals set its own intervals
        sel = kinds == k
        lo[sel], hi[sel] = jackknife_intervals(pred[sel], y[sel], pairs[sel], level)
    has = np.isfinite(lo)
    inside = (y >= lo) & (y <= hi)
    c, c_lo, c_hi = _rate(inside[has], pairs[has], n_boot, seed)
    out.update({"coverage": c, "coverage_lo": c_lo, "coverage_hi": c_hi, "n_merges": float(has.sum()),
                "coverage_pairs": float(len(set(pairs[has].tolist())))})
    for k in np.unique(kinds):
        sel = has & (kinds == k)
        c, c_lo, c_hi = _rate(inside[sel], pairs[sel], n_boot, seed)
        out.update({f"coverage.{k}": c, f"coverage_lo.{k}": c_lo, f"coverage_hi.{k}": c_hi, f"n_merges.{k}": float(sel.sum())})
    # per held-out pair: the advised merge against the runner-up route's best-forecast merge
    wins, adv_helps, oth_helps, oracle, gaps, ids = [], [], [], [], [], []
    for p in sorted(set(pairs.tolist())):
        mine = [m for m in ok if m.pair == p]
        best_of = {}
        for m in mine:
            if m.route not in best_of or m.predicted > best_of[m.route].predicted:
                best_of[m.route] = m
        if len(best_of) < 2:
            continue
        ranked = sorted(best_of.values(), key=lambda m: -m.predicted)
        adv, other = ranked[0], ranked[1]
        wins.append(adv.gain > other.gain)
        gaps.append(adv.gain - other.gain)
        adv_helps.append(adv.gain_lo > 0)
        oth_helps.append(other.gain_lo > 0)
        oracle.append(max(m.gain for m in mine) - adv.gain)
        ids.append(p)
    ids_a = np.array(ids, dtype=object)
    out["n_pairs"] = float(len(ids))
    for name, x in (("advised_beats_other", np.array(wins, dtype=bool)), ("advised_helps", np.array(adv_helps, dtype=bool)),
                    ("other_helps", np.array(oth_helps, dtype=bool))):
        r, r_lo, r_hi = _rate(x, ids_a, n_boot, seed)
        out.update({name: r, f"{name}_lo": r_lo, f"{name}_hi": r_hi})
    g = np.array(gaps)
    if len(g):
        g_lo, g_hi = cluster_bootstrap(lambda v: float(np.mean(v)), ids_a, (g,), n_boot, seed)
        out.update({"advised_minus_other": float(g.mean()), "advised_minus_other_lo": g_lo, "advised_minus_other_hi": g_hi,
                    "regret_vs_oracle": float(np.mean(oracle))})
    return out
