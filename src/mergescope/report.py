"""The study report: one Markdown file and its HTML rendering per study, from an :class:`~mergescope.analysis.Analysis`.

``write_report(analysis, out_dir, run_id)`` writes ``<out_dir>/report.md``, ``report.html`` and the
figures as ``<out_dir>/figures/<name>.png`` (linked relatively, so the folder can be moved or opened
from the MLflow artifact tree, where the analysis run logs the same layout). Sections follow the
spec: config check, coverage, CKA matrix, the pair matrix, per-model NLL, checkpoint arm, native pair,
transport, correlation tables, figures, then every "not measured (why)" line and the run index that
maps each short run id in the tables to its full MLflow run id.

The HTML is produced by :func:`markdown_to_html`, a small converter for exactly what the report uses
(headings, paragraphs, pipe tables, bullet lists, block quotes, images, ``**bold**``, ``*italic*``,
```code```), so no Markdown package is needed.
"""

from __future__ import annotations

import datetime as _dt
import html
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from mergescope.analysis import Analysis, RTable

__all__ = ["build_markdown", "markdown_to_html", "write_report"]


def _cell(x: str) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def table_markdown(t: RTable) -> list[str]:
    out = [f"**{t.title}**", ""]
    out.append("| " + " | ".join(_cell(c) for c in t.columns) + " |")
    out.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(t.columns))) + "|")
    for r in t.rows:
        out.append("| " + " | ".join(_cell(c) for c in r) + " |")
    out.append("")
    if t.note:
        out += [f"*{t.note}*", ""]
    return out


def build_markdown(an: Analysis, run_id: str | None = None, tracking_uri: str | None = None) -> str:
    """The report as Markdown. Figures are referenced as ``figures/<name>.png``."""
    lines = [f"# mergescope study report: `{an.experiment}`", ""]
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    kinds: dict[str, int] = {}
    for r in an.inputs:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    lines.append(
        f"Built {when} by analysis run `{run_id or '(not logged)'}` from MLflow alone: {len(an.inputs)} FINISHED runs of "
        f"experiment `{an.experiment}`" + (f" ({tracking_uri})" if tracking_uri else "") + " -- the latest per `cfg_hash`, then the "
        "latest per job (" + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())) + "). Run ids in the tables are their first "
        "8 characters; the run index at the end gives the full ids (also the artifact `inputs/runs.csv`)."
    )
    lines.append("")
    lines += ["## Summary", ""]
    summary = []
    for key in ("cka", "checkpoint", "transport", "corr_checkpoint", "corr_cross"):
        s = next((s for s in an.sections if s.key == key), None)
        if s is None:
            continue
        if key == "checkpoint" and s.tables:
            rows = [r for r in s.tables[0].rows if r[0] == s.tables[0].rows[0][0]]
            parts = [f"{r[1]}: n={r[2]}, median barrier {r[3]}, median merge gain {r[4]}, merging beats the better endpoint in {r[5]}"
                     for r in rows if r[2] != "0"]
            summary.append("Checkpoint arm -- " + "; ".join(parts) + ".")
        elif key.startswith("corr") and s.text:
            summary.append(s.title.split(": ", 1)[-1].capitalize() + ": " + s.text[-1].split(" Permutation null")[0].replace("Power: ", ""))
        elif s.text:
            summary.append(s.text[0] if key != "checkpoint" else "")
        elif s.missing:
            summary.append(s.missing[0])
    lines += [f"- {x}" for x in summary if x] + [""]

    for s in an.sections:
        lines += [f"## {s.title}", ""]
        if s.key == "figures":
            for name, cap in s.figures:
                lines += [f"![{cap}](figures/{name}.png)", "", f"*{cap}*", ""]
        else:
            for p in s.text:
                lines += [p, ""]
            for t in s.tables:
                lines += table_markdown(t)
            for name, cap in s.figures:
                if name in an.figures:
                    lines += [f"![{cap}](figures/{name}.png)", ""]
        for m in s.missing:
            lines += [f"> {m}", ""]

    lines += ["## Not measured (why)", ""]
    missing = [m for s in an.sections for m in s.missing]
    lines += [f"- {m}" for m in missing] if missing else ["Every section of the report was measured."]
    lines.append("")

    lines += ["## Run index", "", "Every run the report reads, with the key it is joined on.", ""]
    lines += ["| run | full run id | kind | what |", "|---|---|---|---|"]
    for r in an.inputs:
        t = r.tags
        what = " ".join(x for x in (t.get("metric") or t.get("merge") or "", t.get("pair") or t.get("model") or "",
                                    t.get("direction") or "", f"alpha={t['alpha']}" if t.get("alpha") else "") if x)
        lines.append(f"| {r.run_id[:8]} | `{r.run_id}` | {r.kind} | {_cell(what)} |")
    lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- HTML

_CSS = """body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:.85em}th,td{border:1px solid #ccc;padding:.25em .5em}
th{background:#f3f3f3}td.r,th.r{text-align:right}img{max-width:100%}blockquote{color:#8a4b00;border-left:3px solid #e0a040;
margin:.5em 0;padding:.2em .8em;background:#fff8ec}code{font-size:.9em}figure{margin:1em 0}figcaption{font-style:italic;color:#555}"""


def _inline(text: str) -> str:
    out = html.escape(text, quote=False)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)
    out = re.sub(r"(?<![\w*])\*([^*\s][^*]*?)\*(?![\w*])", r"<em>\1</em>", out)
    return out


def _split_row(line: str) -> list[str]:
    body = line.strip()
    if body.startswith("|"):
        body = body[1:]
    if body.endswith("|") and not body.endswith("\\|"):
        body = body[:-1]
    cells = re.split(r"(?<!\\)\|", body)
    return [c.strip().replace("\\|", "|") for c in cells]


def markdown_to_html(md: str, title: str = "report") -> str:
    """Render the subset of Markdown the report uses to a standalone HTML page."""
    lines = md.splitlines()
    out: list[str] = []
    para: list[str] = []
    i = 0

    def flush() -> None:
        if para:
            out.append("<p>" + _inline(" ".join(para)) + "</p>")
            para.clear()

    while i < len(lines):
        line = lines[i]
        s = line.strip()
        if not s:
            flush()
            i += 1
            continue
        m = re.match(r"^(#{1,6})\s+(.*)$", s)
        if m:
            flush()
            level = len(m.group(1))
            out.append(f"<h{level}>{_inline(m.group(2))}</h{level}>")
            i += 1
            continue
        m = re.match(r"^!\[([^\]]*)\]\(([^)]+)\)$", s)
        if m:
            flush()
            out.append(f'<figure><img src="{html.escape(m.group(2))}" alt="{html.escape(m.group(1))}"></figure>')
            i += 1
            continue
        if s.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$", lines[i + 1].strip()):
            flush()
            head = _split_row(s)
            aligns = ["r" if c.strip().endswith(":") else "" for c in _split_row(lines[i + 1])]
            out.append("<table><thead><tr>" + "".join(
                f'<th class="{aligns[k] if k < len(aligns) else ""}">{_inline(c)}</th>' for k, c in enumerate(head)) + "</tr></thead><tbody>")
            i += 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                cells = _split_row(lines[i])
                out.append("<tr>" + "".join(
                    f'<td class="{aligns[k] if k < len(aligns) else ""}">{_inline(c)}</td>' for k, c in enumerate(cells)) + "</tr>")
                i += 1
            out.append("</tbody></table>")
            continue
        if s.startswith("- "):
            flush()
            out.append("<ul>")
            while i < len(lines) and lines[i].strip().startswith("- "):
                out.append("<li>" + _inline(lines[i].strip()[2:]) + "</li>")
                i += 1
            out.append("</ul>")
            continue
        if s.startswith("> "):
            flush()
            quote = []
            while i < len(lines) and lines[i].strip().startswith(">"):
                quote.append(lines[i].strip()[1:].strip())
                i += 1
            out.append("<blockquote>" + _inline(" ".join(quote)) + "</blockquote>")
            continue
        para.append(s)
        i += 1
    flush()
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(out) + "\n</body></html>\n")


def write_report(an: Analysis, out_dir: str | Path, run_id: str | None = None, tracking_uri: str | None = None) -> tuple[Path, Path]:
    """Write ``report.md``, ``report.html`` and ``figures/*.png`` under ``out_dir``; returns the two paths."""
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
    html_path.write_text(markdown_to_html(md, title=f"mergescope report: {an.experiment}"), encoding="utf-8")
    return md_path, html_path
