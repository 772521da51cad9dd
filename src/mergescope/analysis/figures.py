"""The report's figures: every section registers its own (:meth:`~mergescope.analysis.tables.Section.add_figure`, a
name, a caption and a function that draws it from the section's own reading); :func:`make_figures` draws them (matplotlib,
Agg, through :func:`mergescope.plotting.pyplot`) and fills the figure index. One policy: every figure is a PNG file and
artifact, shown once, in its section (the report embeds it in the HTML)."""

from __future__ import annotations

from typing import Any

from mergescope.analysis.context import Analysis
from mergescope.analysis.report import slug
from mergescope.plotting import pyplot

__all__ = ["make_figures", "close_figures", "expected_figures"]


def expected_figures() -> tuple[tuple[str, str], ...]:
    """The figures every full study draws, by name (each arm's, then the cross-model correlations'): the index says
    which were not drawn (and why)."""
    from mergescope.arm import arms

    return (*(f for a in arms() for f in a.report.figures), ("correlations_cross_model", "correlation heatmap, cross-model arm"))


def make_figures(an: Analysis) -> dict[str, Any]:
    """Every figure the sections registered, as matplotlib Figures keyed by name (a drawer that finds nothing to draw
    returns None and its figure is left out); the figure index lists where each is shown, and what was not drawn."""
    figs: dict[str, Any] = {}
    for s in an.sections:
        for name, _ in s.figures:
            fig = s.draw[name]()
            if fig is not None:
                figs[name] = fig
    index = an.section("figures")
    for s in an.sections:  # an index, not a second copy: each figure is shown once, in its section
        for name, cap in s.figures:
            if name in figs:
                index.text.append(f"- {cap}: [{s.title}](#{slug(s.title)}) (`figures/{name}.png`)")
    for name, cap in expected_figures():
        if name not in figs:
            index.missing.append(f"figure '{cap}': not drawn (its section was not measured; see above)")
    an.figures = figs
    return figs


def close_figures(an: Analysis) -> None:
    plt = pyplot()
    for fig in an.figures.values():
        plt.close(fig)
