"""The report's sections: one module per arm, and :data:`OUTLINE`, the one ordered list that numbers them.

Each entry of the outline is one spec section and its subsections: the first builder is the section itself
(``None``: the section has subsections only), the rest its subsections, lettered in order (``4a``; ``8a``, ``8b``).
A builder takes the :class:`~mergescope.analysis.context.Analysis` and its number and returns a section, a list
of them (all under that number), or None (its runs do not exist in this study, e.g. no epsilon sweep). Adding a
section is one function in one module and one entry here; every heading takes its number from this list.

Modules: ``models`` (config check, coverage, per-model quality), ``representation`` (CKA matrix, pair matrix),
``checkpoint``, ``native_pair``, ``transport``, ``adapt``, ``shared_space``, ``calibration`` (transport settings
swept across runs), ``correlations``, ``other_settings`` (the experiment's runs outside the study's jobs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from string import ascii_lowercase

from mergescope.analysis.context import Analysis
from mergescope.analysis.sections.adapt import adapt_section
from mergescope.analysis.sections.beside import beside_the_seed
from mergescope.analysis.sections.calibration import epsilon_calibration, probe_count
from mergescope.analysis.sections.checkpoint import checkpoint_arm
from mergescope.analysis.sections.correlations import correlations_checkpoint, correlations_cross
from mergescope.analysis.sections.models import config_check, coverage, per_model_quality, precision_section
from mergescope.analysis.sections.native_pair import native_pair
from mergescope.analysis.sections.other_settings import other_settings
from mergescope.analysis.sections.representation import cka_section, one_language_section, pair_matrix
from mergescope.analysis.sections.shared_space import shared_space_section
from mergescope.analysis.sections.transport import transport
from mergescope.analysis.tables import Section

__all__ = ["OUTLINE", "numbered", "build_sections", "figure_index", "other_settings"]

Builder = Callable[[Analysis, str], "Section | list[Section] | None"]


def figure_index(an: Analysis, number: str) -> Section:
    """The figure index: filled in by :func:`mergescope.analysis.figures.make_figures` once the figures are drawn."""
    return Section("figures", f"{number}. Figures")


OUTLINE: tuple[tuple[Builder | None, ...], ...] = (
    (config_check,),
    (coverage,),
    (cka_section, one_language_section),
    (pair_matrix, per_model_quality, precision_section),
    (checkpoint_arm,),
    (native_pair,),
    (transport, adapt_section, shared_space_section, epsilon_calibration, probe_count),
    (None, correlations_checkpoint, correlations_cross),
    (beside_the_seed,),
    (figure_index,),
)


def numbered() -> Iterator[tuple[str, Builder]]:
    """(number, builder) for every builder of the outline, in order: ``"1"``, ``"2"``, ..., ``"4a"``, ..., ``"8b"``."""
    for i, part in enumerate(OUTLINE, 1):
        for j, make in enumerate(part):
            if make is not None:
                yield (str(i) if j == 0 else f"{i}{ascii_lowercase[j - 1]}"), make


def build_sections(an: Analysis) -> list[Section]:
    """Every section of the outline, in order, numbered; then the runs with other settings (unnumbered)."""
    for number, make in numbered():
        out = make(an, number)
        for sec in [] if out is None else out if isinstance(out, list) else [out]:
            sec.number = number
            an.sections.append(sec)
    an.sections.append(other_settings(an.study))
    return an.sections
