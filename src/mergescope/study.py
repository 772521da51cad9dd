"""task=study: run a study's sweep in-process (same jobs, same configs as ``-m``), then summarise.

The study overlay's ``hydra.sweeper.params`` is the list of jobs; each job is composed exactly
as the multirun would compose it (user overrides + the job's sweep values), so its cfg_hash,
logged config and skip-if-done behaviour are identical to a ``python launch.py -m`` job.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from mergescope.errors import MergescopeError
from mergescope.jobs import JobResult, model_label, run_measure, run_quality, run_train
from mergescope.progress import console


def sweep_jobs(params: dict[str, str]) -> list[list[str]]:
    """Cartesian product of the sweeper params, as lists of ``key=value`` overrides."""
    parser = OverridesParser.create()
    axes = []
    for key, spec in params.items():
        ov = parser.parse_override(f"{key}={spec}")
        values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [ov.get_value_element_as_str()]
        axes.append([f"{key}={v}" for v in values])
    return [list(combo) for combo in itertools.product(*axes)]


def _user_overrides(overrides: list[str]) -> list[str]:
    """The user's overrides without ``task=``: each job sets its own task."""
    return [o for o in overrides if o.lstrip("+~").split("=")[0] != "task"]


def _compose(overrides: list[str]) -> DictConfig:
    return compose(config_name="config", overrides=overrides, return_hydra_config=False)


def run_study(cfg: DictConfig, overrides: list[str]) -> dict[str, Any]:
    from mergescope import analysis

    study_cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    params = OmegaConf.to_container(study_cfg.hydra.sweeper.params, resolve=False) or {}
    if not params:
        raise MergescopeError("this study defines no sweep (hydra.sweeper.params); pick one with study=<name>")
    base = _user_overrides(overrides)
    measure_jobs = [base + job for job in sweep_jobs(params)]
    configs = [(_compose(o), o) for o in measure_jobs]

    # Distinct models in the study, in first-seen order.
    entries: dict[str, Any] = {}
    for c, _ in configs:
        for side in ("a", "b"):
            entries.setdefault(model_label(c.pair[side]), c.pair[side])

    # 1. train zoo models that are missing (reused afterwards)
    train_results = {}
    for label, entry in entries.items():
        if entry.get("zoo") is not None:
            tcfg, tov = _job_cfg(base + ["task=train"], entry)
            if not (Path(str(entry.name_or_path)) / "main" / "config.json").is_file():
                console.print(f"[bold]training zoo model[/] {label}")
            train_results[label] = run_train(tcfg, tov)  # returns at once when already trained

    # 2. quality per model, 3. every measure job
    quality: dict[str, JobResult] = {}
    for label, entry in entries.items():
        qcfg, qov = _job_cfg(base + ["task=quality"], entry)
        quality[label] = run_quality(qcfg, qov)
    results: list[tuple[DictConfig, JobResult]] = []
    for i, (c, o) in enumerate(configs, 1):
        r = run_measure(c, o)
        console.print(f"[{i}/{len(configs)}] {c.metric.name} {model_label(c.pair.a)} x {model_label(c.pair.b)}"
                      f"{' (done before)' if r.skipped else ''}")
        results.append((c, r))
    _typology_arm(cfg, base, configs)
    coverage_rows, native = _native_arm(results, base)
    native += _checkpoint_arm(cfg, base)
    _transport_arm(results, base)
    return analysis.run_analyze(cfg, base)  # tables, figures and the report, from MLflow


def _typology_arm(cfg: DictConfig, base: list[str], configs):
    """One kind=typology run per cross-model pair (URIEL distances; cached, seconds)."""
    from mergescope.typology import study_typology

    return study_typology(cfg, base, configs)


def _native_arm(results, base: list[str]):
    """Routes for every cross-model pair (from each model's config.json), and the native job for
    each pair that shares a parameter space."""
    from mergescope.models import load_config, resolve
    from mergescope.native import run_native
    from mergescope.weights import routes

    rows, native = [], []
    for c, r in results:
        if c.metric.name != "cka":
            continue
        rt = routes(load_config(resolve(c.pair.a)), load_config(resolve(c.pair.b)))
        rows.append((f"{model_label(c.pair.a)} x {model_label(c.pair.b)}", rt))
        if rt["native"]["defined"]:
            nc, nov = _pair_job(c, base + ["task=native"])
            console.print(f"[bold]native pair[/] {model_label(c.pair.a)} x {model_label(c.pair.b)}")
            native.append((nc, run_native(nc, nov)))
    return rows, native


def _transport_arm(results, base: list[str]):
    """Both directions (target <- donor) of every cross-model pair in the study: transport fusion with its
    random-plan control and, when merge.adapt.enabled, the adaptation runs."""
    from mergescope.transport.job import run_transport

    user_merge = any(o.lstrip("+~").split("=")[0] == "merge" for o in base)
    pairs = [c for c, _ in results if c.metric.name == "cka"]
    out = []
    for i, c in enumerate(pairs, 1):
        for target in ("a", "b"):
            ov = base + ["task=transport"] + ([] if user_merge else ["merge=transport"]) + [f"merge.target={target}"]
            tc, tov = _pair_job(c, ov)
            r = run_transport(tc, tov)
            t, d = (c.pair.a, c.pair.b) if target == "a" else (c.pair.b, c.pair.a)
            deltas = ", ".join(f"a={k.split('@')[1]}: {v:+.4f}" for k, v in r.metrics.items() if k.startswith("delta_target_lang@"))
            console.print(f"[{2 * i - (target == 'a')}/{2 * len(pairs)}] transport {model_label(t)} <- {model_label(d)}: "
                          f"delta target {deltas}{' (done before)' if r.skipped else ''}")
            out.append((tc, r))
    return out


def _pair_job(c: DictConfig, overrides: list[str]) -> tuple[DictConfig, list[str]]:
    j = _compose(overrides)
    with open_dict(j):
        j.pair = OmegaConf.create(OmegaConf.to_container(c.pair, resolve=True))
    return j, overrides + [f"pair.a.name_or_path={c.pair.a.name_or_path}", f"pair.b.name_or_path={c.pair.b.name_or_path}"]


def _checkpoint_arm(cfg: DictConfig, base: list[str]):
    """Every pair of the listed revisions of each listed model: a native job each."""
    from mergescope.native import run_native

    ck = cfg.get("checkpoints") or {}
    revs = [str(r) for r in ck.get("revisions") or []]
    out = []
    for m in ck.get("models") or []:
        entry = _compose(base + ["task=native", f"model={m}"]).model
        pairs = list(itertools.combinations(revs, 2))
        for i, (ra, rb) in enumerate(pairs, 1):
            c = _compose(base + ["task=native"])
            with open_dict(c):
                c.pair = OmegaConf.create({"a": OmegaConf.to_container(entry, resolve=True), "b": OmegaConf.to_container(entry, resolve=True)})
                c.pair.a.revision, c.pair.b.revision = ra, rb
            r = run_native(c, base + ["task=native", f"pair.a={m}@{ra}", f"pair.b={m}@{rb}"])
            console.print(f"[{i}/{len(pairs)}] checkpoint pair {m} {ra} x {rb}: barrier={r.metrics.get('lmc_barrier', float('nan')):.3f}"
                          f"{' (done before)' if r.skipped else ''}")
            out.append((c, r))
    return out


def _job_cfg(overrides: list[str], entry: Any) -> tuple[DictConfig, list[str]]:
    """A single-model job's config: composed from the overrides, with ``model`` set to the entry."""
    c = _compose(overrides)
    with open_dict(c):
        c.model = OmegaConf.create(OmegaConf.to_container(entry, resolve=True))
    return c, overrides + [f"model={model_label(entry)}"]
