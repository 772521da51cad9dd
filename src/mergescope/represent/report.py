"""The representation arm in the report: the pair rows it creates (its metrics with their controls, each side's NLL,
the typology), the last-layer CKA matrix with its shuffled control, the one-language protocol, its tables of the
cross-model diagnostic matrix, each model's quality and its rows beside the spec documents."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mergescope.analysis.context import Analysis
from mergescope.analysis.pairs import new_row, put
from mergescope.analysis.records import Rec, Study, is_checkpoint_pair
from mergescope.analysis.tables import TYPOLOGY, RTable, Section, csv_text, f3, median, repr_metrics, runs_cell, short
from mergescope.plotting import pyplot

__all__ = ["cka_section", "one_language_section", "pair_rows", "pair_tables", "figure_cka", "representation_table", "cka_matrix", "measure_rows"]


def measures(study: Study) -> list[Rec]:
    """The representation runs of the study's own protocol (each side on its model's language); the one-language
    protocol's runs (tag protocol=one_language) are :func:`one_language` and never join these; the native arm's
    runs (kind=measure, metric=native) are its own."""
    return [r for r in study.kind("measure") if r.tags.get("metric") != "native" and r.tags.get("protocol") != "one_language"]


def one_language(study: Study) -> list[Rec]:
    """The one-language protocol's representation runs (every side on one language: the study's ``one_language``)."""
    return [r for r in study.kind("measure") if r.tags.get("metric") != "native" and r.tags.get("protocol") == "one_language"]


def measure_key(r: Rec) -> tuple:
    """One job per pair and metric (a native pair with and without a vocabulary transplant: two; each protocol's
    languages apart)."""
    t = r.tags
    return (r.kind, t.get("pair"), t.get("metric"), t.get("transplant"), t.get("lang_a"), t.get("lang_b"), t.get("protocol"))


def model_key(r: Rec) -> tuple:
    return (r.kind, r.tags.get("model"))


def typology_key(r: Rec) -> tuple:
    return (r.kind, frozenset((r.tags.get("lang_a"), r.tags.get("lang_b"))))


def cka_matrix(measures: list[Rec], models: list[str]) -> tuple[np.ndarray, dict[tuple[int, int], str]]:
    """Lower triangle matched CKA, upper triangle the shuffled control, diagonal NaN (spec section 3);
    and the run id behind each cell."""
    idx = {m: i for i, m in enumerate(models)}
    M = np.full((len(models), len(models)), np.nan)
    ids: dict[tuple[int, int], str] = {}
    for r in measures:
        if r.tags.get("metric") != "cka" or r.tags.get("model_a") not in idx or r.tags.get("model_b") not in idx:
            continue
        i, j = idx[r.tags["model_a"]], idx[r.tags["model_b"]]
        lo, hi = max(i, j), min(i, j)
        M[lo, hi], M[hi, lo] = r.m("cka"), r.m("cka_shuffled")
        ids[(lo, hi)] = ids[(hi, lo)] = r.run_id
    return M, ids



def _typology_for(study: Study, la: str, lb: str) -> Rec | None:
    key = frozenset((la, lb))
    return next((r for r in reversed(study.kind("typology")) if frozenset((r.tags.get("lang_a"), r.tags.get("lang_b"))) == key), None)



def measure_rows(measures: list[Rec]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """The pairs (and models) in study order, with every representation metric the measure runs logged."""
    pairs: dict[str, dict[str, Any]] = {}
    models: list[str] = []
    for r in measures:
        p = pairs.get(r.tags["pair"]) or pairs.setdefault(r.tags["pair"], new_row(
            r.tags["pair"], r.tags["model_a"], r.tags["model_b"], r.tags.get("lang_a"), r.tags.get("lang_b")))
        for m in (r.tags["model_a"], r.tags["model_b"]):
            if m not in models:
                models.append(m)
        p["recs"][r.tags["metric"]] = r
        for k, v in r.metrics.items():
            if k.startswith(("n_sentences", "dim_")):
                continue
            p["values"][k] = float(v)
            p["src"][k] = r.run_id
    return models, pairs



def pair_rows(an: Analysis, rows: dict[str, dict[str, Any]], others: dict[str, dict[str, Any]]) -> None:
    """The cross-model pair rows from the study's measure runs (checkpoint pairs apart), with every representation
    metric, each side's NLL on its own language (quality runs) and the pair's typology; the CKA matrix of section 3."""
    study = an.study
    runs = [r for r in measures(study) if not is_checkpoint_pair(r)]
    models, pairs = measure_rows(runs)
    rows.update(pairs)
    an.memo["cka_matrix"] = cka_matrix(runs, models)[0]
    quality = {r.tags.get("model"): r for r in study.kind("quality")}
    for p in pairs.values():
        for side in ("a", "b"):
            put(p, f"nll_{side}", quality.get(p[side]), "nll")
        p["values"]["nll_mean"] = (p["values"]["nll_a"] + p["values"]["nll_b"]) / 2
        p["typology"] = _typology_for(study, p["lang_a"], p["lang_b"])
        for k in TYPOLOGY:
            put(p, k, p["typology"], k)


def cka_section(an: Analysis, number: str) -> Section:
    """3. The last-layer CKA matrix: lower triangle matched, upper triangle the shuffled control."""
    sec = Section("cka", f"{number}. Last-layer CKA: matched (lower triangle) vs shuffled control (upper triangle)")
    models = an.models
    M = an.memo.get("cka_matrix")
    if M is None or M.shape != (len(models), len(models)):  # the rows come from another arm: no CKA run behind them
        M = np.full((len(models), len(models)), np.nan)
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
                       lambda: figure_cka(M, an.models, an.pairs))
    else:
        sec.missing.append("CKA matrix: not measured (no kind=measure metric=cka runs on cross-model pairs)")
    plain_rows = [[m, *["" if np.isnan(M[i, j]) else f"{M[i, j]:.3f}" for j in range(len(models))]] for i, m in enumerate(models)]
    if models:  # no pairs: no matrix to print
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
    runs = one_language(an.study)
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


_QUALITY_SOURCES = (("nll_a", "nll_a"), ("nll_b", "nll_b"), ("typology", "typology_syntactic"))


def _quality_table(pairs: list[dict[str, Any]]) -> RTable:
    rows = [[p["pair"], f3(p["values"].get("nll_a")), f3(p["values"].get("nll_b")), *[f3(p["values"].get(k)) for k in TYPOLOGY],
             runs_cell(p, _QUALITY_SOURCES)] for p in pairs]
    return RTable("Quality and typology per pair", ["pair", "nll_a", "nll_b", "typ_syntactic", "typ_genetic",
                                                     "typ_featural", "runs"], rows,
                  note="nll_* = mean per-token NLL of each model on its own FLORES side (quality runs). "
                       "typ_* = URIEL cosine distances (lang2vec: syntax_knn / fam / syntax+phonology+inventory knn).")


def pair_tables(an: Analysis, sec: Section) -> None:
    """The representation arm's tables of the pair matrix: every metric matched / shuffled, then NLL and typology."""
    pairs = an.pairs
    metric_cols = [k for _, k in repr_metrics(pairs)]
    rep = representation_table(pairs)
    sec.tables += [rep, _quality_table(pairs)]  # narrow tables, not one of 17 columns
    cal = calibrated_matrix(pairs)
    if cal is not None:
        sec.tables.append(cal)
    if pairs and not any(p.get("typology") for p in pairs):
        sec.missing.append("typology: not measured (no kind=typology runs; python launch.py task=typology pair=<pair>)")
    k = 1 + len(metric_cols)
    an.console_tables.append(RTable("Matched / shuffled, every metric", ["pair", *metric_cols], [r[:k] for r in rep.rows]))
    an.csv["tables/pairs_matched_shuffled.csv"] = csv_text(["pair", *metric_cols], [[r[0], *r[1:k]] for r in rep.rows])


def calibrated_matrix(pairs: list[dict]) -> RTable | None:
    """Every metric that logs a calibrated value, per pair: the calibrated score and its permutation p (the raw
    values are the table above); None where no metric was calibrated."""
    cols = [(name, key) for name, key in repr_metrics(pairs)
            if any(name in p["recs"] and math.isfinite(p["recs"][name].m(f"{key}_calibrated")) for p in pairs)]
    if not cols:
        return None

    def cell(p, name, key):
        r = p["recs"].get(name)
        if r is None or not math.isfinite(r.m(f"{key}_calibrated")):
            return "—"
        return f"{r.m(f'{key}_calibrated'):.3f} (p {r.m(f'{key}_cal_p'):.3f})"

    rows = [[p["pair"], *[cell(p, n, k) for n, k in cols]] for p in pairs]
    return RTable("Calibrated against each metric's permutation null", ["pair", *[k for _, k in cols]], rows,
                  note="calibrated = clip((raw - tau) / (1 - tau), 0, 1), tau the (1 - alpha) order statistic of the raw "
                       "value and its permutation null (the same permutations for every metric of a pair): 0 = no more "
                       "alignment than unrelated features of this n and width give; p = the permutation p of the raw value")


def per_model_quality(an: Analysis, number: str) -> Section:
    """4a. Each model's NLL on its own FLORES side, and the zoo's held-out and unigram NLL."""
    sec = Section("quality", f"{number}. Per-model quality (mean per-token NLL on the model's own FLORES side)")
    rows = []
    for m in an.models:
        q, t = an.quality.get(m), an.train.get(m)
        rows.append([m, q.tags.get("lang", "") if q else "", f3(q.m("nll")) if q else "—", short(q.run_id) if q else "",
                     f3(t.m("heldout_nll")) if t else "—", f3(t.m("unigram_nll")) if t else "—", short(t.run_id) if t else "",
                     f3(q.m("nll_rest")) if q else "—", f3(q.m("first_token_nll"), 2) if q else "—"])
        if q is None:
            sec.missing.append(f"{m}: FLORES NLL not measured (no kind=quality run)")
    sec.tables.append(RTable("Per-model quality (nats/token)", ["model", "lang", "FLORES nll", "run", "held-out nll (train text)",
                                                                "unigram nll", "train run", "nll without the first token",
                                                                "first token (nats)"], rows,
                             note="FLORES nll: every token of each sentence, the first one predicted from the start token alone; "
                                  "without the first token: the rest (what comparisons are read on by default); first token: "
                                  "its mean cost per sentence. Held-out and unigram NLL exist only for zoo models trained here "
                                  "(kind=train)."))
    an.console_tables.append(sec.tables[0])
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


SEED_CKA = ("0.488-0.800 (median 0.587), 10 pairs of ~1B models, each on its own language, 1012 sentences",
            "crossarch-1b-diagnostics-report.txt, finding 1")
SEED_SHUFFLED = ("0.024-0.069", "crossarch-1b-diagnostics-report.txt, finding 1")
SEED_RETRIEVAL = ("up to 0.949 (chance 0.0020)", "crossarch-1b-diagnostics-report.txt, finding 1")


def _beside_cka(recs: list[Rec]) -> str:
    if not recs:
        return "not measured (no CKA runs)"
    mm = [r.m("cka") for r in recs]
    n = sorted({int(r.m("n_sentences")) for r in recs if math.isfinite(r.m("n_sentences"))})
    cc = [r.m("cka_calibrated") for r in recs if math.isfinite(r.m("cka_calibrated"))]
    cal = (f"; calibrated {min(cc):.3f}-{max(cc):.3f} (median {median(cc):.3f}), above its permutation null for "
           f"{sum(1 for c in cc if c > 0)}/{len(recs)}" if cc else "; not calibrated")
    hw = [(r.m("cka_ci_high") - r.m("cka_ci_low")) / 2 for r in recs
          if math.isfinite(r.m("cka_ci_high")) and math.isfinite(r.m("cka_ci_low"))]
    half = f"; 95% jackknife half-width {min(hw):.3f}-{max(hw):.3f}" if hw else ""
    return (f"matched {min(mm):.3f}-{max(mm):.3f} (median {median(mm):.3f}) raw, {len(recs)} pairs"
            + (f", n = {'/'.join(map(str, n))}" if n else "") + half + cal)


def _beside_shuffled(recs: list[Rec]) -> str:
    ss = [r.m("cka_shuffled") for r in recs]
    if not ss:
        return "not measured"
    seeds = sorted({int(r.m("control_seeds")) for r in recs if math.isfinite(r.m("control_seeds"))})
    sd = [r.m("cka_shuffled_sd") for r in recs if math.isfinite(r.m("cka_shuffled_sd"))]
    over = (f" (mean over {'/'.join(map(str, seeds))} seeds" + (f"; sd over seeds up to {max(sd):.3f})" if sd and max(seeds) > 1 else ")")
            if seeds else "")
    return f"{min(ss):.3f}-{max(ss):.3f}{over}"


def _beside_retrieval(recs: list[Rec]) -> str:
    have = [r for r in recs if math.isfinite(r.m("retrieval_p1"))]
    if not have:
        return "not measured (no retrieval runs)"
    top = max(have, key=lambda r: r.m("retrieval_p1"))
    return f"up to {top.m('retrieval_p1'):.3f} (chance {top.m('retrieval_chance'):.4f}; {top.tags.get('pair')})"


def beside(an: Analysis) -> list[list[str]]:
    """The representation arm's rows beside the spec documents: matched CKA (each model on its own language, and every
    model on one language when the study ran that protocol), the shuffled control and retrieval."""
    own = [p["recs"]["cka"] for p in an.pairs if "cka" in p["recs"]]
    one = [r for r in one_language(an.study) if r.tags.get("metric") == "cka"]
    rows = [["matched last-layer CKA, each model on its own language", _beside_cka(own), *SEED_CKA]]
    if one:
        rows.append(["matched last-layer CKA, every model on one language", _beside_cka(one), "(the shared-space paper's protocol; "
                     "no CKA figure in its summary)", "five-architectures-shared-space-summary.txt"])
    return rows + [["shuffled-control CKA", _beside_shuffled(own), *SEED_SHUFFLED],
                   ["retrieval P@1 after a fitted linear map", _beside_retrieval([p["recs"]["retrieval"] for p in an.pairs
                                                                                  if "retrieval" in p["recs"]]), *SEED_RETRIEVAL]]
