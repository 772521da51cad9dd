"""The analysis driver: every section of the report from the study's runs, in the outline's order (no MLflow writes)."""

from __future__ import annotations

from mergescope.analysis.context import N_PERMUTATIONS, Analysis
from mergescope.analysis.records import Rec, Study
from mergescope.analysis.sections import build_sections
from mergescope.analysis.tables import csv_text

__all__ = ["build_analysis", "inputs_csv"]


def inputs_csv(recs: list[Rec]) -> str:
    """``inputs/runs.csv``: every run the analysis read, with the key it is joined on."""
    return csv_text(["run_id", "kind", "metric", "pair", "model", "direction", "alpha", "cfg_hash"],
                    [[r.run_id, r.kind, r.tags.get("metric", r.tags.get("merge", "")), r.tags.get("pair", ""), r.tags.get("model", ""),
                      r.tags.get("direction", ""), r.tags.get("alpha", ""), r.tags.get("cfg_hash", "")] for r in recs])


def build_analysis(study: Study, n_permutations: int = N_PERMUTATIONS) -> Analysis:
    """Every table and section of the report from the study's runs (no MLflow writes; figures are drawn by
    :func:`mergescope.analysis.figures.make_figures`)."""
    an = Analysis.of(study, n_permutations)
    build_sections(an)
    an.csv["inputs/runs.csv"] = inputs_csv(study.records)
    return an
