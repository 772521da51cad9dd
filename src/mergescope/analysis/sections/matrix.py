"""The cross-model diagnostic matrix (4): each arm's tables of the pair rows (its
:attr:`~mergescope.arm.Report.pair_tables`), in the arms' order, and every row's diagnostics as one CSV."""

from __future__ import annotations

from mergescope.analysis.context import Analysis
from mergescope.analysis.tables import Section, csv_text

__all__ = ["pair_matrix"]


def pair_matrix(an: Analysis, number: str) -> Section:
    """4. The cross-model diagnostic matrix: what every arm measured on each pair, with the run behind each value."""
    from mergescope.arm import arms, target

    sec = Section("pairs", f"{number}. The cross-model diagnostic matrix")
    for arm in arms():
        if arm.report.pair_tables:
            target(arm.report.pair_tables)(an, sec)
    if not an.pairs:
        sec.missing.append("pair matrix: not measured (no cross-model measure runs)")
    keys = sorted({k for p in an.pairs for k in p["values"]})
    an.csv["tables/pair_matrix.csv"] = csv_text(
        ["pair", "model_a", "model_b", *keys, *[f"run_id.{k}" for k in keys]],
        [[p["pair"], p["a"], p["b"], *[p["values"].get(k, "") for k in keys], *[p["src"].get(k) or "" for k in keys]] for p in an.pairs])
    return sec
