"""task=study: a study's jobs, listed explicitly and run in-process, then the analysis.

The study overlay's ``hydra.sweeper.params`` is the representation sweep (pairs x metrics); each
of its jobs is composed exactly as ``python launch.py -m`` would compose it. From it the study
lists its other jobs by what they are about, never by filtering another job list:

- models: every distinct model of the study's pairs (train when it is a missing zoo model, quality);
- pairs: every distinct pair (typology; the native job when the pair shares a parameter space;
  transport in both directions);
- checkpoint pairs: all pairs of ``checkpoints.revisions`` of each of ``checkpoints.models``.

Every job is composed from its own override list, and that list is what its run logs, so
``compose(logged overrides)`` gives back the job's config and ``cfg_hash``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from mergescope.cli import handler
from mergescope.config import conf_options, to_plain
from mergescope.errors import MergescopeError, NotConverged, did_you_mean
from mergescope.models import load_config, resolve, step_revisions
from mergescope.native.weights import routes
from mergescope.progress import console
from mergescope.runs import JobResult, model_label, recording
from mergescope.workers import group_by, run_groups


@dataclass
class StudyJob:
    """One job of a study: its config, composed from ``overrides`` (which replay it)."""

    task: str
    overrides: list[str]
    cfg: DictConfig

    def run(self) -> JobResult:
        return handler(self.task)(self.cfg, self.overrides)


def every_metric() -> str:
    """``metric: all`` in a study's sweep: every registered metric plug-in that has its conf/metric YAML, in report
    order (a new metric is in every such sweep with no other edit)."""
    from mergescope.registry import metrics

    have = set(conf_options("metric"))
    return ",".join(e.name for e in metrics.entries() if e.name in have)


def sweep_jobs(params: dict[str, str]) -> list[list[str]]:
    """Cartesian product of the sweeper params, as lists of ``key=value`` overrides (``metric: all`` = every metric)."""
    parser = OverridesParser.create()
    axes = []
    for key, spec in params.items():
        if key == "metric" and str(spec).strip() == "all":
            spec = every_metric()
        ov = parser.parse_override(f"{key}={spec}")
        values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.get_value_element_as_str()]
        axes.append([f"{key}={v}" for v in values])
    return [list(combo) for combo in itertools.product(*axes)]


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def _without(overrides: list[str], *keys: str) -> list[str]:
    return [o for o in overrides if _key(o) not in keys]


def hydra_value(v: Any) -> str:
    """A plain value in Hydra's override grammar (strings quoted, dicts and lists nested)."""
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{hydra_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return "'" + str(v).replace("\\", "\\\\").replace("'", "\\'") + "'"


def job(task: str, overrides: list[str]) -> StudyJob:
    ov = [*_without(overrides, "task"), f"task={task}"]
    return StudyJob(task, ov, compose(config_name="config", overrides=ov, return_hydra_config=False))


def pair_override(a: DictConfig, b: DictConfig) -> list[str]:
    """Overrides that set a pair to two model entries exactly; interpolations such as ``${paths.zoo}`` are
    kept, so the overrides replay on another machine's paths."""
    def value(e: DictConfig) -> str:
        return hydra_value(OmegaConf.to_container(e, resolve=False))

    return ["pair=custom", f"++pair.a={value(a)}", f"++pair.b={value(b)}"]


def model_override(base: list[str], entry: DictConfig) -> list[str]:
    """``model=<name>`` when that config option is this entry, else the entry's values over ``model=custom``."""
    name = str(entry.get("name") or "")
    if name and not entry.get("revision"):
        trial = compose(config_name="config", overrides=[*base, f"model={name}"]) if name in conf_options("model") else None
        if trial is not None and to_plain(trial.model) == to_plain(entry):
            return [f"model={name}"]
    custom = to_plain(compose(config_name="config", overrides=[*base, "model=custom"]).model)
    return ["model=custom", *(f"{'' if k in custom else '+'}model.{k}={hydra_value(v)}" for k, v in to_plain(entry).items())]


ARMS = ("representation", "native", "checkpoints", "transport", "transport_sweep", "shared_space", "adapt")
ARM_NEEDS = {"checkpoints": ("checkpoints.models", lambda c: (c.get("checkpoints") or {}).get("models")),
             "transport_sweep": ("transport_sweep", lambda c: c.get("transport_sweep")),
             "adapt": ("adaptation.pairs", lambda c: (c.get("adaptation") or {}).get("pairs"))}


def study_arms(cfg: DictConfig) -> list[str]:
    """The arms a study runs, named explicitly (``arms: [...]``; the measure sweep's pairs feed every pair arm):
    representation (the measure sweep, quality, typology), native (cross-model pairs that share a parameter space),
    checkpoints, transport (both directions of every pair), transport_sweep, shared_space, adapt. An unknown arm, or
    an arm whose inputs the study does not give, is one line."""
    arms = [str(a) for a in (cfg.get("arms") or [])]
    for a in arms:
        if a not in ARMS:
            raise MergescopeError(f"arms: unknown arm '{a}': {did_you_mean(a, ARMS)}")
    for a in arms:
        if a in ARM_NEEDS and not ARM_NEEDS[a][1](cfg):
            raise MergescopeError(f"arms lists '{a}' but {ARM_NEEDS[a][0]} is empty: set it, or leave the arm out")
    return arms


class Plan:
    """A study's jobs, by what they are about."""

    def __init__(self, overrides: list[str]):
        study_cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
        params = OmegaConf.to_container(study_cfg.hydra.sweeper.params, resolve=False) or {}
        if not params:
            raise MergescopeError("this study defines no sweep (hydra.sweeper.params); pick one with study=<name>")
        self.cfg = compose(config_name="config", overrides=overrides)
        self.arms = study_arms(self.cfg)
        self.base = _without(overrides, "task")
        self.measures = [StudyJob("measure", ov, compose(config_name="config", overrides=ov))
                         for ov in (self.base + combo for combo in sweep_jobs(params))]
        self.pairs: dict[str, list[str]] = {}  # pair label -> the overrides that select the pair
        self.entries: dict[str, DictConfig] = {}  # model label -> entry, first-seen order
        for m in self.measures:
            c = m.cfg
            label = f"{model_label(c.pair.a)}__{model_label(c.pair.b)}"
            self.pairs.setdefault(label, [o for o in _without(m.overrides, "task", "metric") if o not in self.base])
            for side in ("a", "b"):
                self.entries.setdefault(model_label(c.pair[side]), c.pair[side])
        for names in (self.cfg.get("adaptation") or {}).get("pairs") or []:  # the adapt arm's models are trained (and
            for name in names:                                                # scored) like the sweep's
                e = compose(config_name="config", overrides=[*self.base, f"model={name}"]).model
                self.entries.setdefault(model_label(e), e)

    def pair_jobs(self, task: str, extra: list[str] = ()) -> list[StudyJob]:
        return [job(task, [*self.base, *sel, *extra]) for sel in self.pairs.values()]

    def model_jobs(self, task: str) -> list[StudyJob]:
        return [job(task, [*self.base, *model_override(self.base, e), *train_steps(task, e)]) for e in self.entries.values()]

    def shared_jobs(self) -> list[StudyJob]:
        """The shared-space arm (``arms: [shared_space]``): per probe set (``shared.data_sets``), agreement on every
        pair at every depth and one shared-space job over ``shared.models``; routing on the first probe set."""
        s = self.cfg.shared
        if "shared_space" not in self.arms:
            return []
        out = []
        for k, data in enumerate(s.data_sets):
            out += self.pair_jobs("agreement", [f"data={data}"])
            out += [job(t, [*self.base, f"data={data}"]) for t in (["shared_space", "routing"] if k == 0 else ["shared_space"])]
        return out

    def native_pairs(self) -> list[StudyJob]:
        """The study's pairs that share a parameter space (decided from each model's config.json)."""
        out = []
        for j in self.pair_jobs("native"):
            if routes(load_config(resolve(j.cfg.pair.a)), load_config(resolve(j.cfg.pair.b)))["native"]["defined"]:
                out.append(j)
        return out

    def checkpoint_pairs(self) -> list[StudyJob]:
        """Every pair of the listed revisions of each listed model (``checkpoints.per_model`` overrides the
        shared ``checkpoints.revisions`` per model; ``all`` = every stepN revision the model has)."""
        ck = self.cfg.get("checkpoints") or {}
        out = []
        if "checkpoints" not in self.arms:
            return out
        for m in ck.get("models") or []:
            model = compose(config_name="config", overrides=[*self.base, f"model={m}"]).model
            entry = OmegaConf.to_container(model)
            for ra, rb in itertools.combinations(checkpoint_revisions(ck, str(m), model), 2):
                a, b = OmegaConf.create({**entry, "revision": ra}), OmegaConf.create({**entry, "revision": rb})
                out.append(job("native", [*self.base, *pair_override(a, b)]))
        return out

    def transport_directions(self) -> list[StudyJob]:
        """Both directions (target <- donor) of every pair: merge.target=a, then b."""
        user_merge = any(_key(o) == "merge" for o in self.base)
        out = []
        for sel in self.pairs.values():
            for target in ("a", "b"):
                extra = [*([] if user_merge else ["merge=transport"]), f"merge.target={target}"]
                out.append(job("transport", [*self.base, *sel, *extra]))
        return out

    def transport_sweep(self) -> list[StudyJob]:
        """``transport_sweep`` (a calibration study): the first ``directions`` transport directions (all when unset),
        once per entry of ``settings`` (each a list of overrides, e.g. ``[merge.epsilon=0.003]``)."""
        sw = self.cfg.get("transport_sweep")
        if not sw or "transport_sweep" not in self.arms:
            return []
        dirs = self.transport_directions()
        dirs = dirs[: int(sw.directions)] if sw.get("directions") else dirs
        return [job("transport", [*j.overrides, *(str(o) for o in extra)]) for extra in sw.settings for j in dirs]

    def adapt_jobs(self) -> list[StudyJob]:
        """The dimensional-adaptation arm: for every ``[small, large]`` of ``adaptation.pairs``, union (adapt=expand)
        and intersection (adapt=truncate)."""
        out = []
        if "adapt" not in self.arms:
            return out
        for small, large in (self.cfg.get("adaptation") or {}).get("pairs") or []:
            a, b = (compose(config_name="config", overrides=[*self.base, f"model={m}"]).model for m in (small, large))
            extra = (self.cfg.adaptation.get("operator_overrides") or {})
            out += [job("adapt", [*self.base, *pair_override(a, b), f"adapt={op}", *(str(o) for o in extra.get(op) or [])])
                    for op in ("expand", "truncate")]
        return out


def train_steps(task: str, entry: DictConfig) -> list[str]:
    """A zoo model that trains for its own number of steps (``train_steps``: the slow Mamba reference path)."""
    return [f"train.steps={int(entry.train_steps)}"] if task == "train" and entry.get("train_steps") else []


def checkpoint_revisions(ck: DictConfig, name: str, model: DictConfig) -> list[str]:
    """The revisions of one model in the checkpoint arm, in step order."""
    spec = (ck.get("per_model") or {}).get(name, ck.get("revisions") or [])
    if isinstance(spec, str):
        if spec != "all":
            raise MergescopeError(f"checkpoints.per_model.{name}={spec!r}: give a list of revisions or 'all'")
        return step_revisions(resolve(model))
    return [str(r) for r in spec]


def _done(r: JobResult) -> str:
    return " (done before)" if r.skipped else ""


def _run_all(jobs: list[StudyJob], describe, workers: int = 1, together=None) -> list[tuple[StudyJob, JobResult]]:
    """Run ``jobs`` in order, printing each; with ``workers`` > 1 on that many processes (``mergescope.workers``),
    jobs of equal ``together(job)`` one after another in one of them."""
    out = []
    if workers > 1 and len(jobs) > 1:
        groups = group_by(jobs, together)
        jobs = [j for g in groups for j in g]
        results = (r for rs in run_groups(groups, workers) for r in rs)
    else:
        results = (j.run() for j in jobs)
    for i, (j, r) in enumerate(zip(jobs, results), 1):
        console.print(f"[{i}/{len(jobs)}] {describe(j, r)}{_done(r)}")
        out.append((j, r))
    return out


def _run_sweep(jobs: list[StudyJob]) -> None:
    """The transport setting sweep (epsilon calibration, probe count). A setting whose plans do not converge is a
    result of the sweep, not a reason to stop it: its run is FAILED with the reason (tag ``error``), the report's
    calibration section counts it, and the sweep goes on."""
    for i, j in enumerate(jobs, 1):
        try:
            r = j.run()
        except NotConverged as exc:
            console.print(f"[{i}/{len(jobs)}] [yellow]transport setting did not converge[/]: {str(exc)[:200]}")
            _record_failure(j, exc)
            continue
        console.print(f"[{i}/{len(jobs)}] {_transport_text(j, r)}{_done(r)}")


def _record_failure(j: StudyJob, exc: Exception) -> None:
    """A FAILED kind=transport run for a setting whose plans did not converge (they fail before the job's own runs
    exist): its config (merge.epsilon ...) as params, the reason as tag ``error``, for the calibration section."""
    from mergescope.tracking import Tracker

    target = str(j.cfg.merge.target)
    donor = "b" if target == "a" else "a"
    tags = {"kind": "transport", "target": model_label(j.cfg.pair[target]), "donor": model_label(j.cfg.pair[donor]),
            "outcome": NotConverged.outcome}
    try:
        with Tracker(j.cfg).start(j.cfg, f"transport {tags['target']} <- {tags['donor']} (did not converge)", tags, j.overrides):
            raise exc
    except MergescopeError:
        pass


def parallel_workers(plan: Plan) -> int:
    """``workers``: processes for the study's heavy independent jobs (zoo training, the checkpoint arm, transport
    directions); everything else runs in-process, in order (it shares the caches the earlier jobs fill)."""
    return max(1, int(plan.cfg.get("workers") or 1))


def _target(j: StudyJob) -> str:
    return model_label(j.cfg.pair[str(j.cfg.merge.target)])


def _pair_text(j: StudyJob) -> str:
    return f"{model_label(j.cfg.pair.a)} x {model_label(j.cfg.pair.b)}"


def _transport_text(j: StudyJob, r: JobResult) -> str:
    t, d = (j.cfg.pair.a, j.cfg.pair.b) if str(j.cfg.merge.target) == "a" else (j.cfg.pair.b, j.cfg.pair.a)
    deltas = ", ".join(f"a={k.split('@')[1]}: {v:+.4f}" for k, v in r.metrics.items() if k.startswith("delta_target_lang@"))
    return f"transport {model_label(t)} <- {model_label(d)}: delta target {deltas}"


def _checkpoint_arm(plan: Plan) -> None:
    """The checkpoint pairs, model by model; with ``checkpoints.evict_after`` each hub model's revisions are
    deleted from the local hub cache once all its pairs are FINISHED (a zoo folder is never touched)."""
    by_model: dict[str, list[StudyJob]] = {}
    for j in plan.checkpoint_pairs():
        by_model.setdefault(str(j.cfg.pair.a.name_or_path), []).append(j)
    for jobs in by_model.values():
        _run_all(jobs, lambda j, r: f"checkpoint pair {_pair_text(j)}: barrier={r.metrics.get('lmc_barrier', float('nan')):.3f}",
                 parallel_workers(plan))
        if (plan.cfg.get("checkpoints") or {}).get("evict_after"):
            evict_checkpoints(jobs)


def evict_checkpoints(jobs: list[StudyJob]) -> dict[str, int]:
    """Delete the revisions these (FINISHED) checkpoint jobs read from the local hub cache; print what was freed."""
    from mergescope.hub import evict_revisions

    ref = resolve(jobs[0].cfg.pair.a)
    if ref.local:
        return {}
    revs = sorted({str(j.cfg.pair[s].revision) for j in jobs for s in ("a", "b")} | {str(jobs[0].cfg.native.base or "main")} - {"main", "None"})
    freed = evict_revisions(ref.location, revs)
    console.print(f"[bold]evicted[/] {len(freed)} revisions of {ref.location} from the hub cache: "
                  f"{sum(freed.values()) / 2**30:.2f} GiB freed ({', '.join(sorted(freed)) or 'none cached'})")
    return freed


def run_study(cfg: DictConfig, overrides: list[str]) -> dict[str, Any]:
    from mergescope.analysis import run_analyze

    plan = Plan(overrides)
    with recording() as ledger:
        _run_jobs(plan)
    return run_analyze(cfg, plan.base, job_runs=[r.run_id for r in ledger])  # tables, figures and the report, from MLflow


def _run_jobs(plan: Plan) -> None:
    from mergescope.zoo import is_trained

    trains = [j for j in plan.model_jobs("train") if j.cfg.model.get("zoo") is not None]
    todo = [j for j in trains if not is_trained(j.cfg.model.name_or_path)]
    for j in todo:
        console.print(f"[bold]training zoo model[/] {model_label(j.cfg.model)}")
    _run_all(todo, lambda j, r: f"trained {model_label(j.cfg.model)}", parallel_workers(plan))
    for j in (j for j in trains if j not in todo):
        j.run()  # returns at once: the model is trained (its run is recorded)
    rep = "representation" in plan.arms
    _run_all(plan.model_jobs("quality") if rep else [], lambda j, r: f"quality {model_label(j.cfg.model)}: nll={r.metrics.get('nll', float('nan')):.4f}")
    _run_all(plan.measures if rep else [], lambda j, r: f"{j.cfg.metric.name} {_pair_text(j)}")
    _run_all(plan.pair_jobs("typology") if rep else [], lambda j, r: f"typology {_pair_text(j)}")
    _run_all(plan.native_pairs() if "native" in plan.arms else [], lambda j, r: f"native pair {_pair_text(j)}")
    _checkpoint_arm(plan)
    _run_all(plan.transport_directions() if "transport" in plan.arms else [], _transport_text, parallel_workers(plan),
             together=_target)  # one target's directions in one worker: its no-fusion baseline is made once
    _run_sweep(plan.transport_sweep())
    _run_all(plan.shared_jobs(), lambda j, r: f"{j.task} {_pair_text(j) if j.task == 'agreement' else 'all models'} on {j.cfg.data.name}")
    _run_all(plan.adapt_jobs(), lambda j, r: f"adapt {j.cfg.adapt.name} {_pair_text(j)}: best ratio {r.metrics.get('best_ratio', float('nan')):g}")
