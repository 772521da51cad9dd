"""The report's sections on the study's models and cross-model pairs (spec sections 1 to 4a).

Each section builder takes the shared :class:`Build` (the study, its pair rows and CKA matrix) and
returns one :class:`~mergescope.analysis.tables.Section`; it may add CSV tables, console tables and run
metrics to the build. The arms (5 to 7) are in :mod:`mergescope.analysis.arms`, the correlation tables
(8) in :mod:`mergescope.analysis.correlations`, the driver in :mod:`mergescope.analysis.build`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mergescope.analysis.pairs import build_pair_rows, cka_matrix
from mergescope.analysis.records import Rec, Study, base_name, is_checkpoint_pair
from mergescope.analysis.tables import TYPOLOGY, RTable, Section, csv_text, f3, median, repr_metrics, short

__all__ = ["Build", "config_check", "coverage", "cka_section", "pair_matrix", "per_model_quality", "TRUE_KEYS", "ZOO_DECLARED"]

TRUE_KEYS = ["model_type", "hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "tied_embeddings", "n_params"]
# zoo config key -> true-config key (what each zoo model was declared to be)
ZOO_DECLARED = {"hidden_size": "hidden", "num_hidden_layers": "layers", "num_attention_heads": "heads",
                "num_key_value_heads": "kv_heads", "intermediate_size": "ffn", "vocab_size": "vocab"}
ROUTES = ("native", "transport", "adapt")


def true_configs(study: Study) -> dict[str, tuple[dict[str, Any], str]]:
    """model label -> (its true config as logged, the run that logged it): quality runs first, then measure runs."""
    true_cfg: dict[str, tuple[dict[str, Any], str]] = {}
    for r in study.kind("quality"):
        if r.group("model.true"):
            true_cfg[r.tags["model"]] = (r.group("model.true"), r.run_id)
    for r in study.measures + study.native:
        for side in ("a", "b"):
            lab = r.tags.get(f"model_{side}")
            if lab and lab not in true_cfg and r.group(f"model_{side}.true"):
                true_cfg[lab] = (r.group(f"model_{side}.true"), r.run_id)
    return true_cfg


@dataclass
class Build:
    """What the section builders share, and what they add to (CSV tables, console tables, run metrics)."""

    study: Study
    models: list[str]
    pairs: list[dict[str, Any]]
    cka: np.ndarray
    quality: dict[str, Rec]
    train: dict[str, Rec]
    true_cfg: dict[str, tuple[dict[str, Any], str]]
    checkpoint: list[Rec]  # checkpoint-pair native runs, by run then trajectory distance
    csv: dict[str, str] = field(default_factory=dict)
    console_tables: list[RTable] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    frames: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # arm -> diagnostic -> one value per row
    correlations: dict[str, Any] = field(default_factory=dict)  # arm -> correlation table, arm_power -> power statement

    @classmethod
    def of(cls, study: Study) -> Build:
        models, pairs = build_pair_rows(study)
        M, _ = cka_matrix([r for r in study.measures if not is_checkpoint_pair(r)], models)
        ck = [r for r in study.native if is_checkpoint_pair(r)]
        ck.sort(key=lambda r: (base_name(r.tags.get("model_a", "")), r.m("log10_step_ratio")))
        return cls(study, models, pairs, M, {r.tags.get("model"): r for r in study.kind("quality")},
                   {r.tags.get("model"): r for r in study.kind("train")}, true_configs(study), ck)


def _config_check(tc: dict[str, Any], declared: dict[str, Any]) -> str:
    if not tc:
        return "not measured (no run logged this model's true config)"
    if not declared:
        return "hub model: the true config is what its checkpoint states"
    diffs = [f"{tk} {tc.get(tk)} vs declared {declared[zk]}" for zk, tk in ZOO_DECLARED.items()
             if zk in declared and declared[zk] is not None and tc.get(tk) != declared[zk]]
    fam = declared.get("family")
    if fam and tc.get("model_type") != fam:
        diffs.insert(0, f"model_type {tc.get('model_type')} vs declared {fam}")
    return "matches its declared zoo config" if not diffs else "DIFFERS: " + "; ".join(diffs)


def config_check(b: Build) -> Section:
    """1. Each model's true config as logged, checked against the zoo config it was declared with."""
    sec = Section("config", "1. Config check: the models as actually configured")
    rows = []
    for m in b.models:
        tc, rid = b.true_cfg.get(m, ({}, None))
        q = b.quality.get(m)
        declared = (q or b.train.get(m)).group("model.zoo") if (q or b.train.get(m)) else {}
        rows.append([m, *(f"{tc[k]:,}" if isinstance(tc.get(k), int) and not isinstance(tc.get(k), bool)
                          else str(tc.get(k, "—")) for k in TRUE_KEYS), _config_check(tc, declared), short(rid)])
    sec.text.append("Each model's true configuration as logged by its runs (params `model.true.*`, from the loaded "
                    "checkpoint's config, not the model card), checked against what the study declared for it.")
    sec.tables.append(RTable("True configs", ["model", *TRUE_KEYS, "check", "run"], rows))
    if not b.models:
        sec.missing.append("config check: not measured (no cross-model measure runs in the experiment)")
    return sec


def _pair_routes(b: Build, p: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The pair's routes: from its native run's logged ``routes``, else computed on the logged true configs."""
    n = p["native"]
    if n is not None and n.group("routes"):
        rt = {k: {kk: n.param(f"routes.{k}.{kk}") for kk in ("defined", "scope", "blocked_by", "note")} for k in ROUTES}
        return rt, f"native run {short(n.run_id)}"
    ta, ra = b.true_cfg.get(p["a"], ({}, None))
    tb, rb = b.true_cfg.get(p["b"], ({}, None))
    if ta and tb:
        from mergescope.native.weights import routes

        return routes(ta, tb), f"weights.routes on true configs of runs {short(ra)}, {short(rb)}"
    return None, ""


def _route_cell(b: Build, p: dict[str, Any], route: str, r: dict[str, Any]) -> str:
    if not r["defined"]:
        return f"no: {r['blocked_by']}"
    if route == "native":
        done = "measured" if p["native"] is not None else "not measured (no native run)"
    elif route == "transport":
        k = sum(1 for t in b.study.kind("transport") if {t.tags.get("target"), t.tags.get("donor")} == {p["a"], p["b"]})
        done = f"measured ({k} runs)" if k else "not measured (no transport runs)"
    else:
        k = sum(1 for t in b.study.kind("adapt") if {t.tags.get("small"), t.tags.get("large")} == {p["a"], p["b"]})
        done = f"measured ({k} runs)" if k else "not measured (no adapt runs for this pair; study=adapt runs the scale family)"
    return f"yes ({r.get('scope') or 'all tensors'}); {done}"


def coverage(b: Build) -> Section:
    """2. Which routes (native, transport, adapt) are defined for each pair, and what blocks the rest."""
    sec = Section("coverage", "2. Coverage: which routes are defined for each pair, and what blocks the rest")
    rows = []
    for p in b.pairs:
        rt, source = _pair_routes(b, p)
        cells = ["not measured (no true config logged)" if rt is None else _route_cell(b, p, route, rt[route]) for route in ROUTES]
        rows.append([p["pair"], *cells, source])
    sec.text.append("Routes: native = elementwise operators on aligned tensors (shared parameter space); transport = "
                    "OT fusion (Cui et al.), directional and rectangular; adapt = Expand/Truncate then weighted "
                    "averaging (same architecture family; Truncate slices the larger model into the smaller shape, Expand zero-pads or "
                    "repeats the smaller). Native and transport pad and truncate nothing (plans are rectangular).")
    sec.tables.append(RTable("Coverage", ["pair", "native", "transport", "adapt", "source"], rows))
    if not b.pairs:
        sec.missing.append("coverage: not measured (no cross-model pairs in the experiment)")
    b.console_tables.append(sec.tables[0])
    return sec


def cka_section(b: Build) -> Section:
    """3. The last-layer CKA matrix: lower triangle matched, upper triangle the shuffled control."""
    sec = Section("cka", "3. Last-layer CKA: matched (lower triangle) vs shuffled control (upper triangle)")
    M, models = b.cka, b.models
    rows = [[m, *["—" if np.isnan(M[i, j]) else (f"*{M[i, j]:.3f}*" if j > i else f"{M[i, j]:.3f}") for j in range(len(models))]]
            for i, m in enumerate(models)]
    cka_recs = [p["recs"]["cka"] for p in b.pairs if "cka" in p["recs"]]
    n_above = sum(1 for r in cka_recs if r.m("cka") > r.m("cka_shuffled"))
    b.metrics.update({"pairs_cka": float(len(cka_recs)), "pairs_cka_above_shuffled": float(n_above)})
    if cka_recs:
        mm = [r.m("cka") for r in cka_recs]
        ss = [r.m("cka_shuffled") for r in cka_recs]
        sec.text.append(f"Matched CKA is above its shuffled control for {n_above} of {len(cka_recs)} pairs: matched "
                        f"{min(mm):.3f}-{max(mm):.3f} (median {median(mm):.3f}) against shuffled {min(ss):.3f}-{max(ss):.3f}.")
        sec.finding = sec.text[-1]
        sec.tables.append(RTable("CKA matrix (lower = matched, upper italic = shuffled)", ["", *models], rows,
                                 note="Runs: " + "; ".join(f"{r.tags['pair']} {short(r.run_id)}" for r in cka_recs)))
        sec.figures.append(("cka_matched_vs_shuffled", "matched vs shuffled last-layer CKA"))
    else:
        sec.missing.append("CKA matrix: not measured (no kind=measure metric=cka runs on cross-model pairs)")
    plain_rows = [[m, *["" if np.isnan(M[i, j]) else f"{M[i, j]:.3f}" for j in range(len(models))]] for i, m in enumerate(models)]
    b.console_tables.append(RTable("Last-layer CKA: lower = matched, upper = shuffled control", ["", *models], plain_rows))
    b.csv["tables/cka_matrix.csv"] = csv_text(["", *models], [[m, *["" if np.isnan(v) else f"{v:.6f}" for v in M[i]]]
                                                             for i, m in enumerate(models)])
    return sec


def _with_sd(v: dict[str, Any], key: str) -> str:
    """A replicated value as ``mean ± sd`` (the sd over the control's seeds), a single one as it is."""
    sd = v.get(key + "_sd")
    return f"{f3(v.get(key))} ± {f3(sd)}" if sd is not None and np.isfinite(sd) and sd > 0 else f3(v.get(key))


def _representation_table(pairs: list[dict[str, Any]]) -> RTable:
    metrics = repr_metrics(pairs)
    metric_cols = [k for _, k in metrics]
    rows = []
    for p in pairs:
        v = p["values"]
        cells = [f"{f3(v.get(c))} / {_with_sd(v, c + '_shuffled')}" if c in v else "—" for c in metric_cols]
        ci = f"[{f3(v.get('cka_ci_low'))}, {f3(v.get('cka_ci_high'))}]" if "cka_ci_low" in v else "—"
        chance = f3(v.get("retrieval_chance"), 4) if "retrieval_chance" in v else "—"
        ids = " ".join(short(p["recs"][m].run_id) if m in p["recs"] else "—" for m, _ in metrics)
        rows.append([p["pair"], *cells, ci, chance, ids])
    return RTable("Representation metrics, matched / shuffled control (mean ± sd over the control's seeds)",
                  ["pair", *metric_cols, "cka 95% CI", "retrieval chance", "runs"], rows,
                  note="runs: one per metric, in the order of the metric columns")


def _runs_cell(p: dict[str, Any], sources: tuple[tuple[str, str], ...]) -> str:
    """The run ids a row's cells come from, labelled (``label id``), in one compact cell."""
    return ", ".join(f"{lab} {short(p['src'][k])}" for lab, k in sources if p["src"].get(k))


_QUALITY_SOURCES = (("nll_a", "nll_a"), ("nll_b", "nll_b"), ("typology", "typology_syntactic"))
_TRANSPORT_SOURCES = (("a<-b", "transport_delta_a"), ("b<-a", "transport_delta_b"), ("adapt a<-b", "adapt_effect_a"),
                      ("adapt b<-a", "adapt_effect_b"))


def _quality_table(pairs: list[dict[str, Any]]) -> RTable:
    rows = [[p["pair"], f3(p["values"]["nll_a"]), f3(p["values"]["nll_b"]), *[f3(p["values"][k]) for k in TYPOLOGY],
             _runs_cell(p, _QUALITY_SOURCES)] for p in pairs]
    return RTable("Quality and typology per pair", ["pair", "nll_a", "nll_b", "typ_syntactic", "typ_genetic",
                                                     "typ_featural", "runs"], rows,
                  note="nll_* = mean per-token NLL of each model on its own FLORES side (quality runs). "
                       "typ_* = URIEL cosine distances (lang2vec: syntax_knn / fam / syntax+phonology+inventory knn).")


def _weight_table(pairs: list[dict[str, Any]]) -> RTable:
    rows = [[p["pair"], *[f3(p["values"][f"native_{k}"]) for k in ("weight_cosine", "relative_l2", "norm_ratio", "lmc_barrier")],
             short(p["src"].get("native_weight_cosine"))] for p in pairs if p["src"].get("native_weight_cosine")]
    return RTable("Weight space per pair (the pairs with a native route)", ["pair", "weight_cosine", "relative_l2",
                                                                            "norm_ratio", "lmc_barrier", "native run"], rows,
                  note="only pairs that share a parameter space (the coverage table): elsewhere the quantity does not exist")


def _transport_table(pairs: list[dict[str, Any]]) -> RTable:
    rows = [[p["pair"], *[f3(p["values"][f"{k}_{side}"], 4) for k in ("transport_delta", "transport_ot_minus_rand", "adapt_effect")
                          for side in "ab"], _runs_cell(p, _TRANSPORT_SOURCES)] for p in pairs]
    return RTable("Transport and post-fusion adaptation per pair", [
        "pair", "delta a<-b", "delta b<-a", "ot_minus_rand a<-b", "ot_minus_rand b<-a", "adapt_effect a<-b",
        "adapt_effect b<-a", "runs"], rows,
        note="delta = fused minus unfused NLL on the target's language at the headline alpha, merge.headline_alpha "
             "(negative = helped); ot_minus_rand < 0 = the OT plan beat its shuffled-plan control; adapt_effect = "
             "fused-then-adapted minus adapted baseline.")


def _pair_matrix_missing(b: Build, sec: Section) -> None:
    pairs = b.pairs
    if pairs and not any(p["typology"] for p in pairs):
        sec.missing.append("typology: not measured (no kind=typology runs; python launch.py task=typology pair=<pair>)")
    if pairs and not any(p["native"] for p in pairs):
        sec.missing.append("weight-space columns: not measured (no cross-model pair shares a parameter space, or no native run)")
    elif pairs:
        sec.text.append("Weight-space columns are blank where the pair has no shared parameter space (see the coverage table): "
                        "the quantity does not exist there.")
    if pairs and not b.study.kind("transport"):
        sec.missing.append("transport columns: not measured (no kind=transport runs in this experiment)")
    if pairs and not b.study.adapt:
        sec.missing.append("post-fusion adaptation columns: not measured (no kind=transport_adapt runs in this experiment)")
    if not pairs:
        sec.missing.append("pair matrix: not measured (no cross-model measure runs)")


def pair_matrix(b: Build) -> Section:
    """4. The cross-model diagnostic matrix: representation metrics with controls, NLL, typology, weights, transport."""
    sec = Section("pairs", "4. The cross-model diagnostic matrix")
    metric_cols = [k for _, k in repr_metrics(b.pairs)]
    rep = _representation_table(b.pairs)
    sec.tables += [rep, _quality_table(b.pairs)]  # three narrow tables, not one of 17 columns
    if any(p["src"].get("native_weight_cosine") for p in b.pairs):
        sec.tables.append(_weight_table(b.pairs))
    sec.tables.append(_transport_table(b.pairs))
    _pair_matrix_missing(b, sec)
    k = 1 + len(metric_cols)
    b.console_tables.append(RTable("Matched / shuffled, every metric", ["pair", *metric_cols], [r[:k] for r in rep.rows]))
    b.csv["tables/pairs_matched_shuffled.csv"] = csv_text(["pair", *metric_cols], [[r[0], *r[1:k]] for r in rep.rows])
    keys = sorted({k for p in b.pairs for k in p["values"]})
    b.csv["tables/pair_matrix.csv"] = csv_text(
        ["pair", "model_a", "model_b", *keys, *[f"run_id.{k}" for k in keys]],
        [[p["pair"], p["a"], p["b"], *[p["values"].get(k, "") for k in keys], *[p["src"].get(k) or "" for k in keys]] for p in b.pairs])
    return sec


def per_model_quality(b: Build) -> Section:
    """4a. Each model's NLL on its own FLORES side, and the zoo's held-out and unigram NLL."""
    sec = Section("quality", "4a. Per-model quality (mean per-token NLL on the model's own FLORES side)")
    rows = []
    for m in b.models:
        q, t = b.quality.get(m), b.train.get(m)
        rows.append([m, q.tags.get("lang", "") if q else "", f3(q.m("nll")) if q else "—", short(q.run_id) if q else "",
                     f3(t.m("heldout_nll")) if t else "—", f3(t.m("unigram_nll")) if t else "—", short(t.run_id) if t else ""])
        if q is None:
            sec.missing.append(f"{m}: FLORES NLL not measured (no kind=quality run)")
    sec.tables.append(RTable("Per-model quality (nats/token)", ["model", "lang", "FLORES nll", "run", "held-out nll (train text)",
                                                                "unigram nll", "train run"], rows,
                             note="Held-out and unigram NLL exist only for zoo models trained here (kind=train)."))
    b.console_tables.append(sec.tables[0])
    return sec
