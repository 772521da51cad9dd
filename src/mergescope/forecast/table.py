"""The merge benchmark as rows: every FINISHED native merge in the experiment (kind=merge, route=native) of a pair with
a common origin -- a checkpoint pair (two revisions of one training run) or a fine-tune pair (two experts continued from
one base, ``native.base`` a model entry) --, its outcome, and the pre-merge diagnostics of its pair (the pair's native
run, kind=measure metric=native), with the family (the training run; a fine-tune pair's base), the route, the pair (a
cluster: its merges share its diagnostics) and the operator of each row.

Only diagnostics that are computed without the outcome's data enter (:data:`FEATURES`: the weights and task vectors,
data-free, and the data-aware ones measured on FLORES dev, disjoint from the devtest sentences the merges are scored
on); those measured on the outcome's own sentences are left out, each with its reason (:data:`EXCLUDED`)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["FEATURES", "DATA_FREE", "PREMERGE", "EXCLUDED", "Benchmark", "benchmark", "TARGET", "route_of", "family_of"]

DATA_FREE = ("weight_cosine", "relative_l2", "norm_ratio", "weight_cosine_matrices", "relative_l2_matrices",
             "tv_cosine", "ties_sign_agreement", "log10_step_ratio")
"""From the pair's weights alone (its native run)."""
PREMERGE = ("dev_nll_gap", "dev_act_cosine", "dev_grad_cosine", "dev_grad_relative_l2")
"""Data-aware, on FLORES dev (the pair's premerge run: :mod:`mergescope.forecast.premerge`), disjoint from the
devtest sentences every merge is scored on."""
FEATURES = DATA_FREE + PREMERGE
EXCLUDED = {
    "lmc_barrier": "the linear merge at t = 0.5 on the very sentences the outcome is scored on (an outcome, not a forecast)",
    "cka": "measured on the evaluation split the merges are scored on (not disjoint from the outcome's data)",
    "nll_a / nll_t1": "the endpoints' NLL on the outcome's sentences: the outcome is their difference from the merge",
}
TARGET = "merge_gain_rest"  # the better endpoint's NLL minus the merge's (nats/token, the first token apart): > 0 helps


@dataclass
class Benchmark:
    """The rows: features ``X`` (one column per name in ``features``), the outcome ``y`` with its 95% interval
    (``lo``, ``hi``), ``beats`` (the interval above 0: the merge beats both experts), the gain over the endpoints'
    mean (``avg_gain``), and per row its family, pair, operator and merge run id."""

    features: list[str]
    X: np.ndarray
    y: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    avg_gain: np.ndarray
    family: np.ndarray
    pair: np.ndarray
    operator: np.ndarray
    run_ids: list[str]
    native_ids: list[str]
    dropped: int
    route: np.ndarray | None = None  # per row: checkpoint (two revisions of one run) or fine-tune (two experts of one base)
    repeats: int = 0  # merges left out because they are another operator's merge on the pair (tag same_as: task
    #                   arithmetic at weight 1/2 is the linear average): one row per distinct merge

    @property
    def beats(self) -> np.ndarray:
        return self.lo > 0

    def __len__(self) -> int:
        return len(self.y)

    def without_families(self, names) -> Benchmark:
        """These rows but those of the named families (a fit on the rest: e.g. the toy families alone)."""
        keep = ~np.isin(self.family.astype(str), [str(n) for n in names])
        idx = np.flatnonzero(keep)
        pick = lambda a: None if a is None else a[keep]  # noqa: E731
        return Benchmark(self.features, self.X[keep], self.y[keep], self.lo[keep], self.hi[keep], self.avg_gain[keep],
                         self.family[keep], self.pair[keep], self.operator[keep], [self.run_ids[i] for i in idx],
                         [self.native_ids[i] for i in idx], self.dropped, pick(self.route), self.repeats)

    def digest(self) -> str:
        """What the fit's numbers depend on: the merge and native runs it reads (their ids)."""
        return hashlib.sha256("\n".join(sorted(self.run_ids) + sorted(set(self.native_ids))).encode()).hexdigest()[:24]


def route_of(r) -> str | None:
    """A run's kind of pair: ``checkpoint`` (two revisions of one training run), ``fine-tune`` (two models continued
    from one base, the ``base`` tag: native.base a model entry), or None (no common origin: not in the benchmark)."""
    a, b = str(r.tags.get("model_a", "")), str(r.tags.get("model_b", "?"))
    if a.split("@")[0] == b.split("@")[0]:
        return "checkpoint"
    return "fine-tune" if r.tags.get("base") else None


def family_of(r) -> str:
    """What a held-out family is: a checkpoint pair's training run, a fine-tune pair's base."""
    return str(r.tags["base"]) if route_of(r) == "fine-tune" else str(r.tags["model_a"]).split("@")[0]


def _value(r, f: str) -> float:
    """A diagnostic of a run. A native run logged without the matrices-only values (``<k>_matrices``) is one whose
    every shared tensor is a matrix (models without norm gains or biases: they were logged only where the two lists
    differ), so its value is the all-tensor one, computed over the same tensors."""
    if f not in r.metrics and f.endswith("_matrices") and "n_shared_tensors" in r.metrics:
        return r.m(f.removesuffix("_matrices"))
    return r.m(f)


def _finite(*vals: float) -> bool:
    return all(v is not None and math.isfinite(v) for v in vals)


def benchmark(recs, features: tuple[str, ...] = FEATURES) -> Benchmark:
    """The benchmark's rows from the experiment's FINISHED runs (:class:`mergescope.analysis.records.Rec`, newest
    first): the latest run per cfg_hash; one row per distinct merge (an operator whose merge on the pair is another's,
    tag ``same_as``, is left out and counted in ``repeats``); merges whose pair has no native run (or, for a
    :data:`PREMERGE` feature, no premerge run on the same outcome), or a diagnostic missing, are dropped (counted)."""
    seen, merges, natives, pre = set(), [], {}, {}
    for r in recs:
        h = r.tags.get("cfg_hash")
        if h is not None and h in seen:
            continue
        seen.add(h)
        if route_of(r) is None:
            continue  # a pair with no common origin (two separately trained models): no task vector, no row
        if r.kind == "merge" and r.tags.get("route") == "native":
            merges.append(r)
        elif r.kind == "measure" and r.tags.get("metric") == "native" and not r.tags.get("transplant"):
            natives.setdefault(r.tags.get("pair"), r)
        elif r.kind == "measure" and r.tags.get("metric") == "premerge":
            pre.setdefault((r.tags.get("pair"), r.tags.get("outcome")), r)
    rows, dropped = [], 0
    repeats = [m for m in merges if m.tags.get("same_as") not in (None, "", "None")]  # the same merge as another's
    merges = [m for m in merges if m not in repeats]
    for m in merges:
        n = natives.get(m.tags.get("pair"))
        p = pre.get((m.tags.get("pair"), m.tags.get("outcome")))  # measured on the languages this merge is scored on
        x = [_value(p if f in PREMERGE else n, f) for f in features] if n is not None and (p is not None or not
                                                                                       set(features) & set(PREMERGE)) else []
        y, lo, hi = m.m(TARGET), m.m(f"{TARGET}_lo"), m.m(f"{TARGET}_hi")
        if not x or not _finite(*x, y, lo, hi):
            dropped += 1
            continue
        avg = (m.m("nll_a") + m.m("nll_t1")) / 2 - m.m("nll")
        ids = n.run_id if p is None else f"{n.run_id}+{p.run_id}"
        rows.append((x, y, lo, hi, avg, family_of(m), m.tags["pair"], m.tags.get("merge"), m.run_id, ids, route_of(m)))
    rows.sort(key=lambda r: (r[5], r[6], str(r[7])))
    col = lambda i, dt=np.float64: np.array([r[i] for r in rows], dtype=dt)  # noqa: E731
    X = np.array([r[0] for r in rows], dtype=np.float64).reshape(len(rows), len(features))
    return Benchmark(list(features), X, col(1), col(2), col(3), col(4), col(5, object), col(6, object), col(7, object),
                     [r[8] for r in rows], [r[9] for r in rows], dropped, col(10, object), len(repeats))
