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

import copy
import hashlib
import itertools
from collections.abc import Callable, Mapping
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from mergescope.cli import handler
from mergescope.config import check_finite, conf_digest, conf_options, redact, to_plain
from mergescope.errors import MergescopeError, NotConverged, did_you_mean
from mergescope.models import load_config, resolve, step_revisions
from mergescope.native.settings import CheckpointSettings
from mergescope.native.weights import routes
from mergescope.progress import console, phase_bar, set_quiet, status, verbose
from mergescope.runs import JOB_PEAK, JobResult, model_label, recording
from mergescope.sweep import every_metric, every_pair
from mergescope.workers import group_by, run_groups


@dataclass
class StudyJob:
    """One job of a study: its config, composed from ``overrides`` (which replay it)."""

    task: str
    overrides: list[str]
    cfg: DictConfig

    def run(self) -> JobResult:
        check_finite(self.cfg)  # the study's check of every job before any runs: a NaN setting of one job refused
        return handler(self.task)(self.cfg, self.overrides)


def sweep_jobs(params: dict[str, str], models: list[str] | None = None) -> list[list[str]]:
    """Cartesian product of the sweeper params, as lists of ``key=value`` overrides (``metric: all`` = every metric,
    ``pair: all`` = every pair of the study's ``models``)."""
    parser = OverridesParser.create()
    axes = []
    for key, spec in params.items():
        if key == "metric" and str(spec).strip() == "all":
            spec = every_metric()
        if key == "pair" and str(spec).strip() == "all":
            spec = every_pair([str(m) for m in models or []])
        ov = parser.parse_override(f"{key}={spec}")
        values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.get_value_element_as_str()]
        axes.append([f"{key}={v}" for v in values])
    return [list(combo) for combo in itertools.product(*axes)]


def with_languages(cfg: DictConfig, combo: list[str], one: str | None = None) -> list[str]:
    """A sweep job's overrides with each side's language set: ``one`` (the one-language protocol: both sides on it,
    tagged ``protocol=one_language``), else the study's ``languages`` (conf/model name -> language: the spec's
    protocol, each model on its own side) for the models it names; unchanged when neither applies."""
    langs = {str(k): str(v) for k, v in (cfg.get("languages") or {}).items()}
    pair = next((o.split("=", 1)[1] for o in combo if _key(o) == "pair"), None)
    if pair is None or "__" not in pair or not (langs or one):
        return list(combo)
    unknown = sorted(set(langs) - set(map(str, cfg.get("models") or langs)))
    if unknown:
        raise MergescopeError(f"languages names {unknown[0]!r}, not one of the study's models: "
                              f"{did_you_mean(unknown[0], [str(m) for m in cfg.get('models') or []])}")
    out = list(combo)
    for side, name in zip(("a", "b"), pair.split("__", 1)):
        lang = one or langs.get(name)
        if lang:
            out.append(f"pair.{side}.lang={lang}")
    return out + (["+tags.protocol=one_language"] if one else [])


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


_COMPOSE_CACHE: list[Path] = []  # the study's compose cache folder (set by Plan from its paths.cache)


def composed(overrides: list[str]) -> DictConfig:
    """``compose(config_name="config", overrides=...)``, cached on disk by (conf/ digest, overrides, Hydra and
    OmegaConf versions): a study composes one config per job (~0.3 s each, 166 in the default study), and a cached
    relaunch needs them only to decide that every job is done. The entry is the unresolved config as JSON
    (interpolations kept, so it is independent of the machine's paths; JSON keeps every value's type and reads in
    about 60% of the time of OmegaConf's YAML), checksummed (``mergescope.integrity``), struct mode restored. A
    config with a secret (an override or a value that ``config.redact`` would replace) is never cached: composed each
    time."""
    import hydra
    import omegaconf

    from mergescope import integrity

    if not _COMPOSE_CACHE or redact(list(overrides)) != list(overrides):  # a secret is never written to the cache
        return compose(config_name="config", overrides=list(overrides))
    key = hashlib.sha256(json.dumps([conf_digest(), list(overrides), hydra.__version__, omegaconf.__version__]).encode()).hexdigest()
    path = _COMPOSE_CACHE[0] / f"{key}.json"
    blob = integrity.read_entry(path)
    if blob is not None:
        return _from_template(json.loads(blob.decode("utf-8")))
    cfg = compose(config_name="config", overrides=list(overrides))
    plain = OmegaConf.to_container(cfg, resolve=False)
    if redact(plain) != plain:  # a secret from a conf/ file: composed each time, never written
        return cfg
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        integrity.write_entry(path, json.dumps(plain).encode("utf-8"))
    except OSError:  # an unwritable cache only costs time
        pass
    return cfg


_TEMPLATE: list[tuple[DictConfig, dict]] = []  # the first cached config of this process, and its sections as JSON


def _from_template(plain: dict) -> DictConfig:
    """``OmegaConf.create(plain)`` in struct mode, built as a copy of the process's first cached config with only the
    top-level sections that differ replaced (the study's job configs differ in a few of their ~20 sections: a copy
    and those sections take about half the time of a config built node by node); the same config
    (tests/test_relaunch.py)."""
    text = {k: json.dumps(v, sort_keys=True) for k, v in plain.items()}  # 1, 1.0 and true differ here, not under ==
    if not _TEMPLATE or list(_TEMPLATE[0][1]) != list(plain):
        cfg = OmegaConf.create(plain)
        OmegaConf.set_struct(cfg, True)
        if not _TEMPLATE:
            _TEMPLATE.append((copy.deepcopy(cfg), text))
        return cfg
    base, base_text = _TEMPLATE[0]
    cfg = copy.deepcopy(base)
    for k, v in plain.items():  # the same keys in the same order: struct mode allows the assignments
        if text[k] != base_text[k]:
            cfg[k] = v
    return cfg


def job(task: str, overrides: list[str]) -> StudyJob:
    ov = [*_without(overrides, "task"), f"task={task}"]
    return StudyJob(task, ov, composed(ov))


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
        trial = composed([*base, f"model={name}"]) if name in conf_options("model") else None
        if trial is not None and to_plain(trial.model) == to_plain(entry):
            return [f"model={name}"]
    custom = to_plain(composed([*base, "model=custom"]).model)
    return ["model=custom", *(f"{'' if k in custom else '+'}model.{k}={hydra_value(v)}" for k, v in to_plain(entry).items())]


ARMS = ("representation", "native", "checkpoints", "transport", "transport_sweep", "shared_space", "adapt", "expansion")
ARM_NEEDS = {"checkpoints": ("checkpoints.models", lambda c: (c.get("checkpoints") or {}).get("models")),
             "transport_sweep": ("transport_sweep", lambda c: c.get("transport_sweep")),
             "adapt": ("adaptation.pairs", lambda c: (c.get("adaptation") or {}).get("pairs")),
             "expansion": ("expansion.models or expansion.targets",
                           lambda c: (c.get("expansion") or {}).get("models") and (c.get("expansion") or {}).get("targets"))}


def study_arms(cfg: DictConfig) -> list[str]:
    """The arms a study runs, named explicitly (``arms: [...]``; the measure sweep's pairs feed every pair arm):
    representation (the measure sweep, quality, typology), native (cross-model pairs that share a parameter space),
    checkpoints, transport (both directions of every pair), transport_sweep, shared_space, adapt, expansion. An unknown arm, or
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
        _COMPOSE_CACHE[:] = [Path(str(self.cfg.paths.cache)) / "compose"]
        self.arms = study_arms(self.cfg)
        self.base = _without(overrides, "task")
        combos = sweep_jobs(params, list(self.cfg.get("models") or []))
        self.measures = [StudyJob("measure", ov, composed(ov)) for ov in (self.base + with_languages(self.cfg, c) for c in combos)]
        self.pairs: dict[str, list[str]] = {}  # pair label -> the overrides that select the pair
        self.entries: dict[str, DictConfig] = {}  # model label -> entry, first-seen order
        for m in self.measures:
            c = m.cfg
            label = f"{model_label(c.pair.a)}__{model_label(c.pair.b)}"
            self.pairs.setdefault(label, [o for o in _without(m.overrides, "task", "metric") if o not in self.base])
            for side in ("a", "b"):
                self.entries.setdefault(model_label(c.pair[side]), c.pair[side])
        one = self.cfg.get("one_language")  # the second protocol: every side of the sweep on one language, tagged
        self.measures += [StudyJob("measure", ov, composed(ov)) for ov in
                          (self.base + with_languages(self.cfg, c, one) for c in combos)] if one else []
        for names in (self.cfg.get("adaptation") or {}).get("pairs") or []:  # the adapt arm's models are trained (and
            for name in names:                                                # scored) like the sweep's
                e = composed([*self.base, f"model={name}"]).model
                self.entries.setdefault(model_label(e), e)
        for name in (self.cfg.get("expansion") or {}).get("models") or [] if "expansion" in self.arms else []:
            e = composed([*self.base, f"model={name}"]).model  # the expansion check's models, trained when missing
            self.entries.setdefault(model_label(e), e)
        self.native_only: dict[str, list[str]] = {}  # native_pairs outside the sweep (a family of its own): pair=<name>
        for name in map(str, self.cfg.get("native_pairs") or []):
            if name in self.pairs:
                continue
            try:
                c = composed([*self.base, f"pair={name}"])
            except Exception:  # noqa: BLE001 - Hydra's missing-option errors: refused in one line below
                raise MergescopeError(f"native_pairs names {name!r}, not a pair of this study nor two conf/model names a__b: "
                                      f"{did_you_mean(name, list(self.pairs))}") from None
            self.native_only[name] = [f"pair={name}"]
            for side in ("a", "b"):  # trained when missing (a fine-tune of a real model), scored like the sweep's
                self.entries.setdefault(model_label(c.pair[side]), c.pair[side])
        if "shared_space" in self.arms:  # and so are the shared space's models (study=real: the real model beside the
            for name in self.cfg.shared.models:  # English toy family, which its sweep does not otherwise train)
                e = composed([*self.base, f"model={name}"]).model
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
        """The study's pairs that share a parameter space (decided from each model's config.json); ``native_pairs``
        (pair names ``a__b``) keeps only those."""
        keep = None if self.cfg.get("native_pairs") is None else set(map(str, self.cfg.native_pairs))
        out = []
        sels = {**self.pairs, **self.native_only}
        for label, sel in sels.items():
            if keep is not None and label not in keep:
                continue
            j = job("native", [*self.base, *sel])
            if routes(load_config(resolve(j.cfg.pair.a)), load_config(resolve(j.cfg.pair.b)))["native"]["defined"]:
                out.append(j)
        return out

    def checkpoint_pairs(self) -> list[StudyJob]:
        """Every pair of the listed revisions of each listed model (``checkpoints.per_model`` overrides the
        shared ``checkpoints.revisions`` per model; ``all`` = every stepN revision the model has)."""
        out = []
        if "checkpoints" not in self.arms:
            return out
        ck = CheckpointSettings.from_cfg(self.cfg)
        for m in ck.models:
            model = composed([*self.base, f"model={m}"]).model
            entry = OmegaConf.to_container(model)
            for ra, rb in itertools.combinations(checkpoint_revisions(ck, m, model), 2):
                a, b = OmegaConf.create({**entry, "revision": ra}), OmegaConf.create({**entry, "revision": rb})
                out.append(job("native", [*self.base, *pair_override(a, b), *ck.overrides]))
        return out

    def transport_directions(self) -> list[StudyJob]:
        """Both directions (target <- donor) of every pair, merge.target=a then b; with ``transport_directions``, only
        the ones it names ("target<-donor"), in its order."""
        return list(self.named_directions().values())

    def named_directions(self) -> dict[str, StudyJob]:
        """:meth:`transport_directions` by name ("target<-donor")."""
        user_merge = any(_key(o) == "merge" for o in self.base)
        out: dict[str, StudyJob] = {}
        for label, sel in self.pairs.items():
            a, b = label.split("__", 1)
            for target, name in (("a", f"{a}<-{b}"), ("b", f"{b}<-{a}")):
                extra = [*([] if user_merge else ["merge=transport"]), f"merge.target={target}"]
                out[name] = job("transport", [*self.base, *sel, *extra])
        keep = self.cfg.get("transport_directions")
        if keep is None:
            return out
        unknown = [str(d) for d in keep if str(d).replace(" ", "") not in out]
        if unknown:
            raise MergescopeError(f"transport_directions names {unknown[0]!r}, not a direction (target<-donor) of this "
                                  f"study's pairs: {did_you_mean(unknown[0].replace(' ', ''), list(out))}")
        return {str(d).replace(" ", ""): out[str(d).replace(" ", "")] for d in keep}  # listed order (transport_sweep: the first N)

    def transport_sweep(self) -> list[StudyJob]:
        """``transport_sweep`` (a calibration study): the first ``directions`` transport directions (all when unset),
        once per entry of ``settings``, in the listed order. An entry is a list of overrides (e.g.
        ``[merge.epsilon=0.003]``: on every swept direction) or a mapping ``{overrides: [...], directions: [...]}`` whose
        ``directions`` names the transport directions (target<-donor) it runs on, the swept ones or not."""
        sw = self.cfg.get("transport_sweep")
        if not sw or "transport_sweep" not in self.arms:
            return []
        names = self.named_directions()
        every = list(names.values())
        swept = every[: int(sw.directions)] if sw.get("directions") else every
        out = []
        for i, entry in enumerate(sw.settings):
            if isinstance(entry, Mapping):
                bad = [k for k in entry if k not in ("overrides", "directions")]
                if bad or "overrides" not in entry:
                    raise MergescopeError(f"transport_sweep.settings[{i}]: a mapping takes overrides (a list) and directions "
                                          f"(target<-donor names){f', not {bad[0]!r}' if bad else ''}")
                dirs = swept
                if entry.get("directions") is not None:
                    want = [str(d).replace(" ", "") for d in entry.directions]
                    unknown = [d for d in want if d not in names]
                    if unknown:
                        raise MergescopeError(f"transport_sweep.settings[{i}].directions names {unknown[0]!r}, not a transport "
                                              f"direction of this study: {did_you_mean(unknown[0], list(names))}")
                    dirs = [names[d] for d in want]
                extra = entry.overrides
            else:
                dirs, extra = swept, entry
            out += [job("transport", [*j.overrides, *(str(o) for o in extra)]) for j in dirs]
        return out

    def adapt_jobs(self) -> list[StudyJob]:
        """The dimensional-adaptation arm: for every ``[small, large]`` of ``adaptation.pairs``, union (adapt=expand)
        and intersection (adapt=truncate)."""
        out = []
        if "adapt" not in self.arms:
            return out
        ops = [str(o) for o in (self.cfg.adaptation.get("operators") or ["expand", "truncate"])]
        bad = [o for o in ops if o not in ("expand", "truncate")]
        if bad:
            raise MergescopeError(f"adaptation.operators: unknown operator {bad[0]!r}: choose from expand (union), truncate (intersection)")
        for small, large in (self.cfg.get("adaptation") or {}).get("pairs") or []:
            a, b = (composed([*self.base, f"model={m}"]).model for m in (small, large))
            extra = (self.cfg.adaptation.get("operator_overrides") or {})
            out += [job("adapt", [*self.base, *pair_override(a, b), f"adapt={op}", *(str(o) for o in extra.get(op) or [])])
                    for op in ops]
        return out

    def phases(self) -> list[tuple[str, str, Callable[[], list[StudyJob]]]]:
        """(arm, phase, its jobs when asked) in the order the study runs them: what ``plan=true`` lists and
        :func:`_run_jobs` runs (the same lists). Lazy: which pairs share a parameter space is read from the models'
        configs, which exist only once the zoo models are trained."""
        rep = "representation" in self.arms
        return [("training", "training", lambda: [j for j in self.model_jobs("train") if j.cfg.model.get("zoo") is not None]),
                ("representation", "quality", lambda: self.model_jobs("quality") if rep else []),
                ("representation", "measure", lambda: self.measures if rep else []),
                ("representation", "typology", lambda: self.pair_jobs("typology") if rep else []),
                ("native", "native", lambda: self.native_pairs() if "native" in self.arms else []),
                ("checkpoints", "checkpoints", self.checkpoint_pairs),
                ("transport", "transport", lambda: self.transport_directions() if "transport" in self.arms else []),
                ("transport", "transport settings", self.transport_sweep),
                ("shared_space", "shared space", self.shared_jobs),
                ("adapt", "adapt", self.adapt_jobs),
                ("expansion", "expansion", self.expansion_jobs)]

    def expansion_jobs(self) -> list[StudyJob]:
        """The function check of dimensional adaptation: every model of ``expansion.models`` against every target of
        ``expansion.targets`` (task=expansion)."""
        if "expansion" not in self.arms:
            return []
        ex = self.cfg.expansion
        return [job("expansion", [*self.base, f"model={m}", f"expansion.target={hydra_value(to_plain(t))}"])
                for m in ex.models for t in ex.targets]


def train_steps(task: str, entry: DictConfig) -> list[str]:
    """A zoo model that trains for its own number of steps (``train_steps``: the slow Mamba reference path)."""
    return [f"train.steps={int(entry.train_steps)}"] if task == "train" and entry.get("train_steps") else []


def checkpoint_revisions(ck: CheckpointSettings, name: str, model: DictConfig) -> list[str]:
    """The revisions of one model in the checkpoint arm, in step order (``all``: every stepN revision it has)."""
    spec = ck.revisions_of(name)
    return step_revisions(resolve(model)) if spec == "all" else spec


def _done(r: JobResult) -> str:
    return " (done before)" if r.skipped else ""


def _run_all(jobs: list[StudyJob], describe, workers: int = 1, together=None,
             phase: str = "jobs") -> list[tuple[StudyJob, JobResult]]:
    """Run ``jobs`` in order under one progress bar (``phase``, with its ETA and what it last did; each job's line
    too with ``-v``); with ``workers`` > 1 on that many processes (``mergescope.workers``), jobs of equal
    ``together(job)`` one after another in one of them."""
    out: list[tuple[StudyJob, JobResult]] = []
    if not jobs:
        return out
    with phase_bar() as pb:
        bar_id = pb.add_task(phase, total=len(jobs), note="")
        counts = {"run": 0, "reused": 0}

        def step(j: StudyJob, r: JobResult) -> None:
            text = describe(j, r)
            console.print(f"[{len(out) + 1}/{len(jobs)}] {text}{_done(r)}", soft_wrap=True)
            out.append((j, r))
            counts["reused" if r.skipped else "run"] += 1
            last = text if len(text) <= 70 else text[:69] + "…"
            pb.update(bar_id, advance=1, note=f"{counts['run']} run, {counts['reused']} reused" +
                      ("" if len(out) == len(jobs) else f"; {last}"))

        if workers > 1 and len(jobs) > 1:
            done, todo = _done_pass(jobs)  # worker processes only for what is left to run (none on a cached relaunch)
            for j, r in done:
                step(j, r)
            if len(todo) > 1:
                groups = group_by(todo, together)
                todo = [j for g in groups for j in g]
                results = (r for rs in run_groups(groups, workers) for r in rs)
            else:
                results = (j.run() for j in todo)
        else:
            todo, results = jobs, (j.run() for j in jobs)
        for j, r in zip(todo, results):
            step(j, r)
    return out


def _done_pass(jobs: list[StudyJob], unknown: list[tuple[StudyJob, str]] | None = None
               ) -> tuple[list[tuple[StudyJob, JobResult]], list[StudyJob]]:
    """Each job run in-process under ``runs.only_if_done``: the done ones return their FINISHED runs, the others stop
    before any work (``WouldRun``) and are returned to be run. With ``unknown`` (plan=true), a job whose check itself
    fails in one line (its weights not downloaded yet, a hub that cannot be reached) is one to run, its reason noted."""
    from mergescope.runs import WouldRun, only_if_done

    done, todo = [], []
    with only_if_done():
        for j in jobs:
            try:
                done.append((j, j.run()))
            except WouldRun:
                todo.append(j)
            except MergescopeError as exc:
                if unknown is None:
                    raise
                todo.append(j)
                unknown.append((j, str(exc)))
    return done, todo


def _run_sweep(jobs: list[StudyJob]) -> None:
    """The transport setting sweep (epsilon calibration, probe count). A setting whose plans do not converge is a
    result of the sweep, not a reason to stop it: its run is FAILED with the reason (tag ``error``), the report's
    calibration section counts it, and the sweep goes on."""
    if not jobs:
        return
    with phase_bar() as pb:
        bar_id = pb.add_task("transport settings", total=len(jobs), note="")
        for i, j in enumerate(jobs, 1):
            try:
                r = j.run()
            except NotConverged as exc:
                status.print(f"[{i}/{len(jobs)}] [yellow]transport setting did not converge[/]: {str(exc)[:200]}")
                _record_failure(j, exc)
                pb.update(bar_id, advance=1)
                continue
            console.print(f"[{i}/{len(jobs)}] {_transport_text(j, r)}{_done(r)}")
            pb.update(bar_id, advance=1)


def _record_failure(j: StudyJob, exc: Exception) -> None:
    """A FAILED kind=transport run for a setting whose plans did not converge (they fail before the job's own runs
    exist): its config (merge.epsilon ...) as params, the reason as tag ``error``, for the calibration section."""
    from mergescope.tracking import Tracker

    target = str(j.cfg.merge.target)
    donor = "b" if target == "a" else "a"
    tags = {"kind": "transport", "target": model_label(j.cfg.pair[target]), "donor": model_label(j.cfg.pair[donor]),
            "outcome": NotConverged.outcome}
    Tracker(j.cfg).record_failed(j.cfg, f"transport {tags['target']} <- {tags['donor']} (did not converge)", tags, j.overrides, exc)


def parallel_workers(plan: Plan) -> int:
    """``workers``: processes for the study's heavy independent jobs (zoo training, the checkpoint arm, transport
    directions, the shared-space arm, the adapt arm's operators); everything else runs in-process, in order (it shares
    the caches the earlier jobs fill)."""
    return max(1, int(plan.cfg.get("workers") or 1))


def _target(j: StudyJob) -> str:
    return model_label(j.cfg.pair[str(j.cfg.merge.target)])


def _pair_text(j: StudyJob) -> str:
    return f"{model_label(j.cfg.pair.a)} x {model_label(j.cfg.pair.b)}"


def _transport_text(j: StudyJob, r: JobResult) -> str:
    t, d = (j.cfg.pair.a, j.cfg.pair.b) if str(j.cfg.merge.target) == "a" else (j.cfg.pair.b, j.cfg.pair.a)
    deltas = ", ".join(f"a={k.split('@')[1]}: {v:+.4f}" for k, v in r.metrics.items() if k.startswith("delta_target_lang@"))
    return f"transport {model_label(t)} <- {model_label(d)}: delta target {deltas}"


def _checkpoint_arm(plan: Plan, jobs: list[StudyJob]) -> None:
    """The checkpoint pairs, model by model; with ``checkpoints.evict_after`` each hub model's revisions are
    deleted from the local hub cache once all its pairs are FINISHED (a zoo folder is never touched)."""
    by_model: dict[str, list[StudyJob]] = {}
    for j in jobs:
        by_model.setdefault(str(j.cfg.pair.a.name_or_path), []).append(j)
    evict = CheckpointSettings.from_cfg(plan.cfg).evict_after
    for jobs in by_model.values():
        _run_all(jobs, lambda j, r: f"checkpoint pair {_pair_text(j)}: barrier={r.metrics.get('lmc_barrier', float('nan')):.3f}",
                 parallel_workers(plan), phase=f"checkpoints {model_label(jobs[0].cfg.pair.a)}")
        if evict:
            evict_checkpoints(jobs)


def evict_checkpoints(jobs: list[StudyJob]) -> dict[str, int]:
    """Delete the revisions these (FINISHED) checkpoint jobs read from the local hub cache; print what was freed."""
    from mergescope.hub import evict_revisions

    ref = resolve(jobs[0].cfg.pair.a)
    if ref.local:
        return {}
    revs = sorted({str(j.cfg.pair[s].revision) for j in jobs for s in ("a", "b")} | {str(jobs[0].cfg.native.base or "main")} - {"main", "None"})
    freed = evict_revisions(ref.location, revs)
    status.print(f"[bold]evicted[/] {len(freed)} revisions of {ref.location} from the hub cache: "
                  f"{sum(freed.values()) / 2**30:.2f} GiB freed ({', '.join(sorted(freed)) or 'none cached'})")
    return freed


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
    rows = []
    for arm, phase, of in plan.phases():
        try:
            jobs = of()
        except MergescopeError as exc:  # decided from files that do not exist yet (a zoo model not trained, not downloaded)
            rows.append({"arm": arm, "phase": phase, "jobs": 0, "done": 0, "todo": 0, "done_s": 0.0, "todo_s": None, "peak_gb": None,
                         "cpu_s": None, "gpu_s": None, "cpu_peak_gb": None, "gpu_peak_gb": None,
                         "todo_jobs": [], "note": f"decided from the models' files ({str(exc)[:80]})"})
            continue
        if not jobs:
            continue
        unknown: list[tuple[StudyJob, str]] = []
        done, todo = _done_pass(jobs, unknown)
        costs_ = [_cost(client, r.run_id) for _, r in done]
        secs = [c for c, _ in costs_ if c is not None]
        peaks = [p for _, p in costs_ if p is not None]
        med = statistics.median(secs) if secs else None
        left = {id(j) for j in todo}
        works = [(j, costs.count(counter, j.task, j.cfg)) for j in jobs]  # in order: an extraction is paid once
        counted = [w for j, w in works if id(j) in left]
        known = counted and all(w is not None and not w.missing for w in counted)
        rows.append({"arm": arm, "phase": phase, "jobs": len(jobs), "done": len(done), "todo": len(todo),
                     "peak_gb": max(peaks) if peaks else None,
                     "done_s": sum(secs), "todo_s": 0.0 if not todo else (med * len(todo) if med is not None else None),
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
    cols = ("arm", "phase", "jobs", "done", "to run", "done s", "store s", "CPU s", "CPU GiB", "GPU s", "GPU GiB")
    for c in cols:
        t.add_column(c, justify="left" if c in ("arm", "phase") else "right")
    num = lambda v, f="{:.0f}": "—" if v is None else f.format(v)  # noqa: E731
    for r in rows:
        if r["note"]:
            t.add_row(r["arm"], r["phase"], "?", "", "", "", r["note"], "", "", "", "")
            continue
        peak = r["peak_gb"] if r["peak_gb"] is not None else r["cpu_peak_gb"]
        gpk = r["gpu_peak_gb"]
        t.add_row(r["arm"], r["phase"], str(r["jobs"]), str(r["done"]), str(r["todo"]), f"{r['done_s']:.0f}", num(r["todo_s"]),
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

    from mergescope.analysis import run_analyze
    from mergescope.tracking import PARENT_ENV, Tracker

    plan = Plan(overrides)
    if cfg.get("plan"):
        return show_plan(plan, cfg)
    tracker = Tracker(cfg)
    was_quiet = not verbose()
    set_quiet(not cfg.get("verbose"))  # the jobs' own lines with -v only; the phase bars and the findings always
    started = time.perf_counter()
    previous = os.environ.get(PARENT_ENV)
    parent = None
    with recording() as ledger:
        try:
            with tracker.start(cfg, f"study {cfg.tracking.experiment}", {"kind": "study", "study": cfg.tracking.experiment,
                                                                           "arms": ",".join(plan.arms)}, overrides) as parent:
                os.environ[PARENT_ENV] = parent.run_id
                peaks: dict[str, float] = {}
                with tracker.finished_index():  # the done-checks from one search of the store as the study found it
                    times = _run_jobs(plan, peaks)
                times["all jobs"] = time.perf_counter() - started
                peaks = {k: v for k, v in peaks.items() if k in times}
                peaks["all jobs"] = max(peaks.values(), default=0.0)
                parent.log_metrics({f"wall_s.{k.replace(' ', '_')}": float(v) for k, v in times.items()})
                parent.log_metrics({f"peak_rss_gb.{k.replace(' ', '_')}": float(v) for k, v in peaks.items()})
                parent.log_metrics({"jobs": float(len(ledger)), "jobs_run": float(sum(not r.skipped for r in ledger))})
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
    """Every phase in order; returns each arm's wall time in seconds (skipped jobs included: a cached arm is fast) and
    fills ``peaks`` with each arm's peak resident set in GiB (the largest of this process and its worker processes)."""
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

    ph = {name: jobs for _, name, jobs in plan.phases()}
    trains = ph["training"]()
    todo = [j for j in trains if not is_trained(j.cfg.model.name_or_path)]
    for j in todo:
        console.print(f"[bold]training zoo model[/] {model_label(j.cfg.model)}")
    _run_all(todo, lambda j, r: f"trained {model_label(j.cfg.model)}", parallel_workers(plan), phase="training")
    for j in (j for j in trains if j not in todo):
        j.run()  # returns at once: the model is trained (its run is recorded)
    lap("training")
    _run_all(ph["quality"](), lambda j, r: f"quality {model_label(j.cfg.model)}: nll={r.metrics.get('nll', float('nan')):.4f}",
             phase="quality")
    _run_all(ph["measure"](), lambda j, r: f"{j.cfg.metric.name} {_pair_text(j)}", phase="measure")
    _run_all(ph["typology"](), lambda j, r: f"typology {_pair_text(j)}", phase="typology")
    lap("representation")
    _run_all(ph["native"](), lambda j, r: f"native pair {_pair_text(j)}",
             phase="native")
    lap("native")
    _checkpoint_arm(plan, ph["checkpoints"]())
    lap("checkpoints")
    _run_all(ph["transport"](), _transport_text, parallel_workers(plan),
             together=_target, phase="transport")  # one target's directions in one worker: its no-fusion baseline is made once
    _run_sweep(ph["transport settings"]())
    lap("transport")
    _run_all(ph["shared space"](), lambda j, r: f"{j.task} {_pair_text(j) if j.task == 'agreement' else 'all models'} on {j.cfg.data.name}",
             parallel_workers(plan), phase="shared space")
    lap("shared_space")
    _run_all(ph["adapt"](), lambda j, r: f"adapt {j.cfg.adapt.name} {_pair_text(j)}: best ratio {r.metrics.get('best_ratio', float('nan')):g}",
             parallel_workers(plan), phase="adapt")  # no cache between its jobs: union and intersection side by side
    lap("adapt")
    _run_all(ph["expansion"](), lambda j, r: f"expansion {j.cfg.expansion.target.mode} {model_label(j.cfg.model)}: "
             f"max |logit diff| {r.metrics.get('max_abs_logit_diff', float('nan')):.1e}", phase="expansion")
    lap("expansion")
    return {k: v for k, v in times.items() if k in ("training", "representation") or k in plan.arms or
            (k == "transport" and "transport_sweep" in plan.arms)}
