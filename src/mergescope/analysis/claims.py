"""Comparative claims as the report makes them: a difference counts as a finding only where its paired interval
(:mod:`mergescope.intervals`, logged by the job as ``<name>_lo`` / ``<name>_hi`` / ``<name>_groups``) excludes zero.

Every NLL difference is read in one scope (:data:`SCOPE`): ``rest`` (the first token, predicted from the start token
alone, apart; the default) or ``all`` (every token). :func:`metric` names the logged metric of a difference in that
scope, :func:`verdict` says what it shows, :func:`cell` prints it with its interval. A run recorded before intervals
existed has none: its verdict is ``"no interval"`` and it is never counted.
"""

from __future__ import annotations

import math

from mergescope.analysis.records import Rec
from mergescope.intervals import verdict as _verdict

__all__ = ["SCOPE", "SCOPE_NOTE", "cell", "count_lower", "edge_note", "metric", "verdict", "set_scope"]

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


def verdict(r: Rec, name: str, scope: str | None = None) -> str:
    """``lower`` / ``higher`` / ``tie`` / ``too few`` / ``no interval`` for difference ``name`` of run ``r``."""
    k = metric(name, scope)
    return _verdict(r.m(k), r.m(f"{k}_lo"), r.m(f"{k}_hi"), r.m(f"{k}_groups"))


def count_lower(rs: list[Rec], name: str, scope: str | None = None) -> int:
    """How many runs show ``name`` below zero with the interval excluding zero."""
    return sum(1 for r in rs if verdict(r, name, scope) == "lower")


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
