"""The analysis: the one context every section builder reads and adds to, and what the report is written from.

:meth:`Analysis.of` reads what every section shares from the study's runs (its models, the cross-model pair rows, the
CKA matrix, each model's quality and train run, the true configs, the checkpoint pairs); each section builder of
:mod:`mergescope.analysis.sections` takes the analysis, returns its sections and adds CSV tables, console tables, run
metrics, correlation frames and tables to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mergescope.analysis.pairs import build_pair_rows, cka_matrix
from mergescope.analysis.records import Rec, Study, base_name, is_checkpoint_pair
from mergescope.analysis.tables import RTable, Section

__all__ = ["Analysis", "true_configs", "N_PERMUTATIONS"]

N_PERMUTATIONS = 20000  # permutation null of the correlation tables (label shuffles per cell)


def true_configs(study: Study) -> dict[str, tuple[dict[str, Any], str]]:
    """model label -> (its true config as logged, the run that logged it): quality runs first, then measure runs."""
    true_cfg: dict[str, tuple[dict[str, Any], str]] = {}
    for r in study.kind("quality"):
        if r.group("model.true"):
            true_cfg[r.tags["model"]] = (r.group("model.true"), r.run_id)
    for r in study.measures + study.native:
        for side in ("a", "b"):
            lab = r.tags.get(f"model_{side}")
            if lab and lab not in true_cfg and r.group(f"model_{side}.true"):
                true_cfg[lab] = (r.group(f"model_{side}.true"), r.run_id)
    return true_cfg


@dataclass
class Analysis:
    """The study's runs, what every section shares, the sections built so far, and what they added."""

    study: Study
    models: list[str]
    pairs: list[dict[str, Any]]  # the cross-model pair rows (mergescope.analysis.pairs)
    cka_matrix: np.ndarray
    quality: dict[str, Rec]
    train: dict[str, Rec]
    true_cfg: dict[str, tuple[dict[str, Any], str]]
    checkpoint: list[Rec]  # checkpoint-pair native runs, by run then trajectory distance
    n_permutations: int = N_PERMUTATIONS
    sections: list[Section] = field(default_factory=list)
    csv: dict[str, str] = field(default_factory=dict)
    console_tables: list[RTable] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    frames: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # arm -> diagnostic -> one value per row
    correlations: dict[str, Any] = field(default_factory=dict)  # arm -> correlation table, arm_power -> power statement
    figures: dict[str, Any] = field(default_factory=dict)  # name -> matplotlib Figure (mergescope.analysis.figures)

    @classmethod
    def of(cls, study: Study, n_permutations: int = N_PERMUTATIONS) -> Analysis:
        models, pairs = build_pair_rows(study)
        M, _ = cka_matrix([r for r in study.measures if not is_checkpoint_pair(r)], models)
        ck = [r for r in study.native if is_checkpoint_pair(r)]
        ck.sort(key=lambda r: (base_name(r.tags.get("model_a", "")), r.m("log10_step_ratio")))
        return cls(study, models, pairs, M, {r.tags.get("model"): r for r in study.kind("quality")},
                   {r.tags.get("model"): r for r in study.kind("train")}, true_configs(study), ck, n_permutations)

    @property
    def experiment(self) -> str:
        return self.study.experiment

    @property
    def inputs(self) -> list[Rec]:
        """Every run the analysis read (``inputs/runs.csv``)."""
        return self.study.records

    @property
    def source(self) -> str:
        """How the study's runs were chosen (:attr:`~mergescope.analysis.records.Study.source`)."""
        return self.study.source

    def section(self, key: str) -> Section:
        return next(s for s in self.sections if s.key == key)
