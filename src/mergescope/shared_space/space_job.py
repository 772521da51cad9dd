"""task=shared_space (kind=shared_space): GPA over all ``shared.models`` against pairwise linear maps, by held-out
retrieval over k folds in pools of 10 / 32 / the whole fold, at every relative depth; the D sweep; transfer across
categories (FLORES domains); the space fitted on all sentences at the final layer, saved as the ``space``
artifact (``mergescope.shared_space.embed`` reads it)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from mergescope import models
from mergescope import data as data_mod
from mergescope.errors import MergescopeError
from mergescope.runs import JobResult, JobSpec, run_once
from mergescope.shared_space.agreement_job import write_csv
from mergescope.shared_space.content import content_types, type_transfer
from mergescope.shared_space.depth import depth_layers, distinct_depths
from mergescope.shared_space.domains import domains
from mergescope.shared_space.evaluate import domain_transfer, fit_space, off_diagonal_mean, retrieval_eval
from mergescope.shared_space.reprs import final_layers, models_tags, prepare
from mergescope.shared_space.settings import SharedSettings
from mergescope.shared_space.space import save_space

SPACE_KEYS = ["data", "represent.max_length", "represent.padding_side", "shared"]


def matrix_rows(res, labels: list[str], **extra) -> list[dict]:
    """One row per method, pool and ordered pair; pairwise rows carry the ridge chosen in each fold (median over the
    folds) and its lambda."""
    rows = []
    for key, m in res.mats.items():
        kind, pool = key.split("@")
        for a, la in enumerate(labels):
            for b, lb in enumerate(labels):
                if a != b:
                    row = {**extra, "method": kind, "pool": pool, "query": la, "gallery": lb, "p1": float(m[a, b]),
                           "dim": res.dim}
                    if kind == "pairwise":
                        row.update(ridge=float(np.median(res.ridges[:, a, b])), ridge_lambda=float(np.mean(res.lambdas[:, a, b])))
                    rows.append(row)
    return rows


def ridge_metrics(res) -> dict[str, float]:
    off = ~np.eye(res.ridges.shape[1], dtype=bool)
    chosen = res.ridges[:, off]
    return {"pairwise_ridge_median": float(np.median(chosen)), "pairwise_ridge_min": float(chosen.min()),
            "pairwise_ridge_max": float(chosen.max())}


def depth_sweep(s: SharedSettings, job, per_model, labels) -> list[dict]:
    """GPA against pairwise maps at every relative depth. A depth where some model has no distinct state (it
    repeats another depth's) is computed and kept in the table, flagged ``distinct = 0``, but not logged as a
    metric step: it is not a comparison at that depth."""
    rows = []
    main = s.pooling
    layers = [depth_layers(s.depths, len(r[main]) - 1) for r in per_model]
    distinct = [distinct_depths(s.depths, len(r[main]) - 1) for r in per_model]
    for k, d in enumerate(s.depths):
        Xs = [r[main][layers[i][k]] for i, r in enumerate(per_model)]
        res = retrieval_eval(Xs, s.dim, s.folds, s.pool_sizes, s.seed, s.ridges)
        ok = all(x[k] for x in distinct)
        if ok:
            job.log_metrics({**{f"{key.replace('@', '_p1_')}_by_depth": off_diagonal_mean(m) for key, m in res.mats.items()},
                             **{f"{key}_by_depth": v for key, v in ridge_metrics(res).items()}}, step=k)
        rows += matrix_rows(res, labels, depth=float(d), distinct=int(ok),
                            without_distinct_state=",".join(lab for lab, x in zip(labels, distinct) if not x[k]))
    return rows


def dim_sweep(s: SharedSettings, job, Xs) -> list[dict]:
    """Retrieval against the requested D. The D a fold's space really has is capped at its rank limit
    (``effective_dim``); a requested D above the cap repeats the capped numbers, so its row says ``capped = 1``
    and carries the effective D, and only the first row at each effective D is logged as a metric step."""
    rows, seen = [], set()
    for D in (int(x) for x in s.dims):
        res = retrieval_eval(Xs, D, s.folds, [32], s.seed, s.ridges)
        row = {"dim": D, "dim_effective": res.dim, "capped": int(res.dim < D),
               "gpa_p1_32": off_diagonal_mean(res.mats["gpa@32"]), "pairwise_p1_32": off_diagonal_mean(res.mats["pairwise@32"])}
        if res.dim not in seen:
            seen.add(res.dim)
            job.log_metrics({f"{k_}_by_dim": row[k_] for k_ in ("gpa_p1_32", "pairwise_p1_32")}, step=res.dim)
        rows.append(row)
    return rows


def space_meta(cfg, s: SharedSettings, entries, layers, sides) -> dict:
    return {"models": [{"label": models.label(e), "entry": OmegaConf.to_container(e, resolve=True), "layer": int(l_)}
                       for e, l_ in zip(entries, layers)],
            "pooling": s.pooling, "max_length": int(cfg.represent.max_length), "dim": s.dim,
            "data": str(cfg.data.name), "split": str(cfg.data.split), "n_sentences": len(sides[0].sentences)}


def content_side(cfg: DictConfig, entries, sides) -> data_mod.Side:
    """The English side of the probes (content types are read from it), else the first model's side."""
    for e, side in zip(entries, sides):
        if str(e.lang) == "eng_Latn":
            return side
    try:
        side = data_mod.load_side(cfg.data, "eng_Latn")
    except MergescopeError:  # the data has no English side: the types are read from the first model's language
        return sides[0]
    return side if len(side.sentences) == len(sides[0].sentences) else sides[0]


def content_rows(cfg: DictConfig, s: SharedSettings, entries, sides, finals) -> list[dict]:
    """Shared-space retrieval on each content type, unseen in the fit, against an in-distribution control (§7)."""
    side = content_side(cfg, entries, sides)
    rows = type_transfer(finals, content_types(side.sentences), s.dim, s.content_pool,
                         seed=s.seed)
    return [{**r, "lang": side.lang} for r in rows]


def headline(rows: list[dict], depth: float) -> dict[str, float]:
    out = {}
    for r in rows:
        if r["depth"] == depth:
            out.setdefault(f"{r['method']}_p1_{r['pool']}", []).append(r["p1"])
    return {k: float(np.mean(v)) for k, v in out.items()}


def run_shared_space(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    s, entries, refs, sides, labels = prepare(cfg)

    def body(job) -> dict[str, float]:
        per_model = final_layers(cfg, s, entries, refs, sides)
        main = s.pooling
        finals = [r[main][-1] for r in per_model]
        tables = {"retrieval": depth_sweep(s, job, per_model, labels), "dim_sweep": dim_sweep(s, job, finals)}
        dom = domains(cfg.data, str(entries[0].lang), len(sides[0].sentences))
        if dom is not None:
            tables["transfer"] = domain_transfer(finals, dom, s.dim, s.transfer_pool, seed=s.seed)
        tables["content_types"] = content_rows(cfg, s, entries, sides, finals)
        space = fit_space(finals, s.dim)
        with tempfile.TemporaryDirectory() as d:
            for name, rows in tables.items():
                write_csv(rows, Path(d) / f"{name}.csv")
            job.log_artifacts(d, "tables")
        with tempfile.TemporaryDirectory() as d:
            job.log_artifacts(save_space(space, space_meta(cfg, s, entries, [len(r[main]) - 1 for r in per_model], sides), d), "space")
        job.log_params({"models": labels, "layers": [len(r[main]) - 1 for r in per_model], "domains": sorted(set(dom or []))})
        return {**headline(tables["retrieval"], s.depths[-1]), "gpa_iterations": float(space.fit.iterations),
                "dim_effective": float(space.reductions[0].basis.shape[1]),
                "n_models": float(len(entries)), "n_sentences": float(len(sides[0].sentences))}

    tags = models_tags(cfg, s, "shared_space", labels)
    return run_once(cfg, JobSpec(f"shared_space {len(labels)} models", tags, task="shared_space", keys=SPACE_KEYS,
                                 reads=tuple(refs)), body, overrides)
