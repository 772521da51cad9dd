"""The report's outline: the analysis' own sections and every arm's (:attr:`mergescope.arm.Report.sections`), each at
its order key ``(section, subsection)``, numbered from those keys.

Sections are numbered by the rank of their first key among every key declared (the analysis' own: 10 the config
check, 20 coverage, 40 the pair matrix, 40.2 the precision check, 80.2 the cross-model correlations, 90 beside the spec
documents, 100 the figure index); subsection 0 is the section itself, the others are lettered in order (``4a``; ``8a``,
``8b``), and a section may have subsections only. A builder takes the
:class:`~mergescope.analysis.context.Analysis` and its number and returns a section, a list of them (all under that
number), or None (its runs do not exist in this study, e.g. no epsilon sweep). Adding a section is one function and
one order key in its arm's ``arm.py``; no list here names an arm.

Modules: ``models`` (config check, coverage, precision), ``matrix`` (the pair matrix, each arm's tables),
``correlations`` (the correlation tables; the cross-model pairs'), ``beside`` (the spec documents' numbers beside each
arm's), ``other_settings`` (the experiment's runs outside the study's jobs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from string import ascii_lowercase

from mergescope.analysis.context import Analysis
from mergescope.analysis.sections.beside import beside_the_seed
from mergescope.analysis.sections.correlations import correlations_cross
from mergescope.analysis.sections.matrix import pair_matrix
from mergescope.analysis.sections.models import config_check, coverage, precision_section
from mergescope.analysis.sections.other_settings import other_settings
from mergescope.analysis.tables import Section

__all__ = ["CORE", "outline", "numbered", "build_sections", "figure_index", "other_settings"]

Builder = Callable[[Analysis, str], "Section | list[Section] | None"]


def figure_index(an: Analysis, number: str) -> Section:
    """The figure index: filled in by :func:`mergescope.analysis.figures.make_figures` once the figures are drawn."""
    return Section("figures", f"{number}. Figures")


CORE: dict[tuple[int, int], Builder] = {(10, 0): config_check, (20, 0): coverage, (40, 0): pair_matrix,
                                        (40, 2): precision_section, (80, 2): correlations_cross, (90, 0): beside_the_seed,
                                        (100, 0): figure_index}


def outline() -> list[tuple[tuple[int, int], Builder]]:
    """Every section builder, the analysis' own and each arm's, by order key; two at one key are an error."""
    from mergescope.arm import arms, target

    keyed: dict[tuple[int, int], Builder] = dict(CORE)
    for a in arms():
        for key, spec in a.report.sections.items():
            if tuple(key) in keyed:
                raise RuntimeError(f"arm {a.name!r} declares report section {spec} at {key}, where another section sits")
            keyed[tuple(key)] = target(spec)
    return sorted(keyed.items())


def numbered() -> Iterator[tuple[str, Builder]]:
    """(number, builder) for every builder of the outline, in order: ``"1"``, ``"2"``, ..., ``"4a"``, ..., ``"8b"``."""
    majors: dict[int, int] = {}
    letters: dict[int, int] = {}
    for (major, minor), make in outline():
        number = str(majors.setdefault(major, len(majors) + 1))
        if minor:
            letters[major] = letters.get(major, 0) + 1
            number += ascii_lowercase[letters[major] - 1]
        yield number, make


def build_sections(an: Analysis) -> list[Section]:
    """Every section of the outline, in order, numbered; then the runs with other settings (unnumbered)."""
    for number, make in numbered():
        out = make(an, number)
        for sec in [] if out is None else out if isinstance(out, list) else [out]:
            sec.number = number
            an.sections.append(sec)
    an.sections.append(other_settings(an.study))
    return an.sections
