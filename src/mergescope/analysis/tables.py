"""The report's building blocks: tables, sections, the analysis, number formatting and the one CSV writer.

Every CSV the analysis logs (``tables/*.csv``, ``inputs/runs.csv``) goes through :func:`csv_text`.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich.table import Table


__all__ = ["text_note", "RTable", "Section", "csv_text", "f3", "short", "median", "tables_text", "repr_metrics",
           "cross_diagnostics", "runs_cell", "TYPOLOGY"]



def repr_metrics(pairs: list[dict[str, Any]] | None = None) -> list[tuple[str, str]]:
    """(plug-in name, headline metric key) of every registered representation metric, in report order: derived from
    the registry, so a new metric plug-in reaches sections 4 and 8 without an edit here. With ``pairs``, only the
    metrics some pair has a value of (a study that did not measure one has no column for it)."""
    from mergescope.registry import metrics

    out = [(e.name, e.headline) for e in metrics.entries()]
    if pairs is not None:
        out = [(n, k) for n, k in out if any(k in p["values"] for p in pairs)]
    return out


def cross_diagnostics(pairs: list[dict[str, Any]] | None = None) -> list[str]:
    """The cross-model correlation table's columns: every representation metric's headline, then the pair rows' other
    diagnostics each arm declares (:attr:`mergescope.arm.Report.pair_diagnostics`), in the arms' order."""
    from mergescope.arm import arms

    return [k for _, k in repr_metrics(pairs)] + [d for a in arms() for d in a.report.pair_diagnostics]


def runs_cell(p: dict[str, Any], sources: tuple[tuple[str, str], ...]) -> str:
    """The run ids a row's cells come from, labelled (``label id``), in one compact cell."""
    return ", ".join(f"{lab} {short(p['src'][k])}" for lab, k in sources if p["src"].get(k))

TYPOLOGY = ["typology_syntactic", "typology_genetic", "typology_featural"]


def csv_text(header: list[Any], rows: Iterable[Iterable[Any]]) -> str:
    """A CSV file's text: the header row, then the rows (the csv module's default dialect)."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


@dataclass
class RTable:
    """A table for the console and the report: formatted cells, a title, an optional note."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str = ""

    def rich(self) -> Table:
        t = Table(title=self.title, caption=self.note or None)
        for i, c in enumerate(self.columns):
            t.add_column(c, justify="left" if i == 0 else "right")
        for r in self.rows:
            t.add_row(*r)
        return t

    def csv(self) -> str:
        return csv_text(self.columns, self.rows)


@dataclass
class Section:
    """One report section: its heading (numbered by :func:`mergescope.analysis.sections.outline`), its finding in one
    sentence, text, tables, figures and "not measured (why)" lines."""

    key: str
    title: str
    text: list[str] = field(default_factory=list)
    tables: list[RTable] = field(default_factory=list)
    figures: list[tuple[str, str]] = field(default_factory=list)  # (figure name, caption), in the order shown
    draw: dict[str, Callable[[], Any]] = field(default_factory=dict)  # name -> draws the Figure (or None: nothing to draw)
    missing: list[str] = field(default_factory=list)  # "not measured (why)" lines
    finding: str = ""  # the section's finding in one sentence, with its control and a run id (the report opens with it)
    number: str = ""  # its place in the outline ("4a"), set by the driver

    def add_figure(self, name: str, caption: str, draw: Callable[[], Any]) -> None:
        """A figure of this section: drawn by ``draw()`` when the report is written, one PNG like every other."""
        self.draw[name] = draw
        self.figures.append((name, caption))


def f3(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    try:
        x = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(x):
        return "—"
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 10 ** -digits):
        return f"{x:.{digits}g}"
    return f"{x:.{digits}f}"


def short(run_id: str | None) -> str:
    return "" if not run_id else run_id[:8]


def median(xs) -> float:
    """The median of the finite values; NaN when there are none."""
    a = np.asarray([x for x in xs if np.isfinite(x)], dtype=float)
    return float(np.median(a)) if a.size else float("nan")


def tables_text(tables: list[RTable]) -> str:
    """The tables as the console prints them, as plain text (artifact ``tables/summary.txt``)."""
    from rich.console import Console

    c = Console(record=True, width=200, file=io.StringIO())
    for t in tables:
        c.print(t.rich())
    return c.export_text()


def text_note(study, run_id: str, lang: str) -> str:
    """What one run was scored on: its sentences, articles and their domains (read from the article URLs of its
    per-sentence table: ``en.wikinews.org`` -> wikinews), for a section to say where its text covers one domain or a
    subset of the data; "" for a run without the table."""
    from urllib.parse import urlparse

    table = study.score_table(run_id) if run_id and hasattr(study, "score_table") else None
    docs = None if table is None else table[1].get(lang)
    if not docs:
        return ""
    doms = sorted({(urlparse(d).hostname or "?").split(".")[-2] if "." in (urlparse(d).hostname or "") else "?"
                   for d in docs})
    return (f"{len(docs)} sentences from {len(set(docs))} articles, "
            f"{'one domain' if len(doms) == 1 else f'{len(doms)} domains'} ({', '.join(doms)})")
