"""The analysis driver: every section of the report from the study's runs, in the spec's order (no MLflow writes)."""

from __future__ import annotations

from mergescope.analysis.adapt import adapt_section
from mergescope.analysis.arms import checkpoint_arm, native_pair, transport
from mergescope.analysis.calibration import setting_sections
from mergescope.analysis.correlations import N_PERMUTATIONS, correlation_sections
from mergescope.analysis.others import other_settings
from mergescope.analysis.records import Rec, Study
from mergescope.analysis.shared_space import shared_space_section
from mergescope.analysis.sections import Build, cka_section, config_check, coverage, pair_matrix, per_model_quality
from mergescope.analysis.tables import Analysis, Section, csv_text

__all__ = ["build_analysis", "inputs_csv"]

# spec sections 1 to 7, in order; 8a/8b follow, then 9 (figures, filled in by mergescope.analysis.figures.make_figures)
SECTION_BUILDERS = (config_check, coverage, cka_section, pair_matrix, per_model_quality, checkpoint_arm, native_pair, transport, adapt_section, shared_space_section)


def inputs_csv(recs: list[Rec]) -> str:
    """``inputs/runs.csv``: every run the analysis read, with the key it is joined on."""
    return csv_text(["run_id", "kind", "metric", "pair", "model", "direction", "alpha", "cfg_hash"],
                    [[r.run_id, r.kind, r.tags.get("metric", r.tags.get("merge", "")), r.tags.get("pair", ""), r.tags.get("model", ""),
                      r.tags.get("direction", ""), r.tags.get("alpha", ""), r.tags.get("cfg_hash", "")] for r in recs])


def build_analysis(study: Study, n_permutations: int = N_PERMUTATIONS) -> Analysis:
    """Every table, section and frame of the report from the study's runs (no MLflow writes)."""
    b = Build.of(study)
    sections = [make(b) for make in SECTION_BUILDERS]
    sections += setting_sections(b)  # epsilon calibration / probe count, when the runs differ in that setting
    sections += correlation_sections(b, n_permutations)
    sections.append(Section("figures", "9. Figures"))
    sections.append(other_settings(study))
    b.csv["inputs/runs.csv"] = inputs_csv(study.records)
    return Analysis(study.experiment, b.models, b.cka, sections, study.records, b.frames, b.correlations, b.metrics, b.csv,
                    console_tables=b.console_tables, pairs=b.pairs, source=study.source)
