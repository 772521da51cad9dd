"""Sections on representations across models: the last-layer CKA matrix with its shuffled control (3) and the
cross-model diagnostic matrix (4)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mergescope.analysis.context import Analysis
from mergescope.analysis.tables import TYPOLOGY, RTable, Section, csv_text, f3, median, repr_metrics, short
from mergescope.plotting import pyplot

__all__ = ["cka_section", "one_language_section", "pair_matrix", "figure_cka", "representation_table"]


def cka_section(an: Analysis, number: str) -> Section:
    """3. The last-layer CKA matrix: lower triangle matched, upper triangle the shuffled control."""
    sec = Section("cka", f"{number}. Last-layer CKA: matched (lower triangle) vs shuffled control (upper triangle)")
    M, models = an.cka_matrix, an.models
    rows = [[m, *["—" if np.isnan(M[i, j]) else (f"*{M[i, j]:.3f}*" if j > i else f"{M[i, j]:.3f}") for j in range(len(models))]]
            for i, m in enumerate(models)]
    cka_recs = [p["recs"]["cka"] for p in an.pairs if "cka" in p["recs"]]
    n_above = sum(1 for r in cka_recs if above_null(r, "cka"))
    an.metrics.update({"pairs_cka": float(len(cka_recs)), "pairs_cka_above_shuffled": float(n_above)})
    if cka_recs:
        mm = [r.m("cka") for r in cka_recs]
        ss = [r.m("cka_shuffled") for r in cka_recs]
        cc = [r.m("cka_calibrated") for r in cka_recs]
        cal = (f"; calibrated against its permutation null (0 = no more than unrelated features of this n and width give) "
               f"{np.nanmin(cc):.3f}-{np.nanmax(cc):.3f} (median {median(cc):.3f})" if np.isfinite(cc).any() else
               "; not calibrated (runs recorded before control.calibration_permutations)")
        sec.text.append(f"Matched CKA is above its permutation null (p <= alpha, the calibrated score above 0) for {n_above} "
                        f"of {len(cka_recs)} pairs: matched {min(mm):.3f}-{max(mm):.3f} (median {median(mm):.3f}) raw, against "
                        f"shuffled {min(ss):.3f}-{max(ss):.3f}{cal}.")
        sec.finding = sec.text[-1]
        sec.tables.append(RTable("CKA matrix (lower = matched, upper italic = shuffled)", ["", *models], rows,
                                 note="Runs: " + "; ".join(f"{r.tags['pair']} {short(r.run_id)}" for r in cka_recs)))
        sec.tables.append(calibrated_table(cka_recs, "cka"))
        sec.add_figure("cka_matched_vs_shuffled", "matched vs shuffled last-layer CKA",
                       lambda: figure_cka(an.cka_matrix, an.models, an.pairs))
    else:
        sec.missing.append("CKA matrix: not measured (no kind=measure metric=cka runs on cross-model pairs)")
    plain_rows = [[m, *["" if np.isnan(M[i, j]) else f"{M[i, j]:.3f}" for j in range(len(models))]] for i, m in enumerate(models)]
    an.console_tables.append(RTable("Last-layer CKA: lower = matched, upper = shuffled control", ["", *models], plain_rows))
    an.csv["tables/cka_matrix.csv"] = csv_text(["", *models], [[m, *["" if np.isnan(v) else f"{v:.6f}" for v in M[i]]]
                                                             for i, m in enumerate(models)])
    return sec


def above_null(r, key: str) -> bool:
    """The matched value clears its permutation null: calibrated score above 0 (p <= the calibration's alpha); a run
    recorded without calibration never counts."""
    v = r.m(f"{key}_calibrated")
    return bool(np.isfinite(v) and v > 0)


def calibrated_table(recs, key: str) -> RTable:
    """Per pair: the raw value (with its jackknife interval where the metric has one), the shuffled control (mean ± sd
    over its seeds), the calibrated score, its permutation p and the null threshold tau."""
    def raw(r):
        lo, hi = r.m(f"{key}_ci_low"), r.m(f"{key}_ci_high")
        return f"{r.m(key):.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if np.isfinite(lo) and np.isfinite(hi) else "")

    rows = [[r.tags.get("pair", "?"), f"{int(r.m('n_sentences'))}" if np.isfinite(r.m("n_sentences")) else "—", raw(r),
             f"{r.m(key + '_shuffled'):.3f} ± {r.m(key + '_shuffled_sd'):.3f}" if np.isfinite(r.m(key + "_shuffled")) else "—",
             f3(r.m(f"{key}_calibrated"), 3), f3(r.m(f"{key}_cal_p"), 4), f3(r.m(f"{key}_cal_tau"), 3), short(r.run_id)]
            for r in sorted(recs, key=lambda r: r.tags.get("pair", ""))]
    return RTable(f"{key}: raw, shuffled control and calibrated", ["pair", "n", f"{key} [95% CI]", "shuffled (mean ± sd)",
                                                                  "calibrated", "p (permutation)", "tau", "run"], rows,
                  note="calibrated = clip((raw - tau) / (1 - tau), 0, 1), tau the (1 - alpha) order statistic of the raw value "
                       "and its permutation null (control.calibration_permutations row permutations of side B, alpha = "
                       "control.calibration_alpha; the method of calibrated-similarity, Groeger et al. 2026): 0 = no more "
                       "alignment than unrelated features of this n and width give, so n = 96, n = 1012 and the toys read on "
                       "one scale. The interval of the raw value is its 50-block jackknife.")


def _cka_range(recs) -> str:
    mm, ss = [r.m("cka") for r in recs], [r.m("cka_shuffled") for r in recs]
    return (f"matched {min(mm):.3f}-{max(mm):.3f} (median {median(mm):.3f}) against shuffled {min(ss):.3f}-{max(ss):.3f}, "
            f"above it for {sum(1 for r in recs if r.m('cka') > r.m('cka_shuffled'))} of {len(recs)} pairs")


def one_language_section(an: Analysis, number: str) -> Section | None:
    """3a. The one-language protocol (a study's ``one_language``: every pair with both sides on one language, as the
    shared-space paper reads its models) beside the study's own protocol (each model on its own language side). None
    when the study has no such runs."""
    from mergescope.analysis.pairs import measure_rows

    runs = an.study.one_language
    if not runs:
        return None
    _, rows = measure_rows(runs)
    pairs = list(rows.values())
    langs = sorted({str(r.tags.get("lang_a")) for r in runs} | {str(r.tags.get("lang_b")) for r in runs})
    sec = Section("one_language", f"{number}. The same pairs with both sides on one language ({', '.join(langs)})")
    sec.tables.append(representation_table(pairs))
    sec.tables[-1].title = "One language: representation metrics, matched / shuffled control (mean ± sd over the control's seeds)"
    an.csv["tables/one_language.csv"] = sec.tables[-1].csv()
    one = [p["recs"]["cka"] for p in pairs if "cka" in p["recs"]]
    own = {p["pair"]: p["recs"]["cka"] for p in an.pairs if "cka" in p["recs"]}
    if one:
        sec.text.append(f"Last-layer CKA on one language: {_cka_range(one)}" + (
            f"; on each model's own language (section 3): {_cka_range(list(own.values()))}." if own else "."))
        both = [(r.m("cka"), own[r.tags["pair"]].m("cka")) for r in one if r.tags["pair"] in own]
        if both:
            d = [a - b for a, b in both]
            sec.text.append(f"One language minus own languages, per pair: median {median(d):+.3f} (range {min(d):+.3f} to "
                            f"{max(d):+.3f}, {len(d)} pairs): how much of the alignment the shared language alone carries.")
        sec.finding = sec.text[0]
    return sec


def _with_sd(v: dict[str, Any], key: str) -> str:
    """A replicated value as ``mean ± sd`` (the sd over the control's seeds), a single one as it is."""
    sd = v.get(key + "_sd")
    return f"{f3(v.get(key))} ± {f3(sd)}" if sd is not None and np.isfinite(sd) and sd > 0 else f3(v.get(key))


def representation_table(pairs: list[dict[str, Any]]) -> RTable:
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


def _pair_matrix_missing(an: Analysis, sec: Section) -> None:
    pairs = an.pairs
    if pairs and not any(p["typology"] for p in pairs):
        sec.missing.append("typology: not measured (no kind=typology runs; python launch.py task=typology pair=<pair>)")
    if pairs and not any(p["native"] for p in pairs):
        sec.missing.append("weight-space columns: not measured (no cross-model pair shares a parameter space, or no native run)")
    elif pairs:
        sec.text.append("Weight-space columns are blank where the pair has no shared parameter space (see the coverage table): "
                        "the quantity does not exist there.")
    if pairs and not an.study.kind("transport"):
        sec.missing.append("transport columns: not measured (no kind=transport runs in this experiment)")
    if pairs and not an.study.adapt:
        sec.missing.append("post-fusion adaptation columns: not measured (no kind=transport_adapt runs in this experiment)")
    if not pairs:
        sec.missing.append("pair matrix: not measured (no cross-model measure runs)")


def pair_matrix(an: Analysis, number: str) -> Section:
    """4. The cross-model diagnostic matrix: representation metrics with controls, NLL, typology, weights, transport."""
    sec = Section("pairs", f"{number}. The cross-model diagnostic matrix")
    metric_cols = [k for _, k in repr_metrics(an.pairs)]
    rep = representation_table(an.pairs)
    sec.tables += [rep, _quality_table(an.pairs)]  # three narrow tables, not one of 17 columns
    if any(p["src"].get("native_weight_cosine") for p in an.pairs):
        sec.tables.append(_weight_table(an.pairs))
    sec.tables.append(_transport_table(an.pairs))
    _pair_matrix_missing(an, sec)
    k = 1 + len(metric_cols)
    an.console_tables.append(RTable("Matched / shuffled, every metric", ["pair", *metric_cols], [r[:k] for r in rep.rows]))
    an.csv["tables/pairs_matched_shuffled.csv"] = csv_text(["pair", *metric_cols], [[r[0], *r[1:k]] for r in rep.rows])
    keys = sorted({k for p in an.pairs for k in p["values"]})
    an.csv["tables/pair_matrix.csv"] = csv_text(
        ["pair", "model_a", "model_b", *keys, *[f"run_id.{k}" for k in keys]],
        [[p["pair"], p["a"], p["b"], *[p["values"].get(k, "") for k in keys], *[p["src"].get(k) or "" for k in keys]] for p in an.pairs])
    return sec




def _cka_heatmap(fig, ax, M: np.ndarray, models: list[str]) -> None:
    k = len(models)
    im = ax.imshow(np.nan_to_num(M, nan=0.0), vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks(range(k), models, rotation=40, ha="right")
    ax.set_yticks(range(k), models)
    for i in range(k):
        for j in range(k):
            if not np.isnan(M[i, j]):
                ax.text(j, i, f"{M[i, j]:.2f}", ha="center", va="center", color="w" if M[i, j] < 0.5 else "k", fontsize=9)
    ax.set_title("CKA: matched (lower) vs shuffled (upper)")
    fig.colorbar(im, ax=ax, fraction=0.046)


def figure_cka(M: np.ndarray, models: list[str], pairs: list[dict[str, Any]]):
    plt = pyplot()
    k = len(models)
    fig, axes = plt.subplots(1, 2, figsize=(1.2 * k + 9, 1.0 * k + 2.5), gridspec_kw={"width_ratios": [1.1, 1]})
    _cka_heatmap(fig, axes[0], M, models)
    ax = axes[1]
    ps = [p for p in pairs if "cka" in p["values"]]
    y = np.arange(len(ps))
    mv = np.array([p["values"]["cka"] for p in ps])
    sv = np.array([p["values"].get("cka_shuffled", np.nan) for p in ps])
    lo = np.array([p["values"].get("cka_ci_low", np.nan) for p in ps])
    hi = np.array([p["values"].get("cka_ci_high", np.nan) for p in ps])
    ax.errorbar(mv, y, xerr=np.vstack([mv - lo, hi - mv]) if np.all(np.isfinite(lo)) else None, fmt="o", label="matched (95% CI)")
    sd = np.array([p["values"].get("cka_shuffled_sd", 0.0) for p in ps])
    ax.errorbar(sv, y, xerr=sd if np.any(sd > 0) else None, fmt="x", color="gray", label="shuffled control (± sd over seeds)")
    ax.set_yticks(y, [p["pair"].replace("__", " x ") for p in ps], fontsize=8)
    ax.set_xlabel("linear CKA, last layer")
    ax.set_xlim(left=0)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("per pair")
    fig.tight_layout()
    return fig

