"""The route benchmark as rows, one route at a time: every FINISHED merge of that route in an experiment, its outcome
and its pair's pre-merge diagnostics (:mod:`mergescope.advise.diagnostics`, the pair's ``task=pairdev`` run: configs,
tokenizers and FLORES dev, never the outcome's sentences).

Routes and outcomes (nats/token on the target's own language, the first token apart, > 0 helps; each with its paired
95% interval over articles as the run logged it):

- ``transport`` (kind=transport, one run per direction and alpha): the target's NLL minus the fused target's
  (``-delta_target_lang_rest``): the gain over the target, which on its own language is the better of the two (the
  donor reads it through another tokenizer, or not at all);
- ``transport+adapt`` (kind=transport_adapt): the fused-then-trained target against the target trained alike without
  fusion (``-fusion_effect_after_adapt_rest``): what fusion adds beyond the training;
- ``adapt union`` and ``adapt intersection`` (the adapt arm's summary run of each protocol, kind=adapt ratio=best):
  every grid ratio the test split scored is one merge, its gain the better end minus the merge on every language of
  both models (``grid_gain.<ratio>_rest``: the better of the two models, as each is read in the merge's shape, first
  tokens apart). Its target is the model whose shape the merge keeps (union: the larger, Expand the smaller into it;
  intersection: the smaller), its donor the other, its operator the ratio (``ratio`` a feature too);
- ``transplant`` (the native arm's merges of a pair given one vocabulary first, kind=merge with a ``transplant`` tag):
  the better of the two transplanted models minus the merge on model a's language (``merge_gain_rest``); its target
  model a, its operator the merge operator at its mix (model b's weight, ``mix`` a feature too; an operator that is
  another's merge on the pair, ``same_as``, is left out: one row per distinct merge).

A row's family is its target model (a held-out family: every merge into that model unseen); its pair is the unordered
pair of models (a cluster: both directions share its diagnostics, flipped); a transport merge's operator is the
alpha it was fused at (``log10_alpha`` a feature too: the forecast is asked per alpha).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from mergescope.advise.diagnostics import FEATURES as PAIR_FEATURES
from mergescope.advise.diagnostics import flip

__all__ = ["ROUTE_KINDS", "OUTCOMES", "RouteBench", "route_bench", "pair_key", "PLAN_FEATURES", "features_for", "from_csv",
           "CSV_COLUMNS"]

ROUTE_KINDS = {"transport": "transport", "transport+adapt": "transport_adapt", "adapt union": "adapt",
               "adapt intersection": "adapt", "transplant": "merge"}
"""route -> the run kind that holds its merges."""
OUTCOMES = {"transport": "delta_target_lang_rest", "transport+adapt": "fusion_effect_after_adapt_rest"}
"""transport route -> the logged metric whose negative is the gain (its ``_lo`` / ``_hi`` the interval)."""
ADAPT_GAIN = "grid_gain."
"""An adapt summary's per-ratio gains: ``grid_gain.<ratio>_rest`` with ``_lo`` / ``_hi``."""
PLAN_FEATURES = ("plan_entropy_gap", "plan_cost_ratio")
"""The transport plan's own diagnostics (fitted on dev probes before any scoring), read from the merge's run: off by
default, since the advisor would have to fit the plans to know them."""


def features_for(route: str, plan: bool = False) -> tuple[str, ...]:
    if route == "transplant":
        return (*PAIR_FEATURES, "mix")
    if route.startswith("adapt"):
        return (*PAIR_FEATURES, "ratio")
    return (*PAIR_FEATURES, "log10_alpha", *(PLAN_FEATURES if plan and route.startswith("transport") else ()))


def pair_key(a: str, b: str) -> str:
    """The unordered pair of two models (by name and revision)."""
    return "__".join(sorted((a, b)))


@dataclass
class RouteBench:
    """One route's rows (as :class:`mergescope.forecast.table.Benchmark`, plus each row's two models)."""

    route: str
    features: list[str]
    X: np.ndarray
    y: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    family: np.ndarray
    pair: np.ndarray
    operator: np.ndarray
    target: np.ndarray
    donor: np.ndarray
    run_ids: list[str]
    diag_ids: list[str]
    dropped: int = 0
    why_dropped: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.y)

    @property
    def beats(self) -> np.ndarray:
        return self.lo > 0

    def digest(self) -> str:
        return hashlib.sha256("\n".join(sorted(self.run_ids) + sorted(set(self.diag_ids))).encode()).hexdigest()[:24]


def _finite(*vals) -> bool:
    return all(v is not None and math.isfinite(v) for v in vals)


def _model_name(r, side: str) -> str:
    return str(r.tags.get(side, ""))


SETTING_TAGS = ("transport_variant", "adapt_mode", "transplant", "merge", "protocol")
"""The tags that tell two runs of one pair and operator apart as two settings (two rows of a benchmark); runs that
agree on them and on the two models and the operator are one merge made again (an identity that changed with a
setting the outcome does not read, e.g. how many of the random-plan control's seeds were adapted beside it)."""
OLDER = "an older run of the same merge (the newest kept)"


def route_bench(recs, route: str, features: tuple[str, ...] | None = None) -> RouteBench:
    """The route's rows from an experiment's FINISHED runs (newest first: the latest run per cfg_hash, and per merge:
    :data:`SETTING_TAGS`)."""
    if route not in ROUTE_KINDS:
        raise ValueError(f"no route benchmark for {route!r}: one of {', '.join(ROUTE_KINDS)}")
    features = tuple(features or features_for(route))
    kind = ROUTE_KINDS[route]
    seen, merges, diags = set(), [], {}
    for r in recs:
        h = r.tags.get("cfg_hash")
        if h is not None and h in seen:
            continue
        seen.add(h)
        if r.kind == kind and _is_merge(r, route):
            merges.append(r)
        elif r.kind == "measure" and r.tags.get("metric") == "pair_dev":
            diags.setdefault(pair_key(r.tags["model_a"], r.tags["model_b"]), r)
    rows, why, made = [], {}, set()
    for m in merges:
        for t, d, operator, own, y, lo, hi in _merges_of(m, route):
            same = (t, d, operator, *(m.tags.get(k) for k in SETTING_TAGS))
            if same in made:  # one row per distinct merge: the newest run of it (recs are newest first)
                why[OLDER] = why.get(OLDER, 0) + 1
                continue
            made.add(same)
            p = diags.get(pair_key(t, d))
            if p is None:
                why["no pair diagnostics (task=pairdev)"] = why.get("no pair diagnostics (task=pairdev)", 0) + 1
                continue
            vals = {k: p.m(k) for k in PAIR_FEATURES}
            vals["dev_bpb_target"] = p.m("dev_bpb_a")
            if p.tags["model_a"] != t:  # the diagnostics were logged with the other model as the target
                vals = flip(vals, p.m("dev_bpb_b"))
            vals.update(own)
            x = [vals.get(f, float("nan")) for f in features]
            if not _finite(*x, y, lo, hi):
                why["a diagnostic or the outcome not finite"] = why.get("a diagnostic or the outcome not finite", 0) + 1
                continue
            rows.append((x, y, lo, hi, t.split("@")[0], pair_key(t, d), operator, t, d,
                         m.run_id if kind != "adapt" else f"{m.run_id}:{operator}", p.run_id))
    rows.sort(key=lambda r: (r[4], r[5], r[7], r[6]))
    col = lambda i, dt=np.float64: np.array([r[i] for r in rows], dtype=dt)  # noqa: E731
    X = np.array([r[0] for r in rows], dtype=np.float64).reshape(len(rows), len(features))
    return RouteBench(route, list(features), X, col(1), col(2), col(3), col(4, object), col(5, object), col(6, object),
                      col(7, object), col(8, object), [r[9] for r in rows], [r[10] for r in rows],
                      sum(why.values()), why)


def _is_merge(r, route: str) -> bool:
    if route == "transplant":
        return (r.tags.get("route") == "native" and r.tags.get("transplant") not in (None, "None", "")
                and r.tags.get("same_as") in (None, "None", ""))
    if route.startswith("adapt"):
        return r.tags.get("ratio") == "best" and r.tags.get("protocol") == route.split(" ", 1)[1]
    return r.tags.get("stage") in (None, "fused")


def _merges_of(m, route: str) -> list[tuple]:
    """One run's merges as (target, donor, operator, the run's own features, gain, lo, hi): a transport run is one
    merge, an adapt summary one per grid ratio the test split scored (its ``row`` the merge's run id + ratio)."""
    if route == "transplant":
        g, mix = "merge_gain_rest", merge_mix(m)
        return [(_model_name(m, "model_a"), _model_name(m, "model_b"), f"{m.tags.get('operator')} mix={mix:g}", {"mix": mix},
                 m.m(g), m.m(f"{g}_lo"), m.m(f"{g}_hi"))]
    if not route.startswith("adapt"):
        metric, alpha = OUTCOMES[route], m.m("alpha")
        own = {"log10_alpha": math.log10(alpha) if alpha and alpha > 0 else float("nan"),
               **{k: m.m(k) for k in PLAN_FEATURES}}
        return [(_model_name(m, "target"), _model_name(m, "donor"), f"alpha={alpha:g}", own, -m.m(metric),
                 -m.m(f"{metric}_hi"), -m.m(f"{metric}_lo"))]
    small, large = _model_name(m, "small"), _model_name(m, "large")
    t, d = (large, small) if route == "adapt union" else (small, large)
    out = []
    for key in sorted(k for k in m.metrics if k.startswith(ADAPT_GAIN) and k.endswith("_rest")):
        ratio = float(key[len(ADAPT_GAIN):-len("_rest")])
        out.append((t, d, f"ratio={ratio:g}", {"ratio": ratio}, m.m(key), m.m(f"{key}_lo"), m.m(f"{key}_hi")))
    return out


def merge_mix(m) -> float:
    """A native merge's weight of model b, from the merge config its run logged (``merge.t`` of SLERP, the second of
    ``merge.weights``: :func:`mergescope.native.merges.with_mix`); NaN when it logged neither (the row is dropped)."""
    t, w = m.param("merge.t"), m.param("merge.weights")
    if isinstance(t, (int, float)):
        return float(t)
    return float(w[1]) if isinstance(w, list) and len(w) == 2 else float("nan")


CSV_COLUMNS = ("pair", "member_a", "member_b", "operator", "outcome")
"""The columns a benchmark from elsewhere must have (:func:`from_csv`); ``family``, ``lo`` and ``hi`` are optional, and
every other column is a diagnostic."""


def from_csv(path, route: str = "outside") -> RouteBench:
    """A benchmark from elsewhere: one row per merge, the columns :data:`CSV_COLUMNS` (``member_a`` the target, whose
    held-out family it is unless a ``family`` column says otherwise; ``outcome`` the gain, > 0 helps), optional ``lo`` /
    ``hi`` (its interval; without them "beats" is outcome > 0) and every other column a numeric diagnostic, measured
    before the merge. A missing column, a non-number or an empty file is one line naming the fix."""
    import csv
    from pathlib import Path

    from mergescope.errors import MergescopeError

    path = Path(path)
    if not path.is_file():
        raise MergescopeError(f"advise.table={path}: no such file (a CSV with columns {', '.join(CSV_COLUMNS)}, then diagnostics)")
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        cols = list(reader.fieldnames or [])
        rows = list(reader)
    missing = [c for c in CSV_COLUMNS if c not in cols]
    if missing:
        raise MergescopeError(f"advise.table={path}: missing column(s) {', '.join(missing)} (needed: {', '.join(CSV_COLUMNS)}; "
                              "optional: family, lo, hi; every other column is a diagnostic)")
    feats = [c for c in cols if c not in (*CSV_COLUMNS, "family", "lo", "hi")]
    if not feats or not rows:
        raise MergescopeError(f"advise.table={path}: {'no diagnostic column' if not feats else 'no rows'} (a row per merge: "
                              f"{', '.join(CSV_COLUMNS)}, then one column per diagnostic)")

    def num(r: dict, c: str, i: int) -> float:
        try:
            return float(r[c])
        except (TypeError, ValueError):
            raise MergescopeError(f"advise.table={path}: row {i + 2}, column {c!r}: {r[c]!r} is not a number") from None

    X = np.array([[num(r, c, i) for c in feats] for i, r in enumerate(rows)], dtype=np.float64)
    y = np.array([num(r, "outcome", i) for i, r in enumerate(rows)])
    has_ci = "lo" in cols and "hi" in cols
    lo = np.array([num(r, "lo", i) for i, r in enumerate(rows)]) if has_ci else y.copy()
    hi = np.array([num(r, "hi", i) for i, r in enumerate(rows)]) if has_ci else y.copy()
    ok = np.isfinite(X).all(axis=1) & np.isfinite(y) & np.isfinite(lo) & np.isfinite(hi)
    col = lambda c: np.array([r[c] for r, k in zip(rows, ok) if k], dtype=object)  # noqa: E731
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:24]
    fam = col("family") if "family" in cols else col("member_a")
    return RouteBench(route, feats, X[ok], y[ok], lo[ok], hi[ok], fam, col("pair"), col("operator"), col("member_a"),
                      col("member_b"), [f"{digest}:{i}" for i in np.flatnonzero(ok)], [digest] * int(ok.sum()),
                      int((~ok).sum()), {"a value not finite": int((~ok).sum())} if (~ok).any() else {})
