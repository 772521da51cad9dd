"""The analysis: the one context every section builder reads and adds to, and what the report is written from.

:meth:`Analysis.of` reads what every section shares from the study's runs (its models, the cross-model pair rows each
arm adds its columns to, each model's quality and train run, the true configs); each section builder (the analysis'
own in :mod:`mergescope.analysis.sections`, each arm's in its package) takes the analysis, returns its sections and adds
CSV tables, console tables, run metrics, correlation frames and tables to it (``memo``: what an arm reads once and
its sections share, e.g. the CKA matrix).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mergescope.analysis.records import Rec, Study
from mergescope.analysis.tables import RTable, Section

__all__ = ["Analysis", "true_configs", "N_PERMUTATIONS"]

N_PERMUTATIONS = 20000  # permutation null of the correlation tables (label shuffles per cell)


def true_configs(study: Study) -> dict[str, tuple[dict[str, Any], str]]:
    """model label -> (its true config as logged, the run that logged it): the runs that score one model first (the
    arms' ``model_kinds``), then the runs of a pair (``model_a.true`` / ``model_b.true``)."""
    true_cfg: dict[str, tuple[dict[str, Any], str]] = {}
    for r in study.kind(*model_kinds()):
        if r.group("model.true"):
            true_cfg[r.tags["model"]] = (r.group("model.true"), r.run_id)
    for r in study.records:
        for side in ("a", "b"):
            lab = r.tags.get(f"model_{side}")
            if lab and lab not in true_cfg and r.group(f"model_{side}.true"):
                true_cfg[lab] = (r.group(f"model_{side}.true"), r.run_id)
    return true_cfg


def model_kinds() -> tuple[str, ...]:
    """The run kinds that score one model (each arm's :attr:`~mergescope.arm.Report.model_kinds`)."""
    from mergescope.arm import arms

    return tuple(k for a in arms() for k in a.report.model_kinds)


@dataclass
class Analysis:
    """The study's runs, what every section shares, the sections built so far, and what they added."""

    study: Study
    models: list[str]
    pairs: list[dict[str, Any]]  # the cross-model pair rows (mergescope.analysis.pairs)
    quality: dict[str, Rec]  # model label -> the run that scored it (the arms' model_kinds)
    train: dict[str, Rec]
    true_cfg: dict[str, tuple[dict[str, Any], str]]
    n_permutations: int = N_PERMUTATIONS
    other_pairs: list[dict[str, Any]] = field(default_factory=list)  # pairs an arm measured outside the rows (coverage)
    memo: dict[str, Any] = field(default_factory=dict)  # what an arm reads once and its sections share
    sections: list[Section] = field(default_factory=list)
    csv: dict[str, str] = field(default_factory=dict)
    console_tables: list[RTable] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    frames: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # arm -> diagnostic -> one value per row
    correlations: dict[str, Any] = field(default_factory=dict)  # arm -> correlation table, arm_power -> power statement
    figures: dict[str, Any] = field(default_factory=dict)  # name -> matplotlib Figure (mergescope.analysis.figures)

    @classmethod
    def of(cls, study: Study, n_permutations: int = N_PERMUTATIONS) -> Analysis:
        from mergescope.analysis.pairs import build_pair_rows

        an = cls(study, [], [], {r.tags.get("model"): r for r in study.kind(*model_kinds())},
                 {r.tags.get("model"): r for r in study.kind("train")}, true_configs(study), n_permutations)
        an.models, an.pairs, an.other_pairs = build_pair_rows(an)
        return an

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
