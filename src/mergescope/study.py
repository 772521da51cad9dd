"""task=study: a study's jobs, listed explicitly and run in-process, then the analysis.

The study overlay's ``hydra.sweeper.params`` is the sweep (pairs x metrics); each of its jobs is composed exactly as
``python launch.py -m`` would compose it. From it the study takes its pairs and its models (trained when a zoo model is
missing); every other job comes from the arms the study names (``arms: [...]``), each declared in its package's
``arm.py`` (:mod:`mergescope.arm`: its phases, their job lists built from this plan, and the models it adds), run in
the arms' order after training.

Every job is composed from its own override list, and that list is what its run logs, so
``compose(logged overrides)`` gives back the job's config and ``cfg_hash``.
"""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra import compose
from omegaconf import DictConfig, ListConfig, OmegaConf

from mergescope.arm import arms, by_name
from mergescope.errors import MergescopeError, did_you_mean
from mergescope.jobs import (  # noqa: F401  (StudyJob, job, composed ...: the study's job helpers, re-exported)
    StudyJob,
    composed,
    done_pass,
    hydra_value,
    job,
    model_override,
    pair_override,
    run_all,
    sweep_jobs,
    use_compose_cache,
    with_languages,
    without,
    workers_of,
)
from mergescope.progress import console, set_quiet, status, verbose
from mergescope.runs import JOB_PEAK, model_label, recording


def sweep_job(overrides: list[str]) -> StudyJob:
    """A job of the study's sweep (``hydra.sweeper.params``: its task among them), as ``launch.py -m`` composes it."""
    cfg = composed(overrides)
    return StudyJob(str(cfg.task.name), overrides, cfg)


def study_arms(cfg: DictConfig) -> list[str]:
    """The arms a study runs, named explicitly (``arms: [...]``; the measure sweep's pairs feed every pair arm), each
    declared in its package's ``arm.py`` (:mod:`mergescope.arm`). An unknown arm, or an arm whose inputs the study
    does not give, is one line."""
    declared = by_name()
    arms = [str(a) for a in (cfg.get("arms") or [])]
    for a in arms:
        if a not in declared:
            raise MergescopeError(f"arms: unknown arm '{a}': {did_you_mean(a, list(declared))}")
    for a in arms:
        needs = declared[a].needs
        if needs is not None and not needs[1](cfg):
            raise MergescopeError(f"arms lists '{a}' but {needs[0]} is empty: set it, or leave the arm out")
    return arms


class Plan:
    """A study's jobs: the sweep (its measure jobs, pairs and models) and, through the arms' declarations, each arm's
    phases."""

    def __init__(self, overrides: list[str]):
        study_cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
        params = OmegaConf.to_container(study_cfg.hydra.sweeper.params, resolve=False) or {}
        if not params:
            raise MergescopeError("this study defines no sweep (hydra.sweeper.params); pick one with study=<name>")
        self.cfg = compose(config_name="config", overrides=overrides)
        use_compose_cache(Path(str(self.cfg.paths.cache)) / "compose")
        self.arms = study_arms(self.cfg)
        self._stage = stage_selection(self.cfg)  # a bad stage= is refused before anything runs
        self.base = without(overrides, "task")
        combos = sweep_jobs(params, list(self.cfg.get("models") or []))
        self.measures = [sweep_job(self.base + with_languages(self.cfg, c)) for c in combos]  # the sweep's own task
        self.pairs: dict[str, list[str]] = {}  # pair label -> the overrides that select the pair
        self.entries: dict[str, DictConfig] = {}  # model label -> entry, first-seen order
        for m in self.measures:
            c = m.cfg
            label = f"{model_label(c.pair.a)}__{model_label(c.pair.b)}"
            self.pairs.setdefault(label, [o for o in without(m.overrides, "task", "metric") if o not in self.base])
            for side in ("a", "b"):
                self.entries.setdefault(model_label(c.pair[side]), c.pair[side])
        one = self.cfg.get("one_language")  # the second protocol: every side of the sweep on one language, tagged
        self.one_language = [sweep_job(self.base + with_languages(self.cfg, c, one)) for c in combos] if one else []
        for arm in sorted((a for a in arms() if a.models is not None), key=lambda a: a.models_order):
            for e in arm.models(self):  # the arms' own models: trained when missing, scored like the sweep's
                self.entries.setdefault(model_label(e), e)

    def pair_jobs(self, task: str, extra: list[str] = ()) -> list[StudyJob]:
        return [job(task, [*self.base, *sel, *extra]) for sel in self.pairs.values()]

    def model_jobs(self, task: str) -> list[StudyJob]:
        return [job(task, [*self.base, *model_override(self.base, e), *train_steps(task, e)]) for e in self.entries.values()]

    def training_jobs(self) -> list[StudyJob]:
        """The study's zoo models, to be trained when missing (a real model is never trained). With ``stage=``, only
        those the stage's jobs read (:func:`stage_training`): a stage of real models alone trains nothing."""
        jobs = [j for j in self.model_jobs("train") if j.cfg.model.get("zoo") is not None]
        if self.stage is None or not jobs:
            return jobs
        return stage_training(jobs, self._stage_jobs())

    def _stage_jobs(self) -> list[StudyJob] | None:
        """Every job of the launch's stage (the phases :meth:`phases` lists, training apart), or None while a phase of
        it cannot list its jobs (decided from model files that do not exist yet)."""
        out: list[StudyJob] = []
        for _row, phase, listed in self.phases():
            if phase == "training":
                continue
            try:
                out += listed()
            except MergescopeError:
                return None
        return out

    def jobs(self, phase: str) -> list[StudyJob]:
        """One phase's jobs by its name, whether or not the study runs its arm (an arm's own checks still apply)."""
        return next(p for a in arms() for p in a.phases if p.name == phase).jobs(self)

    def phases(self) -> list[tuple[str, str, Callable[[], list[StudyJob]]]]:
        """(arm, phase, its jobs when asked) in the order the study runs them: training, then every declared arm's
        phases by the arm's ``order`` (none when the study does not run the arm), each cut to the launch's stage
        (:func:`stage_selection`). What ``plan=true`` lists and :func:`_run_jobs` runs (the same lists). Lazy: which
        pairs share a parameter space is read from the models' configs, which exist only once the zoo models are
        trained."""
        out = [("training", "training", lambda: self._listed("training", self.training_jobs))]
        for arm in arms():
            on = arm.name in self.arms
            out += [(arm.row, p.name, (lambda p=p: self.in_stage(p.name, self._listed(p.name, lambda: p.jobs(self)))
                                       if self.stage is None or p.name in self.stage else []) if on
                     else list) for p in arm.phases]
        return out

    def _listed(self, phase: str, make: Callable[[], list[StudyJob]]) -> list[StudyJob]:
        """A phase's jobs; listed once per phase while :func:`plan_rows` goes through every stage (nothing is trained
        meanwhile, so a phase's list cannot change), else made afresh each time."""
        memo = getattr(self, "_memo", None)
        if memo is None:
            return make()
        if phase not in memo:
            memo[phase] = make()
        return memo[phase]

    def in_stage(self, phase: str, jobs: list[StudyJob]) -> list[StudyJob]:
        """The jobs of ``phase`` that the launch's stage runs (all of them without ``stage=``)."""
        if self.stage is None:
            return jobs
        cut = self.stage.get(phase)
        return [] if cut is None else jobs[cut]

    @property
    def stage(self) -> dict[str, slice] | None:
        if not hasattr(self, "_stage"):
            self._stage = stage_selection(self.cfg)
        return self._stage


STAGE_ENTRY = re.compile(r"^(?P<phase>[^\[\]]+?)\s*(?:\[(?P<lo>-?\d*):(?P<hi>-?\d*)\])?$")


def stages(cfg: DictConfig) -> dict[str, dict[str, slice]]:
    """The study's named stages (``stages:`` in the study file: stage -> the phases it runs, in the study's order;
    ``"<phase>[i:j]"`` runs the slice i:j of that phase's job list, so a long phase can be split over two stages).
    Every phase the study runs belongs to some stage; the stages' union is the whole study. Checked in one line."""
    raw = cfg.get("stages")
    if not raw:
        return {}
    names = {p.name for a in arms() for p in a.phases} | {"training"}
    out: dict[str, dict[str, slice]] = {}
    for name, entries in raw.items():
        sel: dict[str, slice] = {}
        for e in entries or []:
            m = STAGE_ENTRY.match(str(e).strip())
            if m is None or m["phase"] not in names:
                phase = m["phase"] if m else str(e)
                raise MergescopeError(f"stages.{name}: unknown phase '{phase}': {did_you_mean(phase, sorted(names))}")
            lo, hi = m["lo"], m["hi"]
            sel[m["phase"]] = slice(int(lo) if lo else None, int(hi) if hi else None)
        out[str(name)] = sel
    return out


def stage_selection(cfg: DictConfig) -> dict[str, slice] | None:
    """The phases (and slices of them) of the launch's ``stage=<name>``; None without one (the whole study)."""
    name = cfg.get("stage")
    if name is None:
        return None
    every = stages(cfg)
    if not every:
        raise MergescopeError(f"stage={name}: this study defines no stages (stages: in its study file); drop stage=")
    if str(name) not in every:
        raise MergescopeError(f"stage={name}: unknown stage: {did_you_mean(str(name), list(every))}")
    return every[str(name)]


def _folder(p) -> str:
    return str(Path(str(p)).expanduser().resolve())


def zoo_folders(node) -> set[str]:
    """The folders of every zoo model a job's config names (a node with ``zoo`` settings and a ``name_or_path``),
    anywhere in it: its model, its pair's two sides, a merge's base."""
    out: set[str] = set()
    if isinstance(node, DictConfig):
        if node.get("zoo") is not None and node.get("name_or_path"):
            out.add(_folder(node.name_or_path))
        for k in node.keys():
            try:
                v = node[k]
            except Exception:  # an interpolation this job does not resolve: nothing of a model there
                continue
            if isinstance(v, (DictConfig, ListConfig)):
                out |= zoo_folders(v)
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            try:
                v = node[i]
            except Exception:
                continue
            if isinstance(v, (DictConfig, ListConfig)):
                out |= zoo_folders(v)
    return out


def stage_training(trains: list[StudyJob], stage_jobs: list[StudyJob] | None) -> list[StudyJob]:
    """The training jobs a stage needs: those of the zoo models its jobs read, and of the zoo models those continue
    from (``zoo.init_from``); every one when the stage's jobs are not known yet (``None``)."""
    if stage_jobs is None:
        return trains
    read = set().union(*(zoo_folders(j.cfg) for j in stage_jobs)) if stage_jobs else set()
    by_folder = {_folder(j.cfg.model.name_or_path): j for j in trains}
    todo = [f for f in read if f in by_folder]
    while todo:  # a fine-tune of a zoo model needs that model first
        base = (by_folder[todo.pop()].cfg.model.get("zoo") or {}).get("init_from")
        if base and _folder(base) in by_folder and _folder(base) not in read:
            read.add(_folder(base))
            todo.append(_folder(base))
    return [j for j in trains if _folder(j.cfg.model.name_or_path) in read]


def training_waves(jobs: list[StudyJob]) -> list[list[StudyJob]]:
    """The training jobs in waves: a model whose ``zoo.init_from`` is another job's folder waits for that job's wave
    (a fine-tune of a zoo base continues from the trained base); each wave runs on the study's workers."""
    from pathlib import Path

    def where(p) -> str:
        return str(Path(str(p)).expanduser().resolve())

    pending, waves = list(jobs), []
    while pending:
        folders = {where(j.cfg.model.name_or_path) for j in pending}
        wave = [j for j in pending if not ((j.cfg.model.get("zoo") or {}).get("init_from") and
                                           where(j.cfg.model.zoo.init_from) in folders)]
        if not wave:
            raise MergescopeError("the zoo models' init_from form a cycle: " + ", ".join(model_label(j.cfg.model) for j in pending))
        waves.append(wave)
        pending = [j for j in pending if j not in wave]
    return waves


def train_steps(task: str, entry: DictConfig) -> list[str]:
    """A zoo model that trains for its own number of steps (``train_steps``: the slow Mamba reference path)."""
    return [f"train.steps={int(entry.train_steps)}"] if task == "train" and entry.get("train_steps") else []


def _cost(client, run_id: str) -> tuple[float | None, float | None]:
    """A finished run's wall time (s) and its job's peak resident set (GiB; runs from before the metric have none)."""
    run = client.get_run(run_id)
    info = run.info
    secs = (info.end_time - info.start_time) / 1000 if info.end_time and info.start_time else None
    return secs, run.data.metrics.get(JOB_PEAK)


def plan_rows(plan: Plan, cfg: DictConfig) -> list[dict[str, Any]]:
    """Per phase: its jobs, how many are done (a FINISHED run of their identity exists: found exactly as a launch finds
    it, stopping before any work), the measured wall time of the done ones (their runs' durations) and two estimates
    for the rest: ``todo_s``, the median duration of the phase's done jobs in this store times the jobs left (None when
    no job of the phase has run yet), and ``cpu_s`` / ``gpu_s`` from the jobs' FLOP and byte counts
    (:mod:`mergescope.costs`: this CPU's rates fitted on the real-shape benchmark, the GPU of ``conf/costs.yaml``;
    None when a job's counts are unknown); the largest peak resident set of the phase's done jobs (metric
    ``job_peak_rss_gb``), and the counted peaks of its jobs left (CPU and GPU). Nothing runs and no run is created."""
    from mergescope import costs
    from mergescope.tracking import Tracker

    client = Tracker(cfg).client
    rates, gpu = costs.fit(), costs.constants().gpu
    counter = costs.Counter(costs.constants())
    every = stages(plan.cfg)
    if plan.stage is not None or not every:
        return _plan_rows(plan, client, rates, gpu, counter, str(cfg.get("stage") or ""))
    rows = []  # a staged study, every stage: in order, one counter (a forward an earlier stage pays is not paid again)
    plan._memo = {}  # each phase's jobs composed once, cut to each stage in turn
    try:
        for i, (name, sel) in enumerate(every.items()):
            plan._stage = sel
            rows += _plan_rows(plan, client, rates, gpu, counter, name, training=i == 0)  # training: listed once
    finally:
        plan._stage = None
        plan._memo = None
    return rows


def _plan_rows(plan: Plan, client, rates, gpu, counter, stage: str, training: bool = True) -> list[dict[str, Any]]:
    from mergescope import costs

    rows = []
    for arm, phase, of in plan.phases():
        if phase == "training" and not training:
            continue
        try:
            jobs = of()
        except MergescopeError as exc:  # decided from files that do not exist yet (a zoo model not trained, not downloaded)
            rows.append({"stage": stage, "arm": arm, "phase": phase, "jobs": 0, "done": 0, "todo": 0, "done_s": 0.0, "todo_s": None, "peak_gb": None,
                         "cpu_s": None, "gpu_s": None, "cpu_peak_gb": None, "gpu_peak_gb": None,
                         "todo_jobs": [], "note": f"decided from the models' files ({str(exc)[:80]})"})
            continue
        if not jobs:
            continue
        unknown: list[tuple[StudyJob, str]] = []
        done, todo = done_pass(jobs, unknown)
        costs_ = [_cost(client, r.run_id) for _, r in done]
        secs = [c for c, _ in costs_ if c is not None]
        peaks = [p for _, p in costs_ if p is not None]
        med = statistics.median(secs) if secs else None
        left = {id(j) for j in todo}
        works = [(j, costs.count(counter, j.task, j.cfg)) for j in jobs]  # in order: an extraction is paid once
        counted = [w for j, w in works if id(j) in left]
        known = counted and all(w is not None and not w.missing for w in counted)
        rows.append({"stage": stage, "arm": arm, "phase": phase, "jobs": len(jobs), "done": len(done), "todo": len(todo),
                     "peak_gb": max(peaks) if peaks else None,
                     "done_s": sum(secs), "todo_s": 0.0 if not todo else (med * len(todo) if med is not None else None),
                     "gflop": (sum(w.total_flops for w in counted) / 1e9 if known else None) if todo else 0.0,
                     "cpu_s": (sum(costs.cpu_seconds(w, rates) for w in counted) if known else None) if todo else 0.0,
                     "gpu_s": (sum(costs.gpu_seconds(w, rates, gpu) for w in counted) if known else None) if todo else 0.0,
                     "cpu_peak_gb": max(costs.cpu_peak_gib(w, rates) for w in counted) if known else None,
                     "gpu_peak_gb": max(costs.gpu_peak_gib(w) for w in counted) if known else None,
                     "unknown": sorted({why for _, why in unknown}),
                     "uncounted": sorted({m for w in counted if w is not None for m in w.missing}),
                     "todo_jobs": [f"{j.task} {' '.join(j.overrides[len(plan.base):])}" for j in todo], "note": ""})
    return rows


def show_plan(plan: Plan, cfg: DictConfig) -> dict[str, Any]:
    """``plan=true``: the study's jobs per phase, which are done, what the rest would cost (:func:`plan_rows`: from
    this store's runs, and from the FLOP and byte counts on this CPU and on the stated GPU), printed; with ``-v``
    every job left to run."""
    from rich.markup import escape
    from rich.table import Table

    from mergescope import costs

    was_quiet = not verbose()
    set_quiet(not cfg.get("verbose"))  # finding what is done prints nothing of the jobs themselves
    try:
        rows = plan_rows(plan, cfg)
    finally:
        set_quiet(was_quiet)
    gpu = costs.constants().gpu
    t = Table(title=f"study {cfg.tracking.experiment}: the plan (nothing runs)")
    t.caption = (f"to run, s: store = the phase's median run here x jobs left; CPU, GPU = counted (GPU: one {gpu.name}, "
                 f"{float(gpu.memory_gib):.0f} GiB). GiB: one job's peak (measured here, else counted)")
    staged = any(r["stage"] for r in rows)
    cols = (("stage",) if staged else ()) + ("arm", "phase", "jobs", "done", "to run", "done s", "store s", "CPU s", "CPU GiB",
                                              "GPU s", "GPU GiB")
    for c in cols:
        t.add_column(c, justify="left" if c in ("stage", "arm", "phase") else "right")
    num = lambda v, f="{:.0f}": "—" if v is None else f.format(v)  # noqa: E731
    for i, r in enumerate(rows):
        first = ([r["stage"] if i == 0 or rows[i - 1]["stage"] != r["stage"] else ""] if staged else [])
        if r["note"]:
            t.add_row(*first, r["arm"], r["phase"], "?", "", "", "", r["note"], "", "", "", "")
            continue
        peak = r["peak_gb"] if r["peak_gb"] is not None else r["cpu_peak_gb"]
        gpk = r["gpu_peak_gb"]
        t.add_row(*first, r["arm"], r["phase"], str(r["jobs"]), str(r["done"]), str(r["todo"]), f"{r['done_s']:.0f}", num(r["todo_s"]),
                  num(r["cpu_s"]), num(peak, "{:.2f}") + ("" if r["peak_gb"] is not None or peak is None else " c"),
                  num(r["gpu_s"]), "—" if gpk is None else f"{gpk:.1f}" + (" (over)" if gpk > float(gpu.memory_gib) else ""))
    status.print(t)
    todo = [r for r in rows if not r["note"] and r["todo"]]
    store_s = sum(r["todo_s"] or 0.0 for r in todo)
    cpu_s = sum(r["cpu_s"] or 0.0 for r in todo)
    gpu_s = sum(r["gpu_s"] or 0.0 for r in todo)
    missing = [r["phase"] for r in todo if r["cpu_s"] is None]
    nostore = [r["phase"] for r in todo if r["todo_s"] is None]
    status.print(
        f"{sum(r['todo'] for r in rows)} of {sum(r['jobs'] for r in rows)} jobs to run. Estimated: {store_s / 60:.1f} min from "
        "this store's own runs (median per phase" + (f"; no run yet of: {', '.join(nostore)}" if nostore else "") + "); "
        f"{cpu_s / 3600:.2f} h on this CPU and {gpu_s / 3600:.2f} h on one {gpu.name} from the jobs' FLOP and byte counts "
        "(conf/costs.yaml: the CPU's rates fitted on the real-shape benchmark; the GPU's stated peaks at "
        f"{float(gpu.efficiency):.0%} efficiency, never measured here" + (f"; not counted: {', '.join(missing)}" if missing else "")
        + "). Peak GiB: the largest resident set of one of the phase's done jobs in this store, else the counted peak "
        "of its jobs left (c: the models a job holds at once in float32 times the factor fitted for its kind); GPU: those "
        "models plus 20%.", soft_wrap=True)
    if staged:  # per stage: what is left of it, counted on this CPU (each stage is one launch: stage=<name>)
        for name in dict.fromkeys(r["stage"] for r in rows):
            left = [r for r in rows if r["stage"] == name and not r["note"] and r["todo"]]
            cpu = sum(r["cpu_s"] or 0.0 for r in left)
            unknown = [r["phase"] for r in rows if r["stage"] == name and (r["note"] or (r["todo"] and r["cpu_s"] is None))]
            status.print(f"  stage {name}: {sum(r['todo'] for r in left)} jobs to run, {cpu / 60:.0f} min counted on this CPU"
                         + (f" (not counted: {', '.join(unknown)})" if unknown else ""), soft_wrap=True)
    for why in sorted({w for r in rows for w in r.get("unknown", [])}):
        status.print(escape(f"  not checked for a run (counted as to run): {why}"), soft_wrap=True)
    for why in sorted({w for r in rows for w in r.get("uncounted", [])}):
        status.print(escape(f"  not counted: {why}"), soft_wrap=True)
    for r in rows if cfg.get("verbose") else []:
        for line in r["todo_jobs"]:
            status.print(escape(f"  to run [{r['phase']}]: {line}"), soft_wrap=True)
    return {"plan": rows}


def run_study(cfg: DictConfig, overrides: list[str]) -> dict[str, Any]:
    """Every job of the study, nested under one kind=study run of this launch (MLflow's parent run), then the analysis.
    The study run logs each arm's wall time (``wall_s.<arm>``), printed at the end and shown in the report. A launch
    refused on bad input before any job ran leaves no run (its study run is deleted)."""
    import time

    from mergescope import costs
    from mergescope.analysis import run_analyze
    from mergescope.tracking import PARENT_ENV, Tracker

    plan = Plan(overrides)
    if cfg.get("plan"):
        return show_plan(plan, cfg)
    counted = _stage_count(plan, cfg) if plan.stage is not None else {}
    tracker = Tracker(cfg)
    was_quiet = not verbose()
    set_quiet(not cfg.get("verbose"))  # the jobs' own lines with -v only; the phase bars and the findings always
    started = time.perf_counter()
    previous = os.environ.get(PARENT_ENV)
    parent = None
    with recording() as ledger:
        try:
            stage = {"stage": str(cfg.stage), **counted.pop("tags", {})} if cfg.get("stage") is not None else {}
            name = f"study {cfg.tracking.experiment}" + (f" stage {cfg.stage}" if stage else "")
            with tracker.start(cfg, name, {"kind": "study", "study": cfg.tracking.experiment, "arms": ",".join(plan.arms),
                                           **stage}, overrides) as parent:
                os.environ[PARENT_ENV] = parent.run_id
                peaks: dict[str, float] = {}
                with tracker.finished_index():  # the done-checks from one search of the store as the study found it
                    times = _run_jobs(plan, peaks)
                times["all jobs"] = time.perf_counter() - started
                if counted:  # the report reads the whole study as far as its stages are done
                    ledger_ids = {r.run_id for r in ledger}
                    ledger.extend(_Reused(i) for i in dict.fromkeys(counted.pop("earlier")) if i not in ledger_ids)
                peaks = {k: v for k, v in peaks.items() if k in times}
                peaks["all jobs"] = max(peaks.values(), default=0.0)
                parent.log_metrics({f"wall_s.{k.replace(' ', '_')}": float(v) for k, v in times.items()})
                parent.log_metrics({f"peak_rss_gb.{k.replace(' ', '_')}": float(v) for k, v in peaks.items()})
                parent.log_metrics({"jobs": float(len(ledger)), "jobs_run": float(sum(not r.skipped for r in ledger))})
                if counted:  # a stage: its counted work beside the wall time of the arms it counted, at the rate this
                    arms_counted = counted.pop("counted_arms")  # machine measured now
                    wall = sum(times.get(a, 0.0) for a in arms_counted)
                    counted["stage_counted_wall_s"] = wall
                    counted["stage_uncounted_wall_s"] = sum(v for a, v in times.items() if a not in arms_counted and a != "all jobs")
                    floor = costs.flop_floor_s(counted["stage_counted_gflop"], counted["stage_counted_f64_gflop"],
                                               counted["machine_f32_gflops"], counted["machine_f64_gflops"])
                    counted.update({"stage_wall_over_counted": wall / counted["stage_counted_cpu_s"]
                                    if counted["stage_counted_cpu_s"] > 0 else float("nan"),
                                    "stage_flop_floor_s": floor, "stage_wall_over_floor": wall / floor if floor > 0 else float("nan")})
                    parent.log_metrics(counted)
                _print_times(times, peaks)
                result = run_analyze(cfg, plan.base, job_runs=[r.run_id for r in ledger], timings=times, peaks=peaks)
        except MergescopeError:
            if parent is not None and not any(not r.skipped for r in ledger):
                tracker.client.delete_run(parent.run_id)  # refused before any job ran: no run is left behind
            raise
        finally:
            set_quiet(was_quiet)
            if previous is None:
                os.environ.pop(PARENT_ENV, None)
            else:
                os.environ[PARENT_ENV] = previous
    return result


class _Reused:
    """A run of the study done by an earlier launch (another stage's), as the ledger lists it."""

    def __init__(self, run_id: str):
        self.run_id, self.skipped = run_id, True


def _stage_count(plan: Plan, cfg: DictConfig) -> dict[str, Any]:
    """One pass over the whole study before a stage runs (found exactly as a launch finds its jobs, nothing run): the
    FINISHED runs of every stage's jobs (``earlier``: what the report of the whole study reads besides this launch),
    the counted work of this stage's jobs left (plan=true's counts) and this machine's float32 and float64
    matrix-multiply rates measured now: what the stage's wall time is compared with (``stage_wall_over_counted``: the
    count's accuracy; ``stage_wall_over_floor``: how far the stage runs from the machine's limit, the floor being the
    counted float32 FLOPs at the float32 rate and the fusion's float64 products at the float64 rate). The training a launch does first (the
    zoo models it needs, when missing) is counted with the stage. An arm with a job of the stage that cannot be counted
    before it runs (decided from files an earlier job of the launch makes) is left out of both ratios: ``counted_arms``
    names the arms whose wall time the ratios read."""
    from mergescope import costs
    from mergescope.tracking import Tracker

    sel = plan.stage or {}
    gflop = cpu_s = f64 = 0.0
    n = 0
    was_quiet = not verbose()
    set_quiet(True)
    try:
        # what this launch trains first: the zoo models its stage reads (listed while the stage is set)
        trains = next((of for _, p, of in plan.phases() if p == "training"), list)()
        plan._stage = None  # every phase of the study, the stage's selection applied below
        with Tracker(cfg).finished_index(), recording() as seen:  # every done job's runs, its nested runs included
            phases = [(a, p, (lambda: trains) if p == "training" else of) for a, p, of in plan.phases()]
            uncounted: set[str] = set()  # arms with a stage job decided from files an earlier job makes
            found = _found(phases, {**sel, "training": slice(None)}, uncounted)  # the launch trains what it needs first
        earlier = [r.run_id for r in seen]
        if not any(id(j) in mine for *_, mine, _, todo in found for j in todo):  # the stage is done: nothing to count
            return {"stage_counted_cpu_s": 0.0, "stage_counted_gflop": 0.0, "stage_counted_f64_gflop": 0.0,
                    "stage_jobs_counted": 0.0, "machine_f32_gflops": float("nan"), "machine_f64_gflops": float("nan"),
                    "tags": costs.machine(), "earlier": earlier, "counted_arms": []}
        rates, counter = costs.fit(), costs.Counter(costs.constants())
        counted: set[str] = set()
        for arm, phase, jobs, mine, done, todo in found:
            left = {id(j) for j in todo}
            for j in jobs:  # in order: a forward an earlier job pays is not paid again
                w = costs.count(counter, j.task, j.cfg)
                if id(j) in mine and id(j) in left:
                    if w is None:
                        uncounted.add(arm)
                        continue
                    gflop, cpu_s, n = gflop + w.total_flops / 1e9, cpu_s + costs.cpu_seconds(w, rates), n + 1
                    f64 += w.float64_flops / 1e9
                    counted.add(arm)
    finally:
        plan._stage = sel
        set_quiet(was_quiet)
    return {"stage_counted_cpu_s": cpu_s, "stage_counted_gflop": gflop, "stage_counted_f64_gflop": f64,
            "stage_jobs_counted": float(n), "machine_f32_gflops": costs.matmul_gflops(),
            "machine_f64_gflops": costs.matmul_gflops(dtype="float64"), "tags": costs.machine(), "earlier": earlier,
            "counted_arms": sorted(counted - uncounted)}


def _found(phases, sel: dict[str, slice], unknown: set[str]) -> list[tuple[str, str, list, set, list, list]]:
    """Per phase with jobs: (arm, phase, its jobs, the ids of the stage's own, the done (job, run) pairs, the jobs
    left). A phase of the stage whose jobs cannot be listed yet adds its arm to ``unknown``."""
    out = []
    for arm, phase, of in phases:
        try:
            jobs = of()
        except MergescopeError:  # decided from files a later stage makes (a zoo model not trained yet)
            if phase in sel:
                unknown.add(arm)
            continue
        if jobs:
            done, todo = done_pass(jobs, [])
            if phase == "training":  # as the launch decides (_run_jobs): a model is trained when it is not on disk
                from mergescope.zoo import is_trained

                todo = [j for j in jobs if not is_trained(j.cfg.model.name_or_path)]
            out.append((arm, phase, jobs, {id(j) for j in jobs[sel[phase]]} if phase in sel else set(), done, todo))
    return out


def _print_times(times: dict[str, float], peaks: dict[str, float]) -> None:
    from rich.table import Table

    t = Table(title="wall time per arm (this launch)")
    t.add_column("arm")
    t.add_column("seconds", justify="right")
    t.add_column("peak RSS GiB", justify="right")
    for k, v in times.items():
        t.add_row(k, f"{v:.1f}", f"{peaks[k]:.2f}" if k in peaks else "—")
    status.print(t)


def _run_jobs(plan: Plan, peaks: dict[str, float]) -> dict[str, float]:
    """Training, then every arm's phases in order; returns the wall time in seconds of training and of each arm the
    study runs (skipped jobs included: a cached arm is fast), by the arm's row, and fills
    ``peaks`` with each row's peak resident set in GiB (the largest of this process and its worker processes)."""
    import time

    from mergescope.zoo import is_trained

    from mergescope.memory import peak_gb, reset_peak
    from mergescope.workers import WORKER_PEAKS

    times: dict[str, float] = {}
    t0 = time.perf_counter()
    reset_peak()
    WORKER_PEAKS.clear()

    def lap(name: str) -> None:  # the arm's wall time, and its peak resident set (this process and its workers)
        nonlocal t0
        now = time.perf_counter()
        times[name] = times.get(name, 0.0) + now - t0
        peaks[name] = max(peaks.get(name, 0.0), peak_gb(), *WORKER_PEAKS)
        t0 = now
        reset_peak()
        WORKER_PEAKS.clear()

    trains = plan.training_jobs()
    todo = [j for j in trains if not is_trained(j.cfg.model.name_or_path)]
    for j in todo:
        console.print(f"[bold]training zoo model[/] {model_label(j.cfg.model)}")
    for wave in training_waves(todo):  # a fine-tune of a zoo model trains after its base
        run_all(wave, lambda j, r: f"trained {model_label(j.cfg.model)}", workers_of(plan.cfg), phase="training")
    for j in (j for j in trains if j not in todo):
        j.run()  # returns at once: the model is trained (its run is recorded)
    lap("training")
    # each phase's jobs as plan.phases() lists them: the launch's stage only (all without stage=); a phase outside it
    # or of an arm the study does not run is not even listed (its list may be decided from files this stage never makes)
    listed = {name: of for _, name, of in plan.phases() if name != "training"}
    for arm in arms():
        for p in arm.phases:
            jobs = listed[p.name]()
            if p.run is not None:
                p.run(plan, jobs)
            else:
                run_all(jobs, p.describe, workers_of(plan.cfg) if p.workers else 1, together=p.together, phase=p.name)
        lap(arm.row)
    rows = {a.row for a in arms() if a.name in plan.arms}
    return {k: v for k, v in times.items() if k == "training" or k in rows}
