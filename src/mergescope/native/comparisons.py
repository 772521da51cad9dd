"""The native arm's comparison, from per-sentence scores: a merge's gain over the better endpoint with its paired
interval, what a merge run logs and what the report recomputes from the run's ``scores/sentences.csv`` with the
current rule (:mod:`mergescope.intervals`).

Arms of a merge run's table (language ``host``): ``a`` (model a), ``t1`` (the chord's t = 1 end), ``merged_seed0``,
``merged_seed1``, ... (one per seed of a stochastic merge: a distribution)."""

from __future__ import annotations

from collections.abc import Sequence

from mergescope.evidence import gain_over_best
from mergescope.scoring.bpb import Scores

__all__ = ["merge_comparisons", "rejudge_merge", "rejudge_pair"]


def merge_comparisons(s0: Scores, s1: Scores, merged: Sequence[Scores], docs: Sequence[str] | None,
                      what: str) -> dict[str, float]:
    """``merge_gain``: the better endpoint minus the merge (positive = the merge beats it), both scopes."""
    return gain_over_best("merge_gain", [s0, s1], merged[0] if len(merged) == 1 else list(merged), docs, what)


def _from_table(study, run_id: str | None) -> dict[str, float] | None:
    table = None if not run_id else study.score_table(run_id)
    if table is None:
        return None
    sc, docs = table
    merged = [sc[k] for k in sorted((k for k in sc if k[0].startswith("merged_seed") and k[1] == "host"),
                                    key=lambda k: int(k[0][len("merged_seed"):]))]
    if ("a", "host") not in sc or ("t1", "host") not in sc or not merged:
        return None
    d = docs.get("host")
    return merge_comparisons(sc[("a", "host")], sc[("t1", "host")], merged, d, "article" if d is not None else "sentence")


def rejudge_merge(study, r) -> dict[str, float] | None:
    """A merge run's gain recomputed from its own table."""
    return _from_table(study, r.run_id)


def rejudge_pair(study, r) -> dict[str, float] | None:
    """A native pair run's chosen merge's gain, recomputed from the chosen merge run's table (param
    ``merge_chosen``); None for another measure run."""
    if r.tags.get("metric") != "native":
        return None
    got = _from_table(study, r.params.get("merge_chosen.run"))
    return None if got is None else {k: v for k, v in got.items() if k != "merge_gain"}
