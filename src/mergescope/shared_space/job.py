"""The shared-space arm's three tasks, one module: task=agreement (one pair at every relative depth), task=shared_space (GPA
over all ``shared.models`` against pairwise maps) and task=routing (the shared space as a router).

- task=agreement (kind=agreement): one pair at every relative depth: RSA and nearest-neighbour match with
their permutation nulls, every configured representation metric, the L_a x L_b CKA matrix (CSV + heatmap),
each model's share of variance in two principal components by layer, and the pooling ablation.

- task=shared_space (kind=shared_space): GPA over all ``shared.models`` against pairwise linear maps, by held-out
retrieval over k folds in pools of 10 / 32 / the whole fold, at every relative depth; the D sweep; transfer across
categories (FLORES domains); the space fitted on all sentences at the final layer, saved as the ``space``
artifact (``mergescope.shared_space.embed`` reads it).

- task=routing (kind=routing): bits per byte of every sentence under every ``shared.models`` model, and the
routers of :mod:`mergescope.shared_space.routing` against always using the best model and the per-sentence oracle.
Whether a router beats always-best is the report's verdict on ``gain_<router>`` (its paired interval), never a
logged boolean.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from mergescope import precision
from mergescope import data as data_mod
from mergescope import models
from mergescope.scoring.bpb import LN2, Scores, score_sentences
from mergescope.documents import documents
from mergescope.intervals import paired_difference
from mergescope.errors import MergescopeError
from mergescope.metrics.cka import linear_cka_matrix
from mergescope.plotting import pyplot as plt
from mergescope.registry import metrics as metric_registry
from mergescope.represent import one_forward
from mergescope.represent.job import check_represent
from mergescope.runs import JobResult, JobSpec, pair_tags, pair_text, run_once
from mergescope.shared_space.agreement import agreement, nn_match_null, permutations, rsa
from mergescope.shared_space.centroids import centroid_rows, flores_topics
from mergescope.shared_space.content import content_types, type_transfer
from mergescope.shared_space.depth import depth_layers, distinct_depths
from mergescope.shared_space.domains import domains
from mergescope.shared_space.evaluate import domain_transfer, fit_space, off_diagonal_mean, retrieval_eval
from mergescope.shared_space.reorganize import change_corr, is_ssm, layer_change
from mergescope.shared_space.reprs import final_layers, layer_reprs, models_tags, pc2_share, prepare
from mergescope.shared_space.routing import gain_intervals, pooled, route, summarise
from mergescope.shared_space.settings import SharedSettings
from mergescope.shared_space.space import save_space

AGREEMENT_KEYS = ["pair", "data", "represent.max_length", "represent.padding_side", "shared"]


def rsa_rows(n: int, s: SharedSettings) -> np.ndarray | None:
    k = s.rsa_sentences
    if not k or int(k) >= n:
        return None
    return np.sort(np.random.default_rng(s.seed).choice(n, int(k), replace=False))


def depth_values(s: SharedSettings, device: str, Xa: np.ndarray, Xb: np.ndarray) -> dict[str, float]:
    """Everything measured at one depth on the main pooling."""
    out = agreement(Xa, Xb, n_perm=s.permutations, seed=s.seed, rsa_rows=rsa_rows(len(Xa), s))
    for name in s.metrics:
        entry, kwargs = metric_with_kwargs(str(name))
        vals = entry.fn(Xa, Xb, device=device, **kwargs)
        out.update({k: float(v) for k, v in vals.items()})
    return out


def metric_with_kwargs(name: str):
    """A registered metric and its keyword arguments from conf/metric/<name>.yaml (checked)."""
    from omegaconf import OmegaConf

    from mergescope.config import CONF_DIR

    entry = metric_registry.get(name)
    path = CONF_DIR / "metric" / f"{name}.yaml"
    conf = OmegaConf.to_container(OmegaConf.load(path)) if path.is_file() else {}
    return entry, entry.check_kwargs({k: v for k, v in conf.items() if k != "name"})


def pooling_rows(s: SharedSettings, reps_a, reps_b, la: list[int], lb: list[int]) -> list[dict]:
    """RSA (observed) and nearest-neighbour match (with its null) for every pooling at every depth."""
    rows = []
    for p in s.all_poolings:
        for d, i, j in zip(s.depths, la, lb):
            Xa, Xb = reps_a[p][i], reps_b[p][j]
            perms = permutations(len(Xa), s.permutations, s.seed)
            nn, null = nn_match_null(Xa, Xb, perms)
            sub = rsa_rows(len(Xa), s)
            r = rsa(Xa, Xb) if sub is None else rsa(Xa[sub], Xb[sub])
            rows.append({"pooling": p, "depth": float(d), "layer_a": i, "layer_b": j, "rsa": r, "nn_match": nn,
                         "nn_match_p": float((1 + np.sum(null >= nn)) / (1 + null.size)),
                         "nn_match_ratio_to_chance": nn * (len(Xa) - 1)})
    return rows


def centroid_table(cfg: DictConfig, s: SharedSettings, La: np.ndarray, Lb: np.ndarray, la: list[int], lb: list[int]) -> list[dict]:
    """Category-centroid agreement against random partitions (§5.1) at every depth, for each topic count."""
    topics = flores_topics(cfg.data, La.shape[1])
    rows = []
    for d, i, j in zip(s.depths, la, lb):
        rows += centroid_rows(La[i], Lb[j], topics, [int(k) for k in s.centroid_topics], s.partitions,
                              s.seed, depth=float(d), layer_a=i, layer_b=j)
    return rows


def change_values(Ca: np.ndarray, Cb: np.ndarray, i: int, j: int) -> dict[str, float]:
    """At one depth: the correlation across probes of the two models' change on entering layers i and j (§5.3),
    and each model's mean change there."""
    if i == 0 or j == 0:
        return {"change_corr": float("nan"), "change_mean_a": float("nan"), "change_mean_b": float("nan")}
    return {"change_corr": change_corr(Ca[i], Cb[j]), "change_mean_a": float(Ca[i].mean()), "change_mean_b": float(Cb[j].mean())}


def model_types(ref_a, ref_b) -> dict[str, str]:
    """The two architectures (config only) and how many are state-space models (tags; §5.3 groups pairs by it)."""
    ta, tb = models.load_config(ref_a)["model_type"], models.load_config(ref_b)["model_type"]
    return {"model_type_a": ta, "model_type_b": tb, "ssm_models": str(int(is_ssm(ta)) + int(is_ssm(tb)))}


def write_csv(rows: list[dict], path: Path) -> None:
    import csv

    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)


def heatmap(M: np.ndarray, la: str, lb: str):
    fig, ax = plt().subplots(figsize=(1.2 + 0.5 * M.shape[1], 1 + 0.5 * M.shape[0]))
    im = ax.imshow(M, vmin=0, vmax=1, cmap="viridis", origin="lower")
    ax.set_xlabel(f"{lb} hidden state")
    ax.set_ylabel(f"{la} hidden state")
    ax.set_title("linear CKA, every layer pair", fontsize=9)
    fig.colorbar(im, ax=ax)
    return fig


def log_tables(job, tables: dict[str, list[dict]], fig) -> None:
    with tempfile.TemporaryDirectory() as d:
        for name, rows in tables.items():
            write_csv(rows, Path(d) / f"{name}.csv")
        job.log_artifacts(d, "tables")
    job.log_figure(fig, "figures/cka_layers.png")
    plt().close(fig)


def run_agreement(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    a, b = cfg.pair.a, cfg.pair.b
    ref_a, ref_b = models.resolve_pair(cfg.pair)
    check_represent(cfg)
    s = SharedSettings.from_cfg(cfg)
    side_a, side_b = data_mod.load_parallel(cfg.data, str(a.lang), str(b.lang))
    metric_kwargs = {str(name): metric_with_kwargs(str(name))[1] for name in s.metrics}

    def body(job) -> dict[str, float]:
        reps_a, meta_a = layer_reprs(cfg, s, a, ref_a, side_a)
        reps_b, meta_b = layer_reprs(cfg, s, b, ref_b, side_b)
        main = s.pooling
        n_a, n_b = reps_a[main].shape[0] - 1, reps_b[main].shape[0] - 1
        la, lb = depth_layers(s.depths, n_a), depth_layers(s.depths, n_b)
        da, db = distinct_depths(s.depths, n_a), distinct_depths(s.depths, n_b)
        dup = [float(d) for d, x, y in zip(s.depths, da, db) if not (x and y)]
        job.log_params({"layers_a": n_a, "layers_b": n_b, "depth_layers_a": la, "depth_layers_b": lb,
                        "depths_without_distinct_state": dup or "none",
                        "cache_a": meta_a["cache"], "cache_b": meta_b["cache"]})
        rows = []
        ca, cb = layer_change(reps_a[main]), layer_change(reps_b[main])
        for k, (d, i, j) in enumerate(zip(s.depths, la, lb)):
            vals = {**depth_values(s, cfg.device, reps_a[main][i], reps_b[main][j]), **change_values(ca, cb, i, j)}
            if da[k] and db[k]:  # a depth where either model repeats another depth's state is not a comparison
                job.log_metrics({f"{m}_by_depth": v for m, v in vals.items() if v == v}, step=k)  # NaN: undefined at depth 0
            rows.append({"depth": float(d), "layer_a": i, "layer_b": j, "distinct_a": int(da[k]), "distinct_b": int(db[k]),
                         "distinct": int(da[k] and db[k]), **vals})
        geo = [{"model": side, "layer": l_, "depth": l_ / (len(r[main]) - 1), "pc2_share": pc2_share(r[main][l_]),
                "change_from_previous": float(np.mean(c[l_]))}
               for side, r, c in (("a", reps_a, ca), ("b", reps_b, cb)) for l_ in range(len(r[main]))]
        for g in geo:
            job.log_metrics({f"pc2_share_{g['model']}_by_layer": g["pc2_share"]}, step=g["layer"])
        M = linear_cka_matrix(reps_a[main], reps_b[main], cfg.device)
        cka_rows = [{"layer_a": i, **{f"layer_b_{j}": float(M[i, j]) for j in range(M.shape[1])}} for i in range(M.shape[0])]
        cent = centroid_table(cfg, s, reps_a[main], reps_b[main], la, lb)
        log_tables(job, {"depth": rows, "cka_layers": cka_rows, "pc2_share": geo, "centroids": cent,
                         "pooling_ablation": pooling_rows(s, reps_a, reps_b, la, lb)},
                   heatmap(M, models.label(a), models.label(b)))
        final = {k: v for k, v in rows[-1].items()
                 if k not in ("depth", "layer_a", "layer_b", "distinct_a", "distinct_b", "distinct") and v == v}
        final.update({f"{key}_k{c['categories']}": float(c[key]) for c in cent if c["depth"] == rows[-1]["depth"]
                      for key in ("centroid_rsa", "centroid_rsa_p", "centroid_rsa_null_q975", "centroid_random_as_strong")})
        return {**final, "n_sentences": float(len(side_a.sentences)), "n_depths": float(len(rows)),
                "pc2_share_a_final": geo[n_a]["pc2_share"], "pc2_share_b_final": geo[-1]["pc2_share"]}

    tags = {"kind": "agreement", **pair_tags(cfg), **model_types(ref_a, ref_b), "route": "representation", "seed": s.seed,
            "data": cfg.data.name, "split": cfg.data.split}
    return run_once(cfg, JobSpec(f"agreement {pair_text(cfg)}", tags, task="agreement", keys=AGREEMENT_KEYS,
                                 reads=(ref_a, ref_b), extra={"metric_kwargs": metric_kwargs, **one_forward.identity(cfg)}), body, overrides)  # conf/metric/*.yaml it read


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


def depth_sweep(s: SharedSettings, job, per_model, labels, last: list | None = None) -> list[dict]:
    """GPA against pairwise maps at every relative depth. A depth where some model has no distinct state (it
    repeats another depth's) is computed and kept in the table, flagged ``distinct = 0``, but not logged as a
    metric step: it is not a comparison at that depth. The last depth's :class:`Retrieval` is appended to ``last``."""
    rows = []
    main = s.pooling
    layers = [depth_layers(s.depths, len(r[main]) - 1) for r in per_model]
    distinct = [distinct_depths(s.depths, len(r[main]) - 1) for r in per_model]
    for k, d in enumerate(s.depths):
        Xs = [r[main][layers[i][k]] for i, r in enumerate(per_model)]
        res = retrieval_eval(Xs, s.dim, s.folds, s.pool_sizes, s.seed, s.ridges)
        if last is not None and k == len(s.depths) - 1:
            last.append(res)
        ok = all(x[k] for x in distinct)
        if ok:
            job.log_metrics({**{f"{key.replace('@', '_p1_')}_by_depth": off_diagonal_mean(m) for key, m in res.mats.items()},
                             **{f"{key}_by_depth": v for key, v in ridge_metrics(res).items()}}, step=k)
        rows += matrix_rows(res, labels, depth=float(d), distinct=int(ok),
                            without_distinct_state=",".join(lab for lab, x in zip(labels, distinct) if not x[k]))
    return rows


def dim_sweep(s: SharedSettings, job, Xs, cfg: DictConfig | None = None, entries=None) -> list[dict]:
    """Retrieval against the requested D, each D with GPA minus pairwise and its paired 95% interval over the
    sentences' articles (:func:`gpa_vs_pairwise`; with ``cfg`` and ``entries``). The D a fold's space really has is
    capped at its rank limit (``effective_dim``); a requested D above the cap repeats the capped numbers, so its row
    says ``capped = 1`` and carries the effective D, and only the first row at each effective D is logged as a metric
    step."""
    rows, seen = [], set()
    for D in (int(x) for x in s.dims):
        res = retrieval_eval(Xs, D, s.folds, [32], s.seed, s.ridges)
        row = {"dim": D, "dim_effective": res.dim, "capped": int(res.dim < D),
               "gpa_p1_32": off_diagonal_mean(res.mats["gpa@32"]), "pairwise_p1_32": off_diagonal_mean(res.mats["pairwise@32"])}
        if cfg is not None and entries is not None:
            d = gpa_vs_pairwise(cfg, entries, res)
            row.update({k: d.get(f"gpa_minus_pairwise_p1_32{k[len('diff'):]}", float("nan"))
                        for k in ("diff", "diff_lo", "diff_hi", "diff_groups")})
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


def gpa_vs_pairwise(cfg: DictConfig, entries, res) -> dict[str, float]:
    """At the last depth, per pool size: GPA minus the pairwise maps in held-out P@1, pooled over every held-out
    sentence, ordered pair and fold (``gpa_minus_pairwise_p1_<pool>``), with its paired 95% interval over the
    sentences' FLORES articles (each sentence's hits under both methods kept together)."""
    if not res.hits:
        return {}
    n = len(next(iter(res.hits.values())))
    docs, what = documents(cfg.data, str(entries[0].lang), n)
    out: dict[str, float] = {}
    for key in res.hits:
        if not key.startswith("gpa@"):
            continue
        pool = key.split("@", 1)[1]
        other = f"pairwise@{pool}"
        ok = res.scored[key] > 0
        d = paired_difference(res.hits[key][ok], res.hits[other][ok], res.scored[key][ok], res.scored[other][ok],
                              groups=None if docs is None else [docs[i] for i in np.flatnonzero(ok)], resampled=what)
        out.update(d.metrics(f"gpa_minus_pairwise_p1_{pool}"))
    return out


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
        last: list = []
        tables = {"retrieval": depth_sweep(s, job, per_model, labels, last), "dim_sweep": dim_sweep(s, job, finals, cfg, entries)}
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
        return {**headline(tables["retrieval"], s.depths[-1]), **gpa_vs_pairwise(cfg, entries, last[0]),
                "gpa_iterations": float(space.fit.iterations),
                "dim_effective": float(space.reductions[0].basis.shape[1]),
                "n_models": float(len(entries)), "n_sentences": float(len(sides[0].sentences))}

    tags = models_tags(cfg, s, "shared_space", labels)
    return run_once(cfg, JobSpec(f"shared_space {len(labels)} models", tags, task="shared_space", keys=SPACE_KEYS,
                                 reads=tuple(refs), extra={"evidence": 2, **one_forward.identity(cfg)}), body, overrides)  # 2: the D sweep's intervals


ROUTING_KEYS = ["data", "represent.max_length", "represent.padding_side", "shared"]


def score_all(cfg, entries, refs, sides) -> list[Scores]:
    """Every sentence under every model (:mod:`mergescope.scoring.bpb`)."""
    if one_forward.enabled(cfg):  # the scores of the study's one forward (its states serve the space)
        return [one_forward.one_forward(cfg, e, r, side)[0] for e, r, side in zip(entries, refs, sides)]
    out = []
    for e, r, side in zip(entries, refs, sides):
        lm = models.load(precision.forward_entry(cfg, e), cfg.device, ref=r)
        with precision.active(cfg):
            out.append(score_sentences(lm.model, lm.tokenizer, side.sentences, cfg.represent.batch_tokens,
                                       int(cfg.represent.max_length)))
        del lm  # released before the next model loads: one model in memory at a time
    return out


def run_routing(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    s, entries, refs, sides, labels = prepare(cfg)

    def body(job) -> dict[str, float]:
        scores = score_all(cfg, entries, refs, sides)
        bits = np.stack([sc.nll / LN2 for sc in scores], axis=1)
        nbytes = np.stack([sc.bytes for sc in scores], axis=1)
        bpb = bits / nbytes  # each sentence's own, for the table
        main = s.pooling
        Xs = [r[main][-1] for r in final_layers(cfg, s, entries, refs, sides)]
        doms = domains(cfg.data, str(entries[0].lang), bpb.shape[0])
        docs, what = documents(cfg.data, str(entries[0].lang), bpb.shape[0])
        picks = route(bits, nbytes, Xs, doms, s.dim, s.folds, s.knn, s.seed)
        out = {**summarise(bits, nbytes, picks), **gain_intervals(bits, nbytes, picks, docs, what)}
        # the same without each sentence's first token (which model is "always best" can depend on it)
        rest = [sc.rest() for sc in scores]
        bits_r, nbytes_r = np.stack([sc.nll / LN2 for sc in rest], axis=1), np.stack([sc.bytes for sc in rest], axis=1)
        picks_r = route(bits_r, nbytes_r, Xs, doms, s.dim, s.folds, s.knn, s.seed)
        out.update({f"{k}_rest": v for k, v in summarise(bits_r, nbytes_r, picks_r).items()})
        out.update(gain_intervals(bits_r, nbytes_r, picks_r, docs, what, "_rest"))
        out.update({f"always_best_model{sfx}": float(np.bincount(p["always_best"]).argmax())
                    for sfx, p in (("", picks), ("_rest", picks_r))})
        for i, (b, br) in enumerate(zip(pooled(bits, nbytes), pooled(bits_r, nbytes_r))):
            out[f"bpb_model_{i}"], out[f"bpb_rest_model_{i}"] = float(b), float(br)
            out[f"first_token_bits_model_{i}"] = float(scores[i].first_nll.mean() / LN2)
            out[f"truncated_model_{i}"] = float(scores[i].n_truncated)
            out[f"oracle_share_model_{i}"] = float(np.mean(picks["oracle"] == i))
        rows = [{"sentence": n, "domain": (doms or [""] * len(bpb))[n], **{f"bpb_{lab}": float(bpb[n, i]) for i, lab in enumerate(labels)},
                 **{f"pick_{k}": labels[int(v[n])] for k, v in picks.items()}} for n in range(bpb.shape[0])]
        with tempfile.TemporaryDirectory() as d:
            write_csv(rows, Path(d) / "routing_sentences.csv")
            job.log_artifacts(d, "tables")
        job.log_params({"models": labels, "domains": sorted(set(doms or []))})
        return out

    tags = models_tags(cfg, s, "routing", labels)
    return run_once(cfg, JobSpec(f"routing {len(labels)} models", tags, task="routing", keys=ROUTING_KEYS, reads=tuple(refs),
                                 extra={"evidence": 1, **one_forward.identity(cfg)}), body, overrides)
