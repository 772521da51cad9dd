"""Report section: the shared-space arm (kind=agreement / shared_space / routing), from MLflow runs and their
table artifacts. Stand-ins are named where they are used: FLORES domains (PUD sources) for the paper's probe
categories, PUD for its second probe set, bits per byte for its gradeable tasks."""

from __future__ import annotations

import csv
import io
import math

import numpy as np

from mergescope.analysis import claims
from mergescope.analysis.records import Rec
from mergescope.analysis.context import Analysis
from mergescope.analysis.tables import RTable, Section, short
from mergescope.plotting import pyplot

STAND_INS = ("Stand-ins (the paper's probes and tasks are not available here): FLORES-200 domains (wikinews / wikivoyage / "
             "wikibooks; PUD: news / wikipedia) stand in for the paper's probe categories, PUD for its second probe set, "
             "and bits per byte of each sentence for its gradeable tasks.")


def _f(v: float, nd: int = 3) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def _table(study, r: Rec, name: str) -> list[dict]:
    text = study.artifact_text(r.run_id, f"tables/{name}.csv")  # None: a run without that table (e.g. no categories)
    return list(csv.DictReader(io.StringIO(text))) if text is not None else []


def depth_split(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """A depth table's rows: those measured at a layer of each model's own (``distinct`` = 1), and the collapsed ones
    (``distinct`` = 0: the relative depth rounds to a layer another depth owns, in either model, so its numbers repeat
    that depth's and are not a measurement at this depth)."""
    return ([x for x in rows if str(x.get("distinct", "1")) != "0"], [x for x in rows if str(x.get("distinct", "1")) == "0"])


def _depth_figure(study, runs: list[Rec]):
    """Each pair's RSA and nearest-neighbour match at the relative depths measured on a layer of their own (each layer
    once); a collapsed depth (two relative depths on one layer) is a dotted vertical line, not a point."""
    from matplotlib.lines import Line2D

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    any_collapsed = False
    for r in runs:
        own, collapsed = depth_split(_table(study, r, "depth"))
        d = [float(x["depth"]) for x in own]
        for ax, key in zip(axes, ("rsa", "nn_match")):
            line, = ax.plot(d, [float(x[key]) for x in own], "o-", label=f"{r.tags.get('pair', '')} [{short(r.run_id)}]")
            ax.fill_between(d, [float(x[f"{key}_null_q025"]) for x in own], [float(x[f"{key}_null_q975"]) for x in own],
                            color=line.get_color(), alpha=0.15)
            for x in collapsed:
                ax.axvline(float(x["depth"]), color=line.get_color(), ls=":", lw=1.0, alpha=0.8)
        any_collapsed = any_collapsed or bool(collapsed)
    for ax, t in zip(axes, ("RSA (Spearman of cosine-distance matrices)", "nearest-neighbour match rate")):
        ax.set_xlabel("relative depth")
        ax.set_title(f"{t}; band = 95% permutation null", fontsize=9)
    handles, labels = axes[1].get_legend_handles_labels()
    if any_collapsed:
        handles.append(Line2D([], [], color="gray", ls=":"))
        labels.append("collapsed depth: no layer of its own (repeats another depth's layer), not plotted")
    axes[1].legend(handles, labels, fontsize=6)
    return fig


def pooling_text(runs: list[Rec]) -> str:
    """The pooling every representation of the section is (``shared.pooling`` of its runs), with the ablation's."""
    main = sorted({str(p) for r in runs if (p := r.param("shared.pooling")) is not None})
    ablation = sorted({str(x) for r in runs for x in (r.param("shared.poolings") or [])})
    if not main:
        return "Pooling: not logged by these runs (shared.pooling)."
    what = {"mean": "the mean of the hidden states of the sentence's real tokens",
            "sgpt": "the position-weighted mean of the hidden states of the sentence's real tokens (weight i for token i)",
            "last": "the hidden state of the sentence's last real token"}
    return (f"Pooling: every sentence representation in this section is {' / '.join(what.get(p, p) for p in main)} "
            f"(shared.pooling={', '.join(main)}{'; the runs differ' if len(main) > 1 else ''}), at each layer used"
            + (f"; the pooling ablation table compares {', '.join(ablation)}." if ablation else "."))


def _cka_heatmaps(study, runs: list[Rec]):
    """Every pair's L_a x L_b linear-CKA matrix (from its tables/cka_layers.csv), one panel per pair."""
    mats = []
    for r in runs:
        rows = _table(study, r, "cka_layers")
        if rows:
            mats.append((r, np.array([[float(v) for k, v in x.items() if k != "layer_a"] for x in rows])))
    if not mats:
        return None
    plt = pyplot()
    cols = min(5, len(mats))
    fig, axes = plt.subplots((len(mats) + cols - 1) // cols, cols, figsize=(2.4 * cols, 2.4 * ((len(mats) + cols - 1) // cols)),
                             squeeze=False)
    for ax in axes.flat[len(mats):]:
        ax.axis("off")
    for ax, (r, m) in zip(axes.flat, mats):
        im = ax.imshow(m, vmin=0, vmax=1, cmap="viridis", origin="lower", aspect="auto")
        ax.set_xticks(range(m.shape[1]))
        ax.set_yticks(range(m.shape[0]))
        a, _, b = r.tags.get("pair", "").partition("__")
        ax.set_title(f"{r.tags.get('pair', '')}\n[{short(r.run_id)}]", fontsize=6)
        ax.set_xlabel(f"{b} layer", fontsize=6)
        ax.set_ylabel(f"{a} layer", fontsize=6)
        ax.tick_params(labelsize=5)
    fig.colorbar(im, ax=list(axes.flat), shrink=0.6, label="linear CKA")
    return fig


def _space_figures(study, r: Rec):
    """GPA and pairwise held-out retrieval per ordered pair (final depth, pool 32) as matrices, and the D sweep."""
    rows, dims = _table(study, r, "retrieval"), _table(study, r, "dim_sweep")
    if not rows:
        return None
    final = max(float(x["depth"]) for x in rows)
    labels = list(dict.fromkeys(x["query"] for x in rows))
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, method in zip(axes, ("gpa", "pairwise")):
        m = np.full((len(labels), len(labels)), np.nan)
        for x in rows:
            if float(x["depth"]) == final and x["pool"] == "32" and x["method"] == method:
                m[labels.index(x["query"]), labels.index(x["gallery"])] = float(x["p1"])
        ax.imshow(m, vmin=0, vmax=1, cmap="magma")
        for (i, j), v in np.ndenumerate(m):
            if not math.isnan(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7, color="white" if v < 0.6 else "black")
        ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=6)
        ax.set_yticks(range(len(labels)), labels, fontsize=6)
        ax.set_xlabel("gallery model", fontsize=7)
        ax.set_ylabel("query model", fontsize=7)
        ax.set_title(f"{'GPA shared space' if method == 'gpa' else 'pairwise linear maps'}: P@1, pool 32", fontsize=8)
    d = [int(x["dim"]) for x in dims]
    g, pw = np.array([float(x["gpa_p1_32"]) for x in dims]), np.array([float(x["pairwise_p1_32"]) for x in dims])
    lo, hi = (np.array([_num(x.get(k)) for x in dims]) for k in ("diff_lo", "diff_hi"))
    if np.isfinite(lo).all() and np.isfinite(hi).all():  # GPA with the paired interval of its difference from pairwise
        axes[2].errorbar(d, g, yerr=[np.maximum(g - (pw + lo), 0), np.maximum(pw + hi - g, 0)], fmt="o-", capsize=3,
                         label="GPA (bar: its paired 95% interval against pairwise)")
    else:
        axes[2].plot(d, g, "o-", label="GPA (no interval logged)")
    axes[2].plot(d, pw, "s--", label="pairwise")
    axes[2].axhline(1 / 32, color="grey", lw=0.8, ls=":", label="chance")
    axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel("D (common PCA dimension)", fontsize=7)
    axes[2].set_title(f"D sweep, final layer [{short(r.run_id)}, {r.tags.get('data')}]", fontsize=8)
    axes[2].legend(fontsize=6)
    fig.tight_layout()  # the panels' tick labels and titles must not overlap
    return fig


def _agreement_tables(runs: list[Rec]) -> list[RTable]:
    rows = [[r.tags.get("pair", ""), r.tags.get("data", ""), _f(r.m("rsa")), _f(r.m("rsa_p"), 4), _f(r.m("nn_match")),
             _f(r.m("nn_match_ratio_to_chance"), 1), _f(r.m("nn_match_p"), 4), _f(r.m("cka")), _f(r.m("cka_debiased")),
             _f(r.m("pc2_share_a_final")), _f(r.m("pc2_share_b_final")), short(r.run_id)] for r in runs]
    out = [RTable("Probe-level agreement at the final layer (permutation nulls: shared.permutations, 2000 by default)",
                  ["pair", "data", "RSA", "p", "NN match", "x chance", "p", "CKA", "debiased CKA", "PC1+2 a", "PC1+2 b", "run"], rows,
                  note="p = (1 + #null >= observed) / (1 + permutations); PC1+2 = share of variance in two principal components")]
    by = {(r.tags.get("pair"), r.tags.get("data")): r for r in runs}
    cmp_rows = []
    for (pair, data), r in by.items():
        other = by.get((pair, "pud"))
        if data != "flores200" or other is None:
            continue
        for key in ("rsa", "nn_match", "cka", "cka_debiased", "retrieval_p1"):
            cmp_rows.append([pair, key, _f(r.m(key)), _f(other.m(key)), _f(other.m(key) - r.m(key)), f"{short(r.run_id)} / {short(other.run_id)}"])
    if cmp_rows:
        out.append(RTable("Second probe set: FLORES vs PUD (final layer)", ["pair", "metric", "FLORES", "PUD", "PUD - FLORES", "runs"], cmp_rows))
    return out


def _space_tables(study, r: Rec) -> list[RTable]:
    rows = _table(study, r, "retrieval")
    per: dict[tuple, list[float]] = {}
    for x in rows:
        per.setdefault((float(x["depth"]), x["method"], x["pool"]), []).append(float(x["p1"]))
    depths = sorted({k[0] for k in per})
    pools = sorted({k[2] for k in per}, key=lambda p: (p == "all", int(p) if p != "all" else 0))
    dt = [[_f(d, 2), *(_f(float(np.mean(per[(d, m, p)]))) for p in pools for m in ("gpa", "pairwise"))] for d in depths]
    ridge = sorted({float(x["ridge"]) for x in rows if x.get("ridge") not in (None, "")})
    flagged = sorted({float(x["depth"]) for x in rows if x.get("distinct") == "0"})
    dt = [row + (["no distinct state: " + ", ".join(sorted({x["without_distinct_state"] for x in rows
                                                            if float(x["depth"]) == d and x.get("without_distinct_state")}))]
                 if d in flagged else [""]) for d, row in zip(depths, dt)]
    out = [RTable(f"GPA vs pairwise maps: held-out P@1, mean over ordered pairs [{short(r.run_id)}, {r.tags.get('data')}]",
                  ["depth", *(f"{m} @{p}" for p in pools for m in ("GPA", "pairwise")), "depth note"], dt,
                  note="chance = 1/pool; 'all' = the whole held-out fold; each pairwise map is a ridge regression with a free "
                       "intercept, its ridge (x the mean eigenvalue of the centred Gram) chosen per fold and ordered pair on a "
                       "validation part of that fold's training rows" + (f" (chosen: {', '.join(f'{x:g}' for x in ridge)})" if ridge else "")
                       + ("; a depth with a note repeats another depth's state for the models named, so it is not a "
                          "comparison at that depth" if flagged else ""))]
    final = max(depths) if depths else None
    mat = [x for x in rows if float(x["depth"]) == final and x["pool"] == "32"]
    out.append(RTable("Retrieval per ordered pair at the final layer, pool 32 (query -> gallery)", ["query", "gallery", "GPA", "pairwise"],
                      [[x["query"], x["gallery"], _f(float(x["p1"])), _f(float(y["p1"]))] for x in mat if x["method"] == "gpa"
                       for y in mat if y["method"] == "pairwise" and y["query"] == x["query"] and y["gallery"] == x["gallery"]]))
    dims = _table(study, r, "dim_sweep")
    out.append(RTable("D sweep (final layer, pool 32)", ["D requested", "D used", "GPA", "pairwise"], dim_rows(dims),
                      note="D is capped at the rank limit, min(narrowest width, training-fold size - 1): a requested D above "
                           "it repeats the capped D's numbers and is marked, not measured again"))
    tr = _table(study, r, "transfer")
    if tr:
        out.append(RTable("Category transfer (stand-in: FLORES domains): fit without the held-out domain, then refit with it (pool 32)",
                          ["held-out domain", "unseen: excl.", "refit: incl.", "seen domains: excl.", "seen: incl."],
                          [[x["held_out"], _f(float(x["held_out_excl"])), _f(float(x["held_out_incl"])), _f(float(x["seen_excl"])),
                            _f(float(x["seen_incl"]))] for x in tr]))
    return out


def _num(x: str | None) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return float(np.mean(xs)) if xs else float("nan")


def dim_rows(dims: list[dict]) -> list[list[str]]:
    """The D sweep's rows: a row whose D was capped says which D it repeats."""
    out = []
    for x in dims:
        used = x.get("dim_effective") or x["dim"]
        capped = x.get("capped") == "1"
        out.append([x["dim"], f"{used} (capped: repeats D={used})" if capped else used,
                    _f(float(x["gpa_p1_32"])), _f(float(x["pairwise_p1_32"]))])
    return out


def ssm_gap_rows(tables: list[tuple[bool, list[dict]]]) -> list[list[str]]:
    """§5.3 by depth: mean RSA, nearest-neighbour ratio to chance and change correlation over pairs with a
    state-space model against transformer-only pairs. ``tables``: (pair has an SSM, its depth rows). A depth row
    where either model has no distinct state (``distinct`` = 0: it repeats another depth's state) is left out."""
    by: dict[tuple[float, bool], list[dict]] = {}
    for ssm, rows in tables:
        for x in rows:
            if str(x.get("distinct", "1")) == "0":
                continue
            by.setdefault((float(x["depth"]), ssm), []).append(x)
    out = []
    for d in sorted({k[0] for k in by}):
        s, t = by.get((d, True), []), by.get((d, False), [])
        cells = []
        for key in ("rsa", "nn_match_ratio_to_chance", "change_corr"):
            ms, mt = _mean([_num(x.get(key)) for x in s]), _mean([_num(x.get(key)) for x in t])
            cells += [_f(ms), _f(mt), _f(ms - mt)]
        out.append([_f(d, 2), str(len(s)), str(len(t)), *cells])
    return out


def _ssm_tables(study, runs: list[Rec]) -> tuple[list[RTable], list[str]]:
    tables = [(r.tags.get("ssm_models", "0") != "0", _table(study, r, "depth")) for r in runs]
    text = []
    if not any(ssm for ssm, _ in tables):
        text.append("§5.3 (state-space vs transformer pairs): no state-space model among this study's arm models, so the "
                    "comparison is not measured here; `study=shared_space` includes zoo-mamba-en (and `study=shared_space_5` mamba-1.4b).")
    head = ["depth", "SSM pairs", "transformer pairs"] + [f"{k} {g}" for k in ("RSA", "NN x chance", "change corr")
                                                         for g in ("SSM", "transf.", "SSM - transf.")]
    out = [RTable("State-space model pairs against transformer-only pairs, by depth (§5.3)", head, ssm_gap_rows(tables),
                  note="change corr = Spearman correlation across probes of the two models' per-probe change "
                       "1 - cos(h_{l-1}, h_l) on entering the layer at that depth (undefined at depth 0); a pair is left "
                       "out at a depth where either of its models has no distinct state (a shallow model's rounded depth "
                       "repeats another depth's hidden state), so the counts can differ by depth")]
    finals = []
    for r, (_, rows) in zip(runs, tables):
        if rows:
            x = rows[-1]
            finals.append([r.tags.get("pair", ""), f"{r.tags.get('model_type_a', '')} / {r.tags.get('model_type_b', '')}",
                           _f(_num(x.get("change_corr"))), _f(_num(x.get("change_mean_a"))), _f(_num(x.get("change_mean_b"))),
                           short(r.run_id)])
    out.append(RTable("Entering the final layer: does each pair change the same probes? (§5.3)",
                      ["pair", "architectures", "change corr", "mean change a", "mean change b", "run"], finals))
    return out, text


def _centroid_table(study, runs: list[Rec]) -> tuple[list[RTable], list[str]]:
    rows, strong, weaker, total = [], [], [], 0
    for r in runs:
        cent = _table(study, r, "centroids")
        final = max((float(x["depth"]) for x in cent), default=None)
        for x in cent:
            if float(x["depth"]) != final:
                continue
            total += 1
            as_strong = _num(x["centroid_random_as_strong"]) > 0
            if as_strong:
                cell = f"{r.tags.get('pair', '')} (K={x['categories']})"
                # below the random partitions' mean: the topics agree LESS than random groups (a finding of its own)
                (weaker if _num(x["centroid_rsa"]) < _num(x["centroid_rsa_null_mean"]) else strong).append(cell)
            rows.append([r.tags.get("pair", ""), x["categories"], x["n_sentences"], _f(_num(x["centroid_rsa"])),
                         _f(_num(x["centroid_rsa_null_mean"])), _f(_num(x["centroid_rsa_null_q975"])),
                         _f(_num(x["centroid_rsa_p"]), 4), "YES" if as_strong else "no", short(r.run_id)])
    if not rows:
        return [], ["Category-centroid agreement (§5.1): not measured (the probe set has no topic metadata)."]
    above = total - len(strong) - len(weaker)
    parts = [f"the topic centroids agree more than random partitions of equal sizes (p <= 0.05) in {above} of {total} "
             "pair x K cells"]
    if strong:
        parts.append(f"in {len(strong)} they cannot be told from random partitions (p > 0.05, the topics at or above the "
                     f"partitions' mean): {', '.join(strong)}")
    if weaker:
        parts.append(f"in {len(weaker)} the topic centroids agree less than random partitions on average: "
                     f"{', '.join(weaker)}")
    verdict = ("At the final layer, " + "; ".join(parts) + ". Not rejecting the random-partition null is not evidence of "
               "the mechanism (sentence-level agreement averaged, as the paper's §5.1 reads it): it says only that these "
               "topics show no category structure beyond random groups here." if strong or weaker else
               "At the final layer, " + parts[0] + ".")
    return [RTable("Category-centroid agreement at the final layer against random partitions of equal sizes (§5.1)",
                   ["pair", "K topics", "sentences", "centroid RSA", "random: mean", "random: 97.5%", "p",
                    "random as strong?", "run"], rows,
                   note="categories: the K most frequent first-listed FLORES topics (stand-in for the paper's probe "
                        "categories); control: the same sentences randomly partitioned into groups of the same sizes")], [verdict]


def _content_table(study, r: Rec) -> RTable | None:
    rows = _table(study, r, "content_types")
    if not rows:
        return None
    cells = [[x["type"] + ("" if int(x.get("n_fit") or 0) else " (too few sentences to test)"), x["n_type"], x.get("n_fit", ""), _f(_num(x.get("type_p1"))), _f(_num(x.get("control_p1"))),
              _f(_num(x.get("type_p1")) - _num(x.get("control_p1"))), x.get("lang", "")] for x in rows]
    return RTable(f"Unseen content types (§7): shared-space P@1 in pools of {rows[0].get('pool') or 10} [{short(r.run_id)}]",
                  ["type", "sentences", "fitted on", "type (unseen)", "control (unseen, fitted kind)", "type - control", "read from"],
                  cells, note="the space is fitted without the type's sentences; control = as many other sentences held out "
                              "of the same fit. Types: >= 2 numbers; >= 3 inner capitalised words and >= 20% of words "
                              "(entity proxy); bottom / top quarter of word count")


def _routing_table(r: Rec) -> RTable:
    names = [k[4:] for k in r.metrics if k.startswith("bpb_") and not k.startswith(("bpb_model_", "bpb_rest_model_"))
             and not k.endswith("_rest")]
    rest = claims.SCOPE["value"] == "rest" and np.isfinite(r.m("bpb_always_best_rest"))
    sfx = "_rest" if rest else ""
    judged = [n for n in names if n not in ("always_best", "oracle")]
    said = dict(zip(judged, claims.family([(r, f"gain_{n}") for n in judged])))  # one table: BH across its routers
    rows = [[n, _f(r.m(f"bpb_{n}{sfx}"), 4), claims.cell(r, f"gain_{n}") if n != "always_best" else "—",
             said.get(n, ""), _f(r.m(f"oracle_agreement_{n}{sfx}")), short(r.run_id)] for n in names]
    said = said.get("space", claims.verdict(r, "gain_space"))
    verdict = {"higher": "the shared-space router beats always using the best model",
               "lower": "NEGATIVE RESULT: the shared-space router is worse than always using the best model",
               "tie": "NEGATIVE RESULT: the shared-space router cannot be told apart from always using the best model",
               "too few": "too few documents to tell the shared-space router from always using the best model",
               "no interval": "no interval recorded (a run from before intervals): no claim"}.get(said, said)
    return RTable(f"Routing by bits per byte (stand-in for the paper's tasks), {r.tags.get('data')}: {verdict}",
                  ["router", "bits/byte", "gain vs always-best [95% CI]", "verdict", "agrees with oracle", "run"], rows,
                  note=f"bits per byte {claims.SCOPE_NOTE[claims.SCOPE['value']]} (the routers and always-best chosen in that "
                       "scope too); gain > 0 = better than always-best, with its paired 95% interval over the sentences' "
                       "FLORES articles; a router beats always-best only where the interval lies above 0. oracle = per-sentence "
                       "best (an upper bound); domain = category-only router")


def shared_space_section(an: Analysis, number: str) -> Section:
    sec = Section("shared_space", f"{number}. The shared space (the study's models, one space)")
    ag, sp, ro = an.study.kind("agreement"), an.study.kind("shared_space"), an.study.kind("routing")
    if not (ag or sp or ro):
        sec.missing.append("shared space: not measured (no kind=agreement / shared_space / routing runs; run `python launch.py study=shared_space`)")
        return sec
    sec.text.append(STAND_INS)
    sec.text.append(pooling_text([*ag, *sp, *ro]))
    study = an.study
    sec.tables += _agreement_tables(ag)
    if ag:
        agreement = [r for r in ag if r.tags.get("data") == "flores200"] or ag
        sec.add_figure("shared_agreement_by_depth", "RSA and nearest-neighbour match by relative depth, per pair, each "
                       "layer once; band = 95% permutation null; dotted line = a collapsed depth (it rounds to a layer "
                       "another depth owns), not a measurement", lambda: _depth_figure(study, agreement))
        sec.add_figure("shared_layer_cka", "layer-by-layer linear CKA, one panel per pair", lambda: _cka_heatmaps(study, agreement))
        flores = [r for r in ag if r.tags.get("data") == "flores200"] or ag
        tables, text = _centroid_table(study, flores)
        sec.tables += tables
        sec.text += text
        tables, text = _ssm_tables(study, flores)
        sec.tables += tables
        sec.text += text
    for r in sp:
        g, pw = r.m("gpa_p1_32"), r.m("pairwise_p1_32")
        if not sec.finding and math.isfinite(g) and math.isfinite(pw):
            said = {"higher": "GPA beats the pairwise maps", "lower": "the pairwise maps beat GPA",
                    "tie": "the two cannot be told apart", "too few": "too few articles to tell them apart",
                    "no interval": "no interval recorded"}[claims.verdict(r, "gpa_minus_pairwise_p1_32", scope="all")]
            sec.finding = (f"At the final layer, held-out retrieval in pools of 32 (chance 0.031) is {g:.3f} in the GPA shared "
                           f"space against {pw:.3f} for pairwise ridge maps fitted per pair (ridge chosen inside each training "
                           f"fold) on {r.tags.get('data')}: GPA minus pairwise over every held-out sentence, pair and fold "
                           f"{claims.cell(r, 'gpa_minus_pairwise_p1_32', scope='all')} (paired 95% interval over FLORES "
                           f"articles): {said} (run {short(r.run_id)}).")
        sec.tables += _space_tables(study, r)
        sec.add_figure(f"shared_space_{r.tags.get('data', 'data')}", f"GPA vs pairwise retrieval (P@1, pool 32, final layer) "
                       f"per ordered pair, and the D sweep, on {r.tags.get('data')}", lambda r=r: _space_figures(study, r))
        content = _content_table(study, r)
        if content is not None:
            sec.tables.append(content)
    sec.tables += [_routing_table(r) for r in ro]
    return sec


SEED_GPA = ("GPA 0.91-0.93 vs pairwise maps 0.82-0.85 (pools of 32, final layer)", "five-architectures-shared-space-summary.txt")


def _beside_text(an: Analysis) -> str:
    sp = [r for r in an.study.kind("shared_space") if math.isfinite(r.m("gpa_p1_32"))]
    if not sp:
        return "not measured (no shared_space runs)"
    said = {"higher": "GPA better", "lower": "pairwise better", "tie": "cannot be told apart",
            "too few": "too few articles to tell", "no interval": "no interval recorded: no claim"}
    return "; ".join(f"GPA {r.m('gpa_p1_32'):.3f}, pairwise {r.m('pairwise_p1_32'):.3f} on {r.tags.get('data')}: GPA "
                     f"minus pairwise {claims.cell(r, 'gpa_minus_pairwise_p1_32', scope='all')}, "
                     f"{said[v]}" for r, v in zip(sp, claims.verdicts(sp, 'gpa_minus_pairwise_p1_32', scope='all')))


def beside(an: Analysis) -> list[list[str]]:
    """The shared space's row beside the spec documents: held-out retrieval through GPA against pairwise maps."""
    return [["shared space: held-out retrieval, GPA vs pairwise", _beside_text(an), *SEED_GPA]]
