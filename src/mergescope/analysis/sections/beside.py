"""The study's headline numbers beside the spec documents' (``../shared/spec``): the same quantity, measured here, next
to what each report states, with the conditions that differ. Each arm gives its rows (:attr:`mergescope.arm.Report.beside`:
``[quantity, this study, the spec document, its source]``), built only from this study's runs; a row whose runs the
study does not have says so."""

from __future__ import annotations

from mergescope.analysis.context import Analysis
from mergescope.analysis.tables import RTable, Section

__all__ = ["beside_the_seed"]


def beside_the_seed(an: Analysis, number: str) -> Section | None:
    """The study's headline numbers beside the spec documents' (None when the study has no cross-model pairs)."""
    from mergescope.arm import arms, target

    if not an.pairs:
        return None
    sec = Section("beside_seed", f"{number}. Beside the spec documents' numbers")
    placed = sorted((min(a.report.sections, default=(0, 0)), a.report.beside) for a in arms() if a.report.beside)
    rows = [row for _, spec in placed for row in target(spec)(an)]  # in the order of the arms' sections
    sec.tables.append(RTable("This study beside the spec documents", ["quantity", "this study", "the spec document", "source"], rows,
                             note="The seed's numbers are quoted from ../shared/spec, never computed here; their models, sizes "
                                  "and sentence counts differ from this study's (its config and section 1), and the seed counts "
                                  "a raw difference as a win where this study asks for an interval that excludes 0. Raw CKA "
                                  "depends on n and the widths (its shuffled control falls as n grows); the calibrated value "
                                  "(against its permutation null) is comparable across them."))
    an.csv["tables/beside_the_seed.csv"] = sec.tables[-1].csv()
    return sec
