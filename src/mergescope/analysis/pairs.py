"""The cross-model pair rows: one row of diagnostics per pair of the study, each arm adding its own columns.

A pair row is a dict: ``pair``, ``a``, ``b``, ``lang_a``, ``lang_b``, ``values`` (diagnostic -> float), ``src``
(diagnostic -> the run id behind it), ``recs`` (metric -> the run) and what each arm adds (its
:attr:`~mergescope.arm.Report.pair_rows`: the representation arm creates the rows from its measure runs, the others
add their columns; ``routes_run``: a run that logged the pair's routes, read by the coverage table).
"""

from __future__ import annotations

from typing import Any

from mergescope.analysis.records import Rec

__all__ = ["build_pair_rows", "put", "new_row"]


def new_row(pair: str, a: str, b: str, lang_a: str | None = None, lang_b: str | None = None, **extra: Any) -> dict[str, Any]:
    """An empty pair row."""
    return {"pair": pair, "a": a, "b": b, "lang_a": lang_a, "lang_b": lang_b, "values": {}, "src": {}, "recs": {}, **extra}


def put(p: dict[str, Any], key: str, rec: Rec | None, metric: str) -> None:
    """One diagnostic of a pair row from one run (NaN and no source when the run is missing)."""
    p["values"][key] = rec.m(metric) if rec else float("nan")
    p["src"][key] = rec.run_id if rec else None



def build_pair_rows(an) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """The models in study order, the cross-model pair rows (every arm's columns, in the arms' order) and the pairs
    an arm measured outside them (listed in the coverage table only)."""
    from mergescope.arm import arms, target

    rows: dict[str, dict[str, Any]] = {}
    others: dict[str, dict[str, Any]] = {}
    for arm in arms():
        if arm.report.pair_rows:
            target(arm.report.pair_rows)(an, rows, others)
    models = list(dict.fromkeys(m for p in rows.values() for m in (p["a"], p["b"])))
    return models, list(rows.values()), [q for k, q in others.items() if k not in rows]
