"""A study's jobs as configs: one job = a task and the override list that composes (and replays) it.

Downstairs of the study and of every arm: the arms' job lists (``<arm>/arm.py``) and the study build their jobs
with :func:`job`, :func:`pair_override` and :func:`model_override`, and compose through :func:`composed`'s disk
cache."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from mergescope.cli import handler
from mergescope.config import check_finite, conf_digest, conf_options, redact, to_plain
from mergescope.errors import MergescopeError, did_you_mean
from mergescope.progress import console, phase_bar
from mergescope.runs import JobResult
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
    pair = next((o.split("=", 1)[1] for o in combo if key_of(o) == "pair"), None)
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


def key_of(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def without(overrides: list[str], *keys: str) -> list[str]:
    return [o for o in overrides if key_of(o) not in keys]


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


def use_compose_cache(folder: Path) -> None:
    """Compose through the disk cache under ``folder`` from now on (a study's ``paths.cache``/compose)."""
    _COMPOSE_CACHE[:] = [Path(folder)]


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
    ov = [*without(overrides, "task"), f"task={task}"]
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


def pair_text(j: StudyJob) -> str:
    """A pair job's two models, for its line in a phase's output."""
    from mergescope.runs import model_label

    return f"{model_label(j.cfg.pair.a)} x {model_label(j.cfg.pair.b)}"


def done_note(r: JobResult) -> str:
    return " (done before)" if r.skipped else ""


def run_all(jobs: list[StudyJob], describe, workers: int = 1, together=None,
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
            console.print(f"[{len(out) + 1}/{len(jobs)}] {text}{done_note(r)}", soft_wrap=True)
            out.append((j, r))
            counts["reused" if r.skipped else "run"] += 1
            last = text if len(text) <= 70 else text[:69] + "…"
            pb.update(bar_id, advance=1, note=f"{counts['run']} run, {counts['reused']} reused" +
                      ("" if len(out) == len(jobs) else f"; {last}"))

        if workers > 1 and len(jobs) > 1:
            done, todo = done_pass(jobs)  # worker processes only for what is left to run (none on a cached relaunch)
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


def done_pass(jobs: list[StudyJob], unknown: list[tuple[StudyJob, str]] | None = None
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


def workers_of(cfg: DictConfig) -> int:
    """``workers``: processes for a study's heavy independent jobs (the phases that allow them); everything else runs
    in-process, in order (it shares the caches the earlier jobs fill)."""
    return max(1, int(cfg.get("workers") or 1))
