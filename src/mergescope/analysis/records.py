"""Reading the study from MLflow: one :class:`Rec` per run, deduplicated into a :class:`Study`.

Only the public read API of :mod:`mergescope.tracking` is used (``store_uri``, ``client_for``); nothing here
writes to MLflow. The study keeps every FINISHED run except analysis runs, the latest per ``cfg_hash`` and
then the latest per logical job (:func:`logical_key`), oldest first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from omegaconf import DictConfig

from mergescope.errors import MergescopeError
from mergescope.tracking import client_for, read_artifact_text, store_uri

__all__ = ["Rec", "Study", "load_study", "finished_runs", "logged_study_jobs", "STUDY_JOBS", "logical_key", "base_name", "is_checkpoint_pair", "direction", "transport_headline"]


@dataclass
class Rec:
    """One MLflow run: id, start time, tags, metrics (latest values), params (strings)."""

    run_id: str
    start: int
    tags: dict[str, str]
    metrics: dict[str, float]
    params: dict[str, str]

    @property
    def kind(self) -> str:
        return self.tags.get("kind", "")

    def m(self, key: str) -> float:
        v = self.metrics.get(key)
        return float("nan") if v is None else float(v)

    def param(self, key: str) -> Any:
        """A logged param parsed back to a value (``"64"`` -> 64, ``"True"`` -> True, ``"null"`` -> None)."""
        raw = self.params.get(key)
        if raw is None:
            return None
        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError:
            return raw

    def text(self, key: str) -> str | None:
        """A logged param that is prose, as written (``param`` would read "a (1 vs 2): b" as a YAML mapping);
        None where it is unset or was logged as None."""
        raw = self.params.get(key)
        return None if raw in (None, "None", "null", "") else str(raw)

    def group(self, prefix: str) -> dict[str, Any]:
        p = prefix + "."
        return {k[len(p):]: self.param(k) for k in self.params if k.startswith(p)}


def base_name(label: str) -> str:
    return str(label).split("@", 1)[0]


def is_checkpoint_pair(r: Rec) -> bool:
    if r.tags.get("arm"):
        return r.tags["arm"] == "checkpoint"
    return base_name(r.tags.get("model_a", "")) == base_name(r.tags.get("model_b", "?"))


def direction(r: Rec) -> str:
    """A transport run's direction, ``"target <- donor"``."""
    return r.tags.get("direction") or f"{r.tags.get('target')} <- {r.tags.get('donor')}"


def transport_headline(runs: list[Rec]) -> Rec | None:
    """A direction's run at its headline alpha (``merge.headline_alpha``, tagged on every run): fixed in the config,
    never the alpha that did best on the evaluation sentences. None when no run is at it (or runs predate the tag)."""
    def alpha(r: Rec) -> float:
        return r.m("alpha") if np.isfinite(r.m("alpha")) else float(r.tags.get("alpha", "nan"))

    at = [r for r in runs if r.tags.get("headline_alpha") and np.isclose(float(r.tags["headline_alpha"]), alpha(r))]
    return at[-1] if at else None


def logical_key(r: Rec) -> tuple | None:
    """The job a run belongs to (one per model, per pair and metric, per direction and alpha, ...), as the arm that logs
    its kind declares (:attr:`mergescope.arm.Report.logical_keys`); a zoo model's training: one per model; None: one per
    cfg_hash."""
    if r.kind == "train":
        return (r.kind, r.tags.get("model"))
    fn = _logical_keys().get(r.kind)
    return None if fn is None else fn(r)


_KEYS: dict[int, dict[str, Any]] = {}  # id of the arms' tuple -> run kind -> its logical-key function


def _logical_keys() -> dict[str, Any]:
    from mergescope.arm import arms, target

    declared = arms()
    if id(declared) not in _KEYS:
        _KEYS[id(declared)] = {kind: target(spec) for a in declared for kind, spec in a.report.logical_keys.items()}
    return _KEYS[id(declared)]


@dataclass
class Study:
    """The study's own runs (``records``), and the experiment's other FINISHED runs (``others``: other settings).

    ``source`` says how the study's runs were chosen: the study's job list (every run its jobs produced or
    reused), or, when no study has logged one, the latest FINISHED run per cfg_hash and per logical job."""

    experiment: str
    uri: str
    records: list[Rec]
    others: list[Rec] = field(default_factory=list)
    source: str = "the latest FINISHED run per cfg_hash and per job (no study job list was logged)"
    rejudged: int = 0
    """How many runs' comparisons were recomputed from their per-sentence tables with the current rule."""
    tables: dict = field(default_factory=dict, repr=False)

    def kind(self, *kinds: str) -> list[Rec]:
        return [r for r in self.records if r.kind in kinds]

    def metric_history(self, run_id: str, key: str) -> dict[int, float]:
        """One metric's logged values of one of the study's runs, by step ({} when it logged none)."""
        return {m.step: m.value for m in client_for(self.uri).get_metric_history(run_id, key)}

    def artifact_text(self, run_id: str, path: str) -> str | None:
        """A text artifact of one of the study's runs; None when the run has no such file (a section says so)."""
        try:
            return read_artifact_text(client_for(self.uri), run_id, path)
        except Exception:  # noqa: BLE001 - MLflow raises several types for a missing artifact
            return None

    def score_table(self, run_id: str):
        """A run's per-sentence table (``scores/sentences.csv``) as ``({(arm, language): Scores}, {language:
        documents})``, read once; None for a run recorded without one."""
        if run_id not in self.tables:
            from mergescope.evidence import parse_table

            text = self.artifact_text(run_id, "scores/sentences.csv")
            self.tables[run_id] = None if text is None else parse_table(text)
        return self.tables[run_id]

    def latest_launch(self) -> str | None:
        """The run id of the experiment's latest study launch (kind=study, the parent of its jobs), if any."""
        client = client_for(self.uri)
        exp = client.get_experiment_by_name(self.experiment)
        runs = [] if exp is None else client.search_runs([exp.experiment_id], filter_string="tags.kind = 'study'", max_results=1,
                                                         order_by=["attributes.start_time DESC"])
        return runs[0].info.run_id if runs else None

    def failed(self, kind: str) -> list[Rec]:
        """The experiment's FAILED runs of one kind (a non-converging transport setting is a result, not a gap)."""
        client = client_for(self.uri)
        exp = client.get_experiment_by_name(self.experiment)
        if exp is None:
            return []
        runs = client.search_runs([exp.experiment_id], filter_string=f"attributes.status = 'FAILED' and tags.kind = '{kind}'",
                                  max_results=1000)
        return [_rec(r) for r in runs]


def latest_per_job(recs: list[Rec]) -> list[Rec]:
    """The latest run per cfg_hash, then per logical job; oldest first (the study's own order)."""
    seen_hash: set[str] = set()
    seen_key: set[tuple] = set()
    out = []
    for r in sorted(recs, key=lambda r: -r.start):
        h = r.tags.get("cfg_hash")
        if h is not None:
            if h in seen_hash:
                continue
            seen_hash.add(h)
        key = logical_key(r)
        if key is not None:
            if key in seen_key:
                continue
            seen_key.add(key)
        out.append(r)
    out.sort(key=lambda r: r.start)
    return out


def finished_runs(client, uri: str, experiment: str) -> list[Rec]:
    """Every FINISHED run of the experiment but the analysis runs, newest first."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise MergescopeError(f"no MLflow experiment '{experiment}' in {uri}; run the study first "
                              f"(python launch.py study={experiment}) or pick another with study=<name>")
    runs = client.search_runs([exp.experiment_id], filter_string="attributes.status = 'FINISHED'",
                              max_results=50000, order_by=["attributes.start_time DESC"])
    return [_rec(r) for r in runs if r.data.tags.get("kind") not in (None, "analysis")]


def _rec(r) -> Rec:
    return Rec(r.info.run_id, int(r.info.start_time or 0), dict(r.data.tags), dict(r.data.metrics), dict(r.data.params))


STUDY_JOBS = "inputs/study_jobs.csv"  # the analysis run's artifact: every run of the study's jobs


def logged_study_jobs(client, experiment_id: str) -> tuple[list[str], str] | None:
    """The study job list logged by the latest analysis run that has one: (run ids, that analysis run's id)."""
    runs = client.search_runs([experiment_id], filter_string="tags.kind = 'analysis' and attributes.status = 'FINISHED'",
                              max_results=200, order_by=["attributes.start_time DESC"])
    for r in runs:
        if "study_jobs" in r.data.tags:
            text = read_artifact_text(client, r.info.run_id, STUDY_JOBS)
            return [line.split(",")[1] for line in text.splitlines()[1:] if line], r.info.run_id
    return None


def load_study(cfg: DictConfig, job_runs: list[str] | None = None) -> Study:
    """Read the study's experiment from MLflow; a one-line MergescopeError when there is nothing to analyse.

    ``job_runs``: the run ids of the study's jobs (the study passes them; otherwise the job list that the
    latest analysis run logged is used). Runs of the experiment outside it are ``others``."""
    uri, _ = store_uri(cfg)
    experiment = str(cfg.tracking.experiment)
    client = client_for(uri)
    finished = finished_runs(client, uri, experiment)
    source = "the study's job list (every run its jobs produced or reused)"
    if job_runs is None and finished:
        logged = logged_study_jobs(client, client.get_experiment_by_name(experiment).experiment_id)
        if logged is not None:
            job_runs, source = logged[0], f"the study's job list, as logged by analysis run {logged[1]}"
    if job_runs is None:
        out, others = latest_per_job(finished), []
        source = Study.source
    else:
        wanted = set(job_runs)
        out = [r for r in sorted(finished, key=lambda r: r.start) if r.run_id in wanted]
        others = latest_per_job([r for r in finished if r.run_id not in wanted])
    if not out:
        raise MergescopeError(f"experiment '{experiment}' has no FINISHED runs to analyse; run the study first "
                              f"(python launch.py study={experiment})")
    study = Study(experiment, uri, out, others, source)
    cache = cfg.get("paths", {}).get("cache")
    rejudge(study, Path(str(cache)) / "rejudged" if cache else None)
    return study


def rule_digest(spec: str) -> str:
    """What a recomputed comparison depends on besides the run's immutable tables: the source of the rule
    (:mod:`mergescope.intervals`, :mod:`mergescope.evidence`) and of the arm's function."""
    import hashlib
    import importlib.util

    h = hashlib.sha256()
    for mod in ("mergescope.intervals", "mergescope.evidence", spec.partition(":")[0]):
        found = importlib.util.find_spec(mod)
        h.update(Path(found.origin).read_bytes() if found and found.origin else mod.encode())
    h.update(spec.encode())
    return h.hexdigest()[:20]


def rejudge(study: Study, cache: Path | None = None) -> None:
    """The rule lives in the analysis: every run of a kind whose arm declares its comparisons (``Report.rejudge``) has
    them recomputed from its per-sentence tables with the current rule (:mod:`mergescope.intervals`), replacing what
    the job logged; a run recorded without a table keeps its logged numbers. Changing the rule never reruns a job.
    ``cache``: a folder where each run's recomputed metrics are kept under the run and the rule's digest (verified on
    read, recomputed when bad), so a relaunch does not recompute them."""
    from mergescope.arm import arms, target
    from mergescope.integrity import load_json, save_json

    fns = {kind: spec for a in arms() for kind, spec in a.report.rejudge.items()}
    digests: dict[str, str] = {}
    for r in [*study.records, *study.others]:
        spec = fns.get(r.kind)
        if spec is None:
            continue
        path = None
        if cache is not None:
            digest = digests.setdefault(spec, rule_digest(spec))
            path = cache / f"{r.run_id}-{digest}.json"
        got = load_json(path) if path is not None and path.exists() else None
        if got is None:
            got = target(spec)(study, r) or {}
            if path is not None:
                save_json(path, got)
        if got:
            r.metrics.update({k: float(v) for k, v in got.items()})
            study.rejudged += 1
