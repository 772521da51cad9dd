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
- ``pairs``: the CKA matrix and one row of diagnostics per cross-model pair;
- ``context``: :class:`Analysis`, the one context the section builders read and add to;
- ``report``: Markdown and HTML; ``figures``: draws the figures the sections registered, and the figure index;
- ``sections``: one module per arm, and ``OUTLINE``, the one ordered list that numbers the sections;
- ``build``: :func:`build_analysis`, the driver over the outline;
- ``task``: :func:`run_analyze` (task=analyze) and :func:`main` (``python -m mergescope.analysis``).
"""

from mergescope.analysis.build import build_analysis
from mergescope.analysis.context import N_PERMUTATIONS, Analysis
from mergescope.analysis.figures import make_figures
from mergescope.analysis.pairs import build_pair_rows, cka_matrix
from mergescope.analysis.records import Rec, Study, load_study
from mergescope.analysis.report import build_markdown, markdown_to_html, write_report
from mergescope.analysis.tables import TYPOLOGY, RTable, Section, f3
from mergescope.analysis.task import main, run_analyze
from mergescope.stats import correlation_table, power_statement

__all__ = ["run_analyze", "main", "build_analysis", "load_study", "Rec", "Study", "Analysis", "RTable", "Section",
           "cka_matrix", "build_pair_rows", "make_figures", "build_markdown", "markdown_to_html", "write_report",
           "correlation_table", "power_statement", "f3", "TYPOLOGY", "N_PERMUTATIONS"]
