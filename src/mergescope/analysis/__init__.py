"""The study's analysis: tables, figures and the report, built from MLflow runs only (never private files).

``python launch.py task=analyze study=<name>`` (:func:`run_analyze`) reads every FINISHED run of the
study's experiment -- the latest per ``cfg_hash``, then the latest per logical job (one per pair and
metric, per model, per transport direction and alpha, ...) -- and builds the spec's tables:

- config check (each model's true config, from the logged params) and the coverage table (routes per
  cross-model pair and what blocks each);
- the CKA matrix (lower triangle matched, upper triangle the shuffled control);
- the per-pair diagnostic matrix: representation metrics and controls, both sides' NLL, URIEL typology
  distances, native weight diagnostics where defined, transport deltas;
- the checkpoint arm by trajectory-distance bins, the native cross-model pair, the transport table;
- diagnostic x diagnostic Spearman tables (:func:`correlation_table`) for the checkpoint and the
  cross-model arms, each with its power statement.

It logs one kind=analysis run (input run ids as ``inputs/runs.csv``; tables, figures, the report as
artifacts), prints the tables, writes ``<paths.root>/reports/<study>/report.md`` and ``report.html``
and prints the report's path. The default ``python launch.py`` ends with it.

Modules (each imports only those above it):

- ``records``: reading MLflow (:class:`Rec`, :class:`Study`, :func:`load_study`, the logical-job dedupe); every
  MLflow read of the analysis goes through it (``Study.artifact_text``, ``Study.failed``);
- ``tables``: :class:`RTable`, :class:`Section`, number formatting, the one CSV writer;
- ``pairs``: one row of diagnostics per cross-model pair, each arm adding its columns;
- ``context``: :class:`Analysis`, the one context the section builders read and add to;
- ``report``: Markdown and HTML; ``figures``: draws the figures the sections registered, and the figure index;
- ``sections``: the analysis' own sections and the outline that numbers them with every arm's (each arm's sections
  live in its package, ``<arm>/report.py``, declared in its ``arm.py``: :class:`mergescope.arm.Report`);
- ``build``: :func:`build_analysis`, the driver over the outline;
- ``task``: :func:`run_analyze` (task=analyze) and :func:`main` (``python -m mergescope.analysis``).
"""

import importlib

_WHERE = {"build_analysis": "build", "N_PERMUTATIONS": "context", "Analysis": "context", "make_figures": "figures",
          "build_pair_rows": "pairs", "Rec": "records", "Study": "records",
          "load_study": "records", "build_markdown": "report", "markdown_to_html": "report", "write_report": "report",
          "TYPOLOGY": "tables", "RTable": "tables", "Section": "tables", "f3": "tables", "main": "task",
          "run_analyze": "task"}
_STATS = {"correlation_table", "power_statement"}

__all__ = ["run_analyze", "main", "build_analysis", "load_study", "Rec", "Study", "Analysis", "RTable", "Section",
           "build_pair_rows", "make_figures", "build_markdown", "markdown_to_html", "write_report",
           "correlation_table", "power_statement", "f3", "TYPOLOGY", "N_PERMUTATIONS"]


def __getattr__(name: str):
    """The package's names, each imported from its module when first asked for: a study whose report is reused
    never imports the sections (and scipy.stats, 0.8 s of a cached relaunch)."""
    if name in _STATS:
        return getattr(importlib.import_module("mergescope.stats"), name)
    if name in _WHERE:
        return getattr(importlib.import_module(f"mergescope.analysis.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'mergescope.analysis' has no attribute {name!r}")
