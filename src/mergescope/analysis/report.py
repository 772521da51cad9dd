"""The study report: one Markdown file and its HTML rendering per study, from an :class:`~mergescope.analysis.tables.Analysis`.

``write_report(analysis, out_dir, run_id)`` writes ``<out_dir>/report.md``, ``report.html`` and the
figures as ``<out_dir>/figures/<name>.png`` (linked relatively from the Markdown; embedded in the HTML, which is
self-contained; the analysis run logs the same layout). One figure policy: every figure is a PNG file and artifact,
shown once, in its own section; section 9 is an index of them. Sections follow the
spec: summary, config check, coverage, CKA matrix, the pair matrix, per-model NLL, checkpoint arm, native
pair, transport, correlation tables, figures, then every "not measured (why)" line and the run index that
maps each short run id in the tables to its full MLflow run id.

The HTML is the Markdown rendered by markdown-it-py (CommonMark plus pipe tables, raw HTML off) inside one
self-contained page (:func:`markdown_to_html`).
"""

from __future__ import annotations

import datetime as _dt
import html
import re
from functools import lru_cache
from pathlib import Path

from mergescope.analysis.context import Analysis
from mergescope.analysis.tables import RTable
from mergescope.tracking import UI_MODE

__all__ = ["build_markdown", "markdown_to_html", "write_report", "table_markdown", "summary_lines", "not_measured_lines",
           "slug", "toc_lines"]

CSS = """body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:.85em}th,td{border:1px solid #ccc;padding:.25em .5em}
th{background:#f3f3f3}img{max-width:100%;height:auto}table{display:block;max-width:100%;overflow-x:auto}blockquote{color:#8a4b00;border-left:3px solid #e0a040;
margin:.5em 0;padding:.2em .8em;background:#fff8ec}code{font-size:.9em}"""


def _cell(x: str) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def table_markdown(t: RTable) -> list[str]:
    """A table as Markdown lines: bold title, pipe table (first column left, the rest right-aligned), italic note."""
    out = [f"**{t.title}**", ""]
    out.append("| " + " | ".join(_cell(c) for c in t.columns) + " |")
    out.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(t.columns))) + "|")
    for r in t.rows:
        out.append("| " + " | ".join(_cell(c) for c in r) + " |")
    out.append("")
    if t.note:
        out += [f"*{t.note}*", ""]
    return out


def _kind_counts(an: Analysis) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for r in an.inputs:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    return kinds


def _header(an: Analysis, run_id: str | None, tracking_uri: str | None) -> list[str]:
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [f"# mergescope study report: `{an.experiment}`", "",
            f"Built {when} by analysis run `{run_id or '(not logged)'}` from MLflow alone: {len(an.inputs)} FINISHED runs of "
            f"experiment `{an.experiment}`" + (f" ({tracking_uri})" if tracking_uri else "") + f", chosen from {an.source} ("
            + ", ".join(f"{v} {k}" for k, v in sorted(_kind_counts(an).items())) + "). Run ids in the tables are their "
            "first 8 characters; the run index at the end gives the full ids (also the artifact `inputs/runs.csv`).", ""]


SUMMARY = {"corr_cross": "Diagnostics, cross-model arm"}  # the analysis' own; each arm labels its own (Report.summary)


def summary_lines(an: Analysis) -> list[str]:
    """The summary: one line per arm, its finding with its control and a run id (or why it was not measured), in the
    order of the sections."""
    from mergescope.arm import arms

    labels = {**{k: v for a in arms() for k, v in a.report.summary.items()}, **SUMMARY}
    out, absent = [], []
    for s in an.sections:
        label = labels.get(s.key)
        if label is None:
            continue
        head = f"**{label}** ({s.number})" if s.number else f"**{label}**"
        if s.finding:
            out.append(f"{head}: {s.finding}")
        elif s.tables:  # measured, without a one-sentence finding: its first text line says what it holds
            out.append(f"{head}: " + (s.text[0] if s.text else "see its section"))
        else:
            absent.append(label.lower())
    if absent:
        out.append("Not measured in this study: " + ", ".join(absent) + " (why: the \"Not measured\" list).")
    return out


def slug(title: str) -> str:
    """The heading's anchor, as GitHub and the HTML page both make it: lower case, punctuation dropped, spaces -> '-'."""
    t = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return t.replace(" ", "-")


def toc_lines(an: Analysis) -> list[str]:
    heads = [s.title for s in an.sections] + ["Not measured (why)", "Run index"]
    return ["## Contents", "", *(f"- [{h}](#{slug(h)})" for h in heads), ""]


def not_measured_lines(an: Analysis) -> list[str]:
    """Every "not measured (why)" line of every section, in section order."""
    return [m for s in an.sections for m in s.missing]


def _section_markdown(an: Analysis, s) -> list[str]:
    lines = [f"## {s.title}", ""]
    if s.finding:
        lines += [f"**Finding.** {s.finding}", ""]
    for p in (t for t in s.text if t != s.finding):  # the finding is said once, above
        lines += [p, ""]
    for t in s.tables:
        lines += table_markdown(t)
    for name, cap in s.figures:  # one figure policy: a PNG file (and artifact) each, shown once, in its section
        if name in an.figures:
            lines += [f"![{_alt(cap)}](figures/{name}.png)", "", f"Figure: {_cell(cap)}", ""]
    for m in s.missing:
        lines += [f"> {m}", ""]
    return lines


def _alt(caption: str) -> str:
    return re.sub(r"[\[\]*_`]", "", caption)


def embed_figures(md: str, figdir: Path) -> str:
    """Every ``figures/<name>.png`` image of the Markdown as a data URI of that file: the HTML page is self-contained
    (it shows its figures opened alone, e.g. in MLflow's artifact viewer, where relative links break)."""
    import base64

    def sub(m: re.Match) -> str:
        path = figdir / f"{m.group(2)}.png"
        if not path.is_file():
            return m.group(0)
        return f"![{m.group(1)}](data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()})"

    return re.sub(r"!\[([^\]]*)\]\(figures/([\w.-]+)\.png\)", sub, md)


def _run_index(an: Analysis) -> list[str]:
    lines = ["## Run index", "", "Every run the report reads, with the key it is joined on.", ""]
    lines += ["| run | full run id | kind | what |", "|---|---|---|---|"]
    for r in an.inputs:
        t = r.tags
        what = " ".join(x for x in (t.get("metric") or t.get("merge") or "", t.get("pair") or t.get("model") or "",
                                    t.get("direction") or "", f"alpha={t['alpha']}" if t.get("alpha") else "") if x)
        lines.append(f"| {r.run_id[:8]} | `{r.run_id}` | {r.kind} | {_cell(what)} |")
    return lines + [""]


def build_markdown(an: Analysis, run_id: str | None = None, tracking_uri: str | None = None) -> str:
    """The report as Markdown. Figures are referenced as ``figures/<name>.png``."""
    lines = _header(an, run_id, tracking_uri)
    lines += ["## Summary", ""] + [f"- {x}" for x in summary_lines(an)] + [""]
    lines += toc_lines(an)
    for s in an.sections:
        lines += _section_markdown(an, s)
    missing = not_measured_lines(an)
    lines += ["## Not measured (why)", ""]
    lines += [f"- {m}" for m in missing] if missing else ["Every section of the report was measured."]
    lines.append("")
    lines += _run_index(an)
    return "\n".join(lines)


@lru_cache(maxsize=1)
def _markdown():
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": False}).enable("table")


def run_url(ui_url: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI."""
    return f"{ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{UI_MODE}"


def link_run_ids(md: str, run_ids: list[str], ui_url: str, experiment_id: str) -> str:
    """Every run id of ``run_ids`` in the Markdown (its 8-character short form, or the full id in backticks)
    as a link to that run in the MLflow UI; other hex strings (cfg hashes) are left alone."""
    full = {r: r for r in run_ids}
    short = {r[:8]: r for r in run_ids}

    def sub_full(m: re.Match) -> str:
        return f"[`{m.group(1)}`]({run_url(ui_url, experiment_id, m.group(1))})" if m.group(1) in full else m.group(0)

    def sub_short(m: re.Match) -> str:
        rid = short.get(m.group(1))
        return f"[{m.group(1)}]({run_url(ui_url, experiment_id, rid)})" if rid else m.group(0)

    md = re.sub(r"`([0-9a-f]{32})`", sub_full, md)
    return re.sub(r"(?<![\w`/\[])([0-9a-f]{8})(?![\w`\]])", sub_short, md)


def markdown_to_html(md: str, title: str = "report") -> str:
    """The Markdown rendered (CommonMark + pipe tables, raw HTML escaped) as one standalone HTML page."""
    body = _markdown().render(md)
    body = re.sub(r"<h([23])>(.*?)</h\1>", lambda m: f'<h{m.group(1)} id="{slug(html.unescape(re.sub("<[^>]+>", "", m.group(2))))}">'
                  f"{m.group(2)}</h{m.group(1)}>", body)  # anchors for the contents' links
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body>\n" + body + "</body></html>\n")


def write_report(an: Analysis, out_dir: str | Path, run_id: str | None = None, tracking_uri: str | None = None,
                 ui: tuple[str, str] | None = None) -> tuple[Path, Path]:
    """Write ``report.md``, ``report.html`` and ``figures/*.png`` under ``out_dir``; returns the two paths.
    ``ui`` = (MLflow UI base URL, experiment id): every run id in the HTML links to its run there."""
    out = Path(out_dir)
    figdir = out / "figures"
    figdir.mkdir(parents=True, exist_ok=True)
    for old in figdir.glob("*.png"):
        if old.stem not in an.figures:
            old.unlink()
    for name, fig in an.figures.items():
        fig.savefig(figdir / f"{name}.png", format="png", dpi=130, bbox_inches="tight")
    md = build_markdown(an, run_id, tracking_uri)
    md_path, html_path = out / "report.md", out / "report.html"
    md_path.write_text(md, encoding="utf-8")
    if ui is not None:
        md = link_run_ids(md, [r.run_id for r in an.inputs] + ([run_id] if run_id else []), *ui)
    html_path.write_text(markdown_to_html(embed_figures(md, figdir), title=f"mergescope report: {an.experiment}"), encoding="utf-8")
    return md_path, html_path
