"""Comparative claims as the report makes them: a difference counts as a finding only where its paired interval
(:mod:`mergescope.intervals`, recomputed from the run's per-sentence table when the report is built, else as the job
logged it: ``<name>_lo`` / ``<name>_hi`` / ``<name>_p`` / ``<name>_groups``) excludes zero and, among the rows of one
table or count (:func:`verdicts`, :func:`family`), its Benjamini-Hochberg q-value is at most 0.05.

Every NLL difference is read in one scope (:data:`SCOPE`): ``rest`` (the first token, predicted from the start token
alone, apart; the default) or ``all`` (every token). :func:`metric` names the logged metric of a difference in that
scope, :func:`verdict` says what it shows, :func:`cell` prints it with its interval. A run recorded before intervals
existed has none: its verdict is ``"no interval"`` and it is never counted.
"""

from __future__ import annotations

import math

from mergescope.analysis.records import Rec
from mergescope.intervals import table_verdicts  # noqa: F401 (the rule of a table, re-exported)
from mergescope.intervals import verdict as _verdict

__all__ = ["BH_NOTE", "RULE", "SCOPE", "SCOPE_NOTE", "cell", "count", "count_lower", "edge_note", "metric", "verdict",
           "verdicts", "family", "set_scope", "table_verdicts"]

RULE = ("a row counts only where the paired 95% interval of its difference (a studentized bootstrap over whole FLORES "
        "articles; against a control over seeds, also beyond the seeds' prediction interval: mergescope.intervals) "
        "excludes 0 and its Benjamini-Hochberg q-value among the rows of its table is at most 0.05; an interval covering "
        "0, fewer than 10 articles, a difference under 5e-5 (float noise) or a run recorded without an interval counts "
        "for neither side")
"""The one rule every verdict of the report follows, in words (each section's caption quotes it or names it)."""

BH_NOTE = "counts after Benjamini-Hochberg across the table's rows, q <= 0.05"

SCOPE = {"value": "rest"}
"""The NLL scope of every claim in this analysis (``analysis.nll_scope``): ``rest`` or ``all``."""

SCOPE_NOTE = {"rest": "without each sentence's first token (predicted from the start token alone; nll_rest)",
              "all": "over every token, the first one (predicted from the start token alone) included"}


def set_scope(scope: str) -> None:
    if scope not in SCOPE_NOTE:
        raise ValueError(f"analysis.nll_scope is 'rest' or 'all', got {scope!r}")
    SCOPE["value"] = scope


def metric(name: str, scope: str | None = None) -> str:
    """The logged metric of difference ``name`` in ``scope`` (``delta_target_lang`` -> ``delta_target_lang_rest``)."""
    return name if (scope or SCOPE["value"]) == "all" else f"{name}_rest"


def _row(r: Rec, name: str, scope: str | None) -> tuple[float, float, float, float, float]:
    k = metric(name, scope)
    return r.m(k), r.m(f"{k}_lo"), r.m(f"{k}_hi"), r.m(f"{k}_p"), r.m(f"{k}_groups")


def verdicts(rs: list[Rec], name: str, scope: str | None = None) -> list[str]:
    """The verdict of difference ``name`` of each run of one table (or count): ``lower`` / ``higher`` / ``tie`` /
    ``too few`` / ``no interval``, with Benjamini-Hochberg across the runs (a run logged without a p keeps its
    interval's verdict: runs before p-values existed)."""
    return family([(r, name) for r in rs], scope)


def family(items: list[tuple[Rec, str]], scope: str | None = None) -> list[str]:
    """The verdicts of one table whose rows are (run, difference) items (several differences of one run, such as a
    summary's per-task seesaw, or one difference of several runs), with Benjamini-Hochberg across them."""
    return table_verdicts([_row(r, name, scope) for r, name in items])


def verdict(r: Rec, name: str, scope: str | None = None) -> str:
    """The verdict of difference ``name`` of run ``r`` alone (a row of a table: :func:`verdicts` or :func:`family`,
    with BH across the table)."""
    e, lo, hi, _, g = _row(r, name, scope)
    return _verdict(e, lo, hi, g)


def count(rs: list[Rec], name: str, which: str = "lower", scope: str | None = None) -> int:
    """How many of the runs of one table show ``which`` (``lower`` / ``higher``) for ``name``, after BH across them."""
    return sum(1 for v in verdicts(rs, name, scope) if v == which)


def count_lower(rs: list[Rec], name: str, scope: str | None = None) -> int:
    """How many runs show ``name`` below zero (after BH across them)."""
    return count(rs, name, "lower", scope)


def cell(r: Rec, name: str, scope: str | None = None, digits: int = 4) -> str:
    """``+0.0123 [+0.0040, +0.0210]`` (``—`` when not measured; the bare number and ``(no interval)`` for a run
    recorded without one)."""
    k = metric(name, scope)
    est, lo, hi = r.m(k), r.m(f"{k}_lo"), r.m(f"{k}_hi")
    if not math.isfinite(est):
        return "—"
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{est:+.{digits}f} (no interval)"
    return f"{est:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def edge_note(chosen: float, grid) -> str:
    """"" where ``chosen`` lies inside ``grid`` (a setting chosen over a grid: alpha, ratio); otherwise a note that it
    sits at the grid's lower or upper edge, so the optimum may lie outside the grid (widen it before reading the
    choice as an optimum). A grid of one or two values has no interior: said so."""
    g = sorted({float(x) for x in grid})
    if len(g) < 3:
        return f" (a grid of {len(g)}: no interior to choose from)"
    if chosen <= g[0]:
        return f" (at the grid's lower edge {g[0]:g}: the optimum may lie below it)"
    if chosen >= g[-1]:
        return f" (at the grid's upper edge {g[-1]:g}: the optimum may lie above it)"
    return ""
