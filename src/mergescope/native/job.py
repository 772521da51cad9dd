"""``task=native``: one pair with a shared parameter space (one run, kind=measure, metric=native,
route=native): coverage (which tensors share name and shape, which are excluded and why), weight
diagnostics on the shared tensors, task-vector diagnostics against a base (checkpoint pairs: the
run's ``step0``), the linear mode-connectivity curve NLL((1-t)a + t b) with its barrier, and the
merge gain of the operator in ``native.merges`` with the lowest NLL on ``native.select_split`` (each merged model
its own run, ``merges.py``), reported on ``data.split``.
Nothing is padded or truncated.

The arm's task handlers are here, as every arm's are in its ``job.py``: :func:`run_native` (task=native) and
:func:`run_merge` (task=merge, on a pair or N models; its work in :mod:`mergescope.native.merges`).
"""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np
from omegaconf import DictConfig, OmegaConf, open_dict

from mergescope.config import load_conf, plain_copy, to_plain
from mergescope.errors import MergescopeError
from mergescope.merge import resolve_preset
from mergescope.native.merges import EVIDENCE, LANG_GAINS, merge_configs, outcome_tags, preset_config, run_merge
from mergescope.native.settings import NativeSettings
from mergescope.native.stats import GRAM_RULE, STATS_KEYS
from mergescope.native.pair import (Loaded, base_entry, check_pair, lang_endpoints, lmc_curve, nll_sentences,
                                    no_base_reason, same_run, step_of)
from mergescope.native.weights import TRANSPLANTED, describe, routes, task_vector_diagnostics, weight_diagnostics
from mergescope.progress import console
from mergescope.runs import JobResult, JobSpec, model_label, pair_label, pair_tags, pair_text, run_once

NATIVE_KEYS = ["pair", "data", "native", "represent.max_length"]


__all__ = ["run_native", "run_merge", "checkpoint_cka", "hash_extra", "weight_values"]


def weight_values(cfg: DictConfig, loaded: Loaded) -> dict[str, float]:
    """The pair's data-free diagnostics (weights over the shared tensors, task vectors against the base, the step
    ratio of two checkpoints): what the native run logs and what the forecast reads for a pair before any merge."""
    cov = loaded.coverage
    values = {"n_shared_tensors": float(len(cov.shared)), "shared_params": float(cov.shared_params),
              "n_excluded_tensors": float(len(cov.excluded))}
    values.update(weight_diagnostics(loaded.sd_a, loaded.sd_b, cov.shared, device=cfg.device))
    # The same on weight matrices only: in small models the norm gains (initialised at 1) carry
    # much of the total norm and make independently trained models look aligned.
    # Logged for every pair: where every shared tensor is a matrix (no norm gains, no biases) they equal the above.
    mats = [n for n in cov.shared if loaded.sd_a[n].ndim >= 2]
    if mats:
        wm = weight_diagnostics(loaded.sd_a, loaded.sd_b, mats, device=cfg.device) if len(mats) < len(cov.shared) else values
        values.update({f"{k}_matrices": wm[k] for k in ("weight_cosine", "relative_l2", "norm_ratio")})
    if loaded.sd_base is not None:
        values.update(task_vector_diagnostics(loaded.sd_a, loaded.sd_b, loaded.sd_base, cov.shared,
                                              density=NativeSettings.from_cfg(cfg).density, device=cfg.device))
    sa, sb = step_of(cfg.pair.a.revision), step_of(cfg.pair.b.revision)
    if sa is not None and sb is not None and min(sa, sb) > 0:
        values["log10_step_ratio"] = math.log10(max(sa, sb) / min(sa, sb))
    return values


def _lmc_values(cfg: DictConfig, loaded: Loaded, job, sentences, ends: list) -> dict[str, float]:
    """The LMC curve's numbers; its two endpoints' per-sentence scores are appended to ``ends`` (every merge's gain is
    measured against them)."""
    ts, curve, barrier, end_scores = lmc_curve(cfg, loaded, sentences)
    ends.extend(end_scores)
    for i, (t, v) in enumerate(zip(ts, curve)):
        job.log_metrics({"lmc_nll": float(v), "lmc_t": float(t)}, step=i)
    return {"lmc_barrier": barrier, "nll_a": float(curve[0]), "nll_t1": float(curve[-1]),
            "lmc_midpoint_nll": float(curve[np.flatnonzero(ts == 0.5)[0]]), "n_sentences": float(len(sentences))}


def _merge_values(cfg: DictConfig, loaded: Loaded, job, overrides, endpoints: tuple,
                  lang_ends: dict[str, float], lang_scores: dict | None = None) -> dict[str, float]:
    merges = []
    for mc in merge_configs(cfg):
        r = run_merge(mc, overrides, loaded=loaded, endpoints=endpoints, lang_ends=lang_ends, lang_scores=lang_scores)
        merges.append((mc.merge.name, r))
        console.print(f"  merge {mc.merge.name} {pair_label(cfg)}: nll={r.metrics['nll']:.4f}{' (done before)' if r.skipped else ''}")
    job.log_params({"merge_runs": {name: r.run_id for name, r in merges}})
    independent = [(n, r) for n, r in merges if not r.metrics.get("same_as_linear")]
    if not independent or NativeSettings.from_cfg(cfg).select_split is None:
        return {}
    # The operator is chosen on native.select_split (its lines disjoint from data.split's; the first token apart, as
    # every comparison reads), and its gain reported on data.split: the minimum over operators of the reported NLLs
    # would be chosen on the sentences it reports.
    name, chosen = min(independent, key=lambda nr: nr[1].metrics.get("val_nll_rest", nr[1].metrics["val_nll"]))
    gain = min(e.nats_per_token for e in endpoints) - chosen.metrics["nll"]
    job.log_params({"merge_chosen": {"merge": name, "run": chosen.run_id, "on": NativeSettings.from_cfg(cfg).select_split}})
    # the chosen merge's gain and its paired interval (its own run measured them on these sentences and endpoints)
    intervals = {k: v for k, v in chosen.metrics.items() if k.startswith("merge_gain_")}
    return {"merge_gain": gain, **intervals, "chosen_merged_nll": chosen.metrics["nll"], "chosen_val_nll": chosen.metrics["val_nll"]}


def _transplant_values(cfg: DictConfig, loaded: Loaded, rt: dict, job, overrides) -> dict[str, float]:
    """A transplanted pair: the native route's scope now every tensor (``routes.native``), what was done (param
    ``transplant``), and each transplanted side's cost and its control's (:func:`run_transplant`'s runs) as
    ``transplant_<metric>_<side>``."""
    from mergescope.native.transplant import pair_cost_runs

    done = loaded.transplant
    job.log_params({"transplant": done})
    if not done.get("done"):
        return {}
    rt["native"] = {**rt["native"], "scope": TRANSPLANTED,
                    "note": f"{rt['native'].get('note') or ''}; vocabulary transplant: {done['target']} ({done['method']})".lstrip("; ")}
    runs = pair_cost_runs(cfg, NativeSettings.from_cfg(cfg).transplant_settings(), overrides)
    job.log_params({"transplant_runs": {side: r.run_id for side, r in runs.items()}})
    return {f"transplant_{k}_{side}": r.metrics[k] for side, r in runs.items()
            for k in ("cost_bpb", "control_cost_bpb", "cost_nll", "control_cost_nll", "n_new") if k in r.metrics}


def hash_extra(cfg: DictConfig) -> dict:
    """What the native job's numbers depend on beyond NATIVE_KEYS: the contents of its merge presets, and for
    checkpoint pairs the settings of the CKA between the checkpoints."""
    ns = NativeSettings.from_cfg(cfg)
    presets = ns.merges
    extra = {"merge_presets": {n: to_plain(preset_config(n)) for n in presets}, "evidence": EVIDENCE}
    if ns.nll_langs:  # each language's gain with its interval (unset: earlier hashes unchanged)
        extra["lang_gains"] = LANG_GAINS
    if (ts := ns.transplant_settings()) is not None:  # every setting, defaults included (unset: earlier hashes unchanged)
        extra["transplant"] = asdict(ts)
    if any(resolve_preset(preset_config(n))[0].meta.get("needs_stats") == "gram" for n in presets):
        extra["gram"] = GRAM_RULE  # RegMean solves a biased layer's weight and bias together (native.stats)
    if same_run(cfg):
        extra["checkpoint_cka"] = {"metric": to_plain(load_conf("metric", "cka")),
                                   **{k: OmegaConf.select(cfg, k) for k in ("represent.pooling", "represent.layer", "represent.padding_side")}}
    return extra


def run_native(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    ns = NativeSettings.from_cfg(cfg)  # every native.* setting checked before the pair's weights are read
    if ns.merges and (why := ns.select_overlap(cfg)):
        raise MergescopeError(f"native.select_split={ns.select_split} and data.split={cfg.data.split}: {why}; the operator "
                              "behind merge_gain is chosen on one split and reported on another, disjoint one (use "
                              "native.select_split=dev and data.split=devtest, or native.select_split=null to choose none)")
    refs = check_pair(cfg)

    def body(job) -> dict[str, float]:
        loaded = Loaded(cfg, need_base=True)
        cov = loaded.coverage
        rt = routes(loaded.true_a, loaded.true_b)
        values: dict[str, float] = {}
        if loaded.transplant is not None:  # native.transplant: which vocabulary, and each transplant's own cost run
            values.update(_transplant_values(cfg, loaded, rt, job, overrides))
        job.log_params({"coverage": cov.summary(), "routes": rt, "definitions": describe(),
                        "model_a.true": loaded.true_a, "model_b.true": loaded.true_b,
                        "excluded_reasons": dict(cov.excluded[:50])})
        values.update(weight_values(cfg, loaded))
        if loaded.sd_base is None:
            job.log_params({"task_vectors": f"not measured: {no_base_reason(cfg)}"})
        else:
            job.log_params({"task_vector_base": f"{model_label(base_entry(cfg))}"
                                                f"{'@' + str(base_entry(cfg).revision) if base_entry(cfg).get('revision') else ''}"})
        sentences = nll_sentences(cfg)
        ends: list = []
        values.update(_lmc_values(cfg, loaded, job, sentences, ends))
        # native.nll_langs: each expert and the base on every language (the host's language: the LMC curve's ends)
        lang_scores: dict = {}
        lang_ends = lang_endpoints(cfg, loaded, (sentences, ends[0], ends[1]), kept=lang_scores)
        values.update(lang_ends)
        values.update(_merge_values(cfg, loaded, job, overrides, tuple(ends), lang_ends, lang_scores))
        if same_run(cfg):
            values["cka"] = checkpoint_cka(cfg, overrides)
        return values

    tags = {"kind": "measure", "metric": "native", "route": "native", **pair_tags(cfg), "seed": cfg.seed,
            "arm": "checkpoint" if same_run(cfg) else "cross-model", "transplant": transplant_tag(cfg), **outcome_tags(cfg)}
    data_aware = any(resolve_preset(preset_config(n))[0].meta.get("needs_stats") for n in ns.merges)
    return run_once(cfg, JobSpec(f"native {pair_text(cfg)}", tags, task="native",
                                 keys=NATIVE_KEYS + (STATS_KEYS if data_aware else []), reads=refs, extra=hash_extra(cfg),
                                 nested=lambda: _nested_runs(cfg, overrides)), body, overrides)


def transplant_tag(cfg: DictConfig) -> str | None:
    """The ``transplant`` tag of a native pair's runs (native and merges): ``<tokenizer>:<method>``, or None (unset)."""
    ts = NativeSettings.from_cfg(cfg).transplant_settings()
    return None if ts is None else f"{ts.tokenizer}:{ts.method}"


def _nested_runs(cfg: DictConfig, overrides) -> None:
    """A reused native run's merge runs, transplant cost runs and checkpoint CKA run (reused in turn, or run when
    missing)."""
    if (ts := NativeSettings.from_cfg(cfg).transplant_settings()) is not None:
        from mergescope.native.transplant import pair_cost_runs

        pair_cost_runs(cfg, ts, overrides)
    for mc in merge_configs(cfg):
        run_merge(mc, overrides)
    if same_run(cfg):
        checkpoint_cka(cfg, overrides)


def checkpoint_cka(cfg: DictConfig, overrides) -> float:
    """CKA between the two checkpoints (the representation arm's own measure run, cached)."""
    from mergescope.represent.job import run_measure

    c = plain_copy(cfg)
    with open_dict(c):
        c.metric = load_conf("metric", "cka")
        c.task = {"name": "measure"}
    return float(run_measure(c, overrides).metrics["cka"])
