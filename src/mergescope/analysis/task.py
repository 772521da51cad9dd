"""The analyze task: ``python launch.py task=analyze study=<name>`` (:func:`run_analyze`) and
``python -m mergescope.analysis --experiment <name> --root <dir>`` (:func:`main`).

Reads the study (:mod:`~mergescope.analysis.records`), builds the sections (:mod:`~mergescope.analysis.build`)
and figures, prints the console tables, writes the report (:mod:`~mergescope.analysis.report`) and logs one
kind=analysis run through :mod:`mergescope.tracking` (CSV tables, figures, the report, ``inputs/runs.csv``).
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mergescope.analysis.context import N_PERMUTATIONS, Analysis
from mergescope.analysis.figures import close_figures, make_figures
from mergescope.analysis.records import STUDY_JOBS, Study, load_study
from mergescope.analysis.report import run_url, summary_lines, write_report
from mergescope.analysis.tables import RTable, Section, csv_text, tables_text
from mergescope.errors import MergescopeError
from mergescope.progress import console, status
from mergescope.tracking import HEADLINE_VIEW, PARENT_ENV, UI_MODE, Job, Tracker, read_artifact_text

__all__ = ["run_analyze", "main"]


SUMMARY_ARTIFACT = "report/summary.txt"


@lru_cache(maxsize=1)
def code_digest() -> str:
    """SHA-256 of the package's source files: a report made by other code is never reused."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def analysis_key(cfg: DictConfig, job_runs: list[str]) -> str:
    """What an analysis of a study launch is a function of: the study's run ids, the code, and its own settings."""
    parts = {"runs": sorted(set(job_runs)), "code": code_digest(), "experiment": str(cfg.tracking.experiment),
             "analysis": OmegaConf.to_container(cfg.analysis, resolve=True) if cfg.get("analysis") else {},
             "ui_url": str((cfg.get("report") or {}).get("ui_url") or "")}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def reuse_analysis(cfg: DictConfig, job_runs: list[str] | None) -> dict[str, Any] | None:
    """A study launch whose runs and code are those of the latest analysis run (``analysis_key``), with its report
    still on disk, reuses that report: its findings are printed again and nothing is rebuilt (``rerun=true`` rebuilds).
    None when there is nothing to reuse."""
    if not job_runs or cfg.get("rerun"):
        return None
    key = analysis_key(cfg, job_runs)
    tracker = Tracker(cfg)
    found = tracker.runs(f"tags.kind = 'analysis' and tags.analysis_inputs = '{key}'")
    if not found:
        return None
    run = found[0]
    md = Path(str(run.data.params.get("report", "")))
    html_path = md.with_suffix(".html")
    if not (md.is_file() and html_path.is_file()):
        return None
    if hashlib.sha256(md.read_bytes()).hexdigest() != run.data.params.get("report_sha256"):
        return None  # the report on disk is another analysis's now: rebuild
    try:
        lines = read_artifact_text(tracker.client, run.info.run_id, SUMMARY_ARTIFACT).splitlines()
    except Exception:  # an analysis run from before the summary artifact: rebuild
        return None
    status.rule(f"[bold]{cfg.tracking.experiment}: findings[/] (report reused: same runs and code as analysis run "
                 f"{run.info.run_id[:8]})")
    from rich.markup import escape

    for line in lines:
        status.print("- " + escape(line.replace("**", "")), soft_wrap=True)
    ui = str((cfg.get("report") or {}).get("ui_url") or DEFAULT_UI_URL).rstrip("/")
    print(f"runs:   {ui}/#/experiments/{tracker.experiment_id}/runs?viewStateShareKey={HEADLINE_VIEW}&{UI_MODE}")
    print(f"report: {md}")
    print(f"        {html_path}")
    return {"run_id": run.info.run_id, "report_md": md, "report_html": html_path, "reused": True,
            "pairs": int(run.data.metrics.get("pairs_cka", 0)), "pairs_above": int(run.data.metrics.get("pairs_cka_above_shuffled", 0))}


def _log_analysis(job: Job, an: Analysis, study: Study, out_dir: Path, md_path: Path, html_path: Path) -> None:
    """The analysis run's artifacts, metrics and params."""
    for path, text in an.csv.items():
        job.log_text(text, path)
    job.log_text(tables_text(an.console_tables), "tables/summary.txt")
    for name in an.figures:
        job.log_artifact(out_dir / "figures" / f"{name}.png", "figures")
    job.log_text(csv_text(["cfg_hash", "run_id", "kind"], [[r.tags.get("cfg_hash", ""), r.run_id, r.kind] for r in study.records]),
                 STUDY_JOBS)
    job.log_artifact(md_path)
    job.log_artifact(html_path)
    kinds: dict[str, int] = {}
    for r in study.records:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    job.log_metrics({**an.metrics, "input_runs": float(len(study.records))})
    job.log_params({"input_runs": f"{len(study.records)} runs, ids in artifact inputs/runs.csv",
                    "input_kinds": kinds, "report": str(md_path)})


DEFAULT_UI_URL = "http://127.0.0.1:5000"  # what `make ui` serves
KIND_MEANINGS = {  # the study's own kinds; each arm declares its own (mergescope.arm.Report.kinds)
    "train": "training of one zoo model (its checkpoints are revisions)",
    "eval": "lm-evaluation-harness on one merged model (tag merge_run: the merge it scored)",
    "analysis": "the study report: tables, figures, this description",
}


def kind_meanings() -> dict[str, str]:
    """Every run kind's meaning: each arm's, then the study's own."""
    from mergescope.arm import arms

    return {**{k: v for a in arms() for k, v in a.report.kinds.items()}, **KIND_MEANINGS}


def headline_columns(study: Study) -> list[str]:
    """The metric each of the study's runs is read by (:func:`mergescope.runs.headline_key`), once each, in the order
    their kinds first appear: the columns of the study's saved runs-table view."""
    from mergescope.runs import headline_key

    keys = [headline_key(r.tags, r.metrics) for r in study.records]
    return list(dict.fromkeys(k for k in keys if k))


def experiment_description(study: Study, md_path: Path, run_id: str, run_link: str = "") -> str:
    """The experiment's description for the MLflow UI: the study, what each kind tag holds, where the report is."""
    kinds = sorted({r.kind for r in study.records} | {"analysis"})
    meanings = kind_meanings()
    lines = [f"**mergescope study `{study.experiment}`**: {len(study.records)} runs of the study's jobs, chosen from {study.source}.",
             "", "Runs by `kind` tag:", ""]
    lines += [f"- `{k}`: {meanings.get(k, 'see the README')}" for k in kinds]
    lines += ["", f"Report: `{md_path}` (and `report.html` beside it, where every run id links to its run), written by "
              f"analysis run [`{run_id}`]({run_link or run_id}), whose artifacts hold the same report, its tables and figures."]
    return "\n".join(lines)


def run_analyze(cfg: DictConfig, overrides: list[str] | None = None, job_runs: list[str] | None = None,
                timings: dict[str, float] | None = None, peaks: dict[str, float] | None = None) -> dict[str, Any]:
    """task=analyze: read the study's runs, build tables, figures and the report, log one kind=analysis run.

    ``job_runs``: the run ids of the study's jobs (the study passes them). Without them, the job list
    logged by the latest analysis run is used; the runs outside it go to the "Other settings" section.

    Returns ``{"run_id", "report_md", "report_html", "cka_matrix", "models", "pairs", "pairs_above",
    "analysis"}``. Raises MergescopeError (before any run exists) when the experiment has nothing to analyse.
    """
    Tracker(cfg).reap_gone()  # RUNNING runs whose process is gone are marked KILLED (and printed) before reading
    reused = reuse_analysis(cfg, job_runs)
    if reused is not None:
        return reused
    study = load_study(cfg, job_runs)
    from mergescope.analysis.build import build_analysis  # the sections and scipy.stats: only when a report is built

    from mergescope.analysis.claims import set_scope

    n_perm = int((cfg.get("analysis") or {}).get("n_permutations", N_PERMUTATIONS))
    set_scope(str((cfg.get("analysis") or {}).get("nll_scope", "rest")))
    an = build_analysis(study, n_permutations=n_perm)
    if timings:  # the launch's wall time per arm (the study passes it): a section of its own, after the findings
        sec = Section("timing", "Time per arm (this launch)")
        pk = peaks or {}
        sec.tables.append(RTable("Wall time and peak memory per arm", ["arm", "seconds", "peak RSS GiB"],
                                 [[k, f"{v:.1f}", f"{pk[k]:.2f}" if k in pk else "—"] for k, v in timings.items()],
                                 note="this launch's wall time, jobs reused from earlier launches included (they are fast); "
                                      "peak resident set of the study's process and of its worker processes during the arm "
                                      "(the largest of them, not their sum)"))
        an.sections.insert(0, sec)
    make_figures(an)
    for t in an.console_tables:  # a quiet study prints the CKA matrix (one small table); -v every table
        (status if t.title.startswith("Last-layer CKA") else console).print(t.rich())
    out_dir = Path(str(cfg.paths.root)) / "reports" / study.experiment
    tags = {"kind": "analysis", "study": study.experiment, "study_jobs": len(study.records)}
    tracker = Tracker(cfg)
    ui = (str((cfg.get("report") or {}).get("ui_url") or DEFAULT_UI_URL), tracker.experiment_id)
    key = analysis_key(cfg, job_runs) if job_runs else None
    if key:
        tags["analysis_inputs"] = key  # (a tag named *key* would be redacted as a secret)
    with tracker.start(cfg, f"analysis {study.experiment}", tags, overrides) as job:
        md_path, html_path = write_report(an, out_dir, run_id=job.run_id, tracking_uri=study.uri, ui=ui)
        _log_analysis(job, an, study, out_dir, md_path, html_path)
        job.log_text("\n".join(summary_lines(an)), SUMMARY_ARTIFACT)
        job.log_params({"report_sha256": hashlib.sha256(Path(md_path).read_bytes()).hexdigest()})
    tracker.describe(experiment_description(study, md_path, job.run_id, run_url(*ui, job.run_id)))
    launch = os.environ.get(PARENT_ENV) or study.latest_launch()  # the runs table opens on this launch's jobs
    view = tracker.share_view(headline_columns(study), launch)
    close_figures(an)
    from rich.markup import escape

    status.rule(f"[bold]{study.experiment}: findings")  # the terminal ends with the findings and the report's path
    for line in summary_lines(an):
        status.print("- " + escape(line.replace("**", "")), soft_wrap=True)
    print(f"runs:   {ui[0].rstrip('/')}/#/experiments/{ui[1]}/runs?{view}&{UI_MODE} (the launch's jobs, each one's headline metric as a column)")
    print(f"report: {md_path}")  # the report's path last
    print(f"        {html_path}")
    return {"run_id": job.run_id, "report_md": md_path, "report_html": html_path, "cka_matrix": an.memo.get("cka_matrix"),
            "models": an.models, "pairs": int(an.metrics.get("pairs_cka", 0)),
            "pairs_above": int(an.metrics.get("pairs_cka_above_shuffled", 0)), "analysis": an}


def main(argv: list[str] | None = None) -> int:
    """Analyse an experiment from MLflow alone (same as task=analyze).

    python -m mergescope.analysis [--experiment toy] [--root .]
    """
    import argparse

    from omegaconf import OmegaConf

    p = argparse.ArgumentParser(prog="python -m mergescope.analysis",
                                description="The study's tables, figures and report, read from MLflow.")
    p.add_argument("--experiment", default="toy")
    p.add_argument("--root", default=".")
    a = p.parse_args(argv)
    cfg = OmegaConf.create({"paths": {"root": str(Path(a.root).resolve())}, "tracking": {"experiment": a.experiment}, "tags": {}})
    try:
        run_analyze(cfg, [])
    except MergescopeError as exc:
        print(f"error: {exc}")
        return 2
    return 0
