"""The checkpoint arm in the report: checkpoint merging (pairs of checkpoints of one training run) by trajectory
distance, and its diagnostic x diagnostic correlations (pooled, then per family)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mergescope.analysis import claims
from mergescope.analysis.context import Analysis
from mergescope.analysis.records import Rec, base_name, is_checkpoint_pair
from mergescope.native.report import native_runs
from mergescope.analysis.sections.correlations import COLUMNS, MANTEL_COLUMNS, correlation_section, tabled
from mergescope.analysis.tables import RTable, Section, csv_text, f3, median, short, text_note
from mergescope.plotting import pyplot

__all__ = ["checkpoint_arm", "checkpoint_runs", "correlations_checkpoint", "figure_checkpoint", "BINS", "CHECKPOINT_DIAGNOSTICS"]

CHECKPOINT_NULL = {"unit": "checkpoint", "null": "checkpoint-level null (checkpoint labels permuted within each training run)"}
CHECKPOINT_DIAGNOSTICS = ["log10_step_ratio", "weight_cosine_matrices", "relative_l2", "tv_cosine", "ties_sign_agreement",
                          "cka", "lmc_barrier", "merge_gain"]
"""The checkpoint arm's diagnostics. The weight cosine is the weight matrices' alone: over every shared tensor the norm
gains (initialised at 1, near 1 in every checkpoint) carry much of the norm and make any two checkpoints look aligned."""


def _value(r: Rec, c: str) -> float:
    """A diagnostic of a checkpoint pair; ``merge_gain`` in the report's NLL scope (the first token apart by default),
    as every comparison reads it."""
    return r.m(claims.metric(c)) if c == "merge_gain" else r.m(c)

BINS = [("within half a decade (log10 ratio <= 0.5)", lambda x: x <= 0.5),
        ("0.5 to 1.5 decades", lambda x: 0.5 < x <= 1.5),
        ("beyond 1.5 decades (log10 ratio > 1.5)", lambda x: x > 1.5)]


def checkpoint_runs(an: Analysis) -> list[Rec]:
    """The checkpoint-pair native runs, by training run then trajectory distance (read once per analysis)."""
    if "checkpoint" not in an.memo:
        ck = [r for r in native_runs(an.study) if is_checkpoint_pair(r)]
        ck.sort(key=lambda r: (base_name(r.tags.get("model_a", "")), r.m("log10_step_ratio")))
        an.memo["checkpoint"] = ck
    return an.memo["checkpoint"]


def _bin_row(run_label: str, name: str, rs: list[Rec]) -> list[str]:
    if not rs:
        return [run_label, name, "0", "—", "—", "—", ""]
    have = [r for r in rs if np.isfinite(r.m(claims.metric("merge_gain")))]
    beats = claims.count(have, "merge_gain", "higher")
    share = f"{beats}/{len(have)} ({100 * beats / len(have):.0f}%)" if have else "—"
    return [run_label, name, str(len(rs)), f3(median(r.m("lmc_barrier") for r in rs)),
            f3(median(r.m(claims.metric("merge_gain")) for r in rs)),
            share, ", ".join(short(r.run_id) for r in rs) if len(rs) <= 8 else f"{len(rs)} runs (see per-pair table)"]


def _bin_rows(ck: list[Rec]) -> list[list[str]]:
    """Per training run (and pooled when there are several): all pairs, then each trajectory-distance bin."""
    rows = []
    fams = sorted({base_name(r.tags["model_a"]) for r in ck})
    for fam in [None, *fams] if len(fams) > 1 else [None]:
        sub = [r for r in ck if fam is None or base_name(r.tags["model_a"]) == fam]
        run_label = fam or ("all runs" if len(fams) > 1 else fams[0])
        rows.append(_bin_row(run_label, "all", sub))
        for name, pred in BINS:
            rows.append(_bin_row(run_label, name, [r for r in sub if np.isfinite(r.m("log10_step_ratio")) and pred(r.m("log10_step_ratio"))]))
    return rows


def checkpoint_arm(an: Analysis, number: str) -> Section:
    """5. Checkpoint merging by trajectory distance (per run and pooled) and per checkpoint pair."""
    sec = Section("checkpoint", f"{number}. Checkpoint merging: the native weight-space arm")
    ck = checkpoint_runs(an)
    if not ck:
        sec.missing.append("checkpoint arm: not measured (no kind=measure metric=native runs with arm=checkpoint; "
                           "set checkpoints.models and checkpoints.revisions in the study)")
        return sec
    sec.text.append("Pairs of checkpoints of one training run: same architecture, vocabulary and parameter space, so "
                    "every weight-space quantity is defined. Trajectory distance = log10(step_b / step_a).")
    said = text_note(getattr(an, "study", None), ck[0].params.get("merge_chosen.run", ""), "host")
    if said:
        sec.text.append(f"Scored text of each pair (the models' language, data.split's first lines): {said}; every "
                        "verdict of this section is about that text.")
    sec.tables.append(RTable("By trajectory distance", ["run", "bin", "n", "median lmc_barrier", "median merge_gain",
                                                          "merge beats better endpoint", "runs"], _bin_rows(ck),
                             note="lmc_barrier in nats/token over every token (negative: the straight path is better than "
                                  "its chord); merge_gain = better endpoint's NLL - NLL of the merge chosen on "
                                  "native.select_split (the lowest NLL on that split, disjoint from the reported sentences), both "
                                  f"on data.split, in nats/token {claims.SCOPE_NOTE[claims.SCOPE['value']]} (positive: merging "
                                  "beats the better endpoint). merge beats better endpoint: " + claims.RULE + "; "
                                  "BH across each row's pairs."))
    said = claims.verdicts(ck, "merge_gain")
    per = [[r.tags["pair"], *[f3(_value(r, c)) for c in CHECKPOINT_DIAGNOSTICS], r.group("merge_chosen").get("merge") or "—",
            f3(r.m("chosen_merged_nll")), claims.cell(r, "merge_gain"), v, short(r.run_id)] for r, v in zip(ck, said)]
    sec.tables.append(RTable("Per checkpoint pair", ["pair", *CHECKPOINT_DIAGNOSTICS, "chosen merge", "chosen_merged_nll",
                                                     "merge_gain [95% CI]", "verdict", "run"], per,
                             note="chosen merge: the merge with the lowest NLL on native.select_split; its NLL and gain "
                                  "on data.split. merge_gain (a diagnostic column, as the correlation tables read it) and "
                                  f"merge_gain [95% CI] with its verdict: {claims.SCOPE_NOTE[claims.SCOPE['value']]}, the "
                                  "paired interval over the sentences' FLORES articles (higher = the merge beats the better "
                                  f"endpoint); the verdict {claims.BH_NOTE}. weight_cosine_matrices: the weight matrices "
                                  "alone (every shared tensor's cosine, the norm gains included, is in the run)."))
    sec.add_figure("checkpoint_vs_distance", "checkpoint merge results vs trajectory distance", lambda: figure_checkpoint(ck))
    an.csv["tables/checkpoint_arm.csv"] = sec.tables[1].csv()
    an.metrics["checkpoint_pairs"] = float(len(ck))
    beats = [r for r, v in zip(ck, said) if v == "higher"]
    worse = [r for r, v in zip(ck, said) if v == "lower"]
    bar = median(r.m("lmc_barrier") for r in ck)
    sec.finding = (f"Over {len(ck)} checkpoint pairs the median LMC barrier is {f3(bar)} nats/token; merging beats the "
                   f"better endpoint in {len(beats)}/{len(ck)} and is worse than it in {len(worse)}/{len(ck)} (each where its "
                   f"paired 95% interval excludes 0, {claims.BH_NOTE}; the rest cannot be told apart; the endpoints are "
                   "the control).")
    an.console_tables.append(sec.tables[0])
    return sec


def figure_checkpoint(ck: list[Rec]):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    fams = sorted({base_name(r.tags["model_a"]) for r in ck})
    for fam, marker in zip(fams, "osd^v<>"):
        rs = [r for r in ck if base_name(r.tags["model_a"]) == fam]
        x = [r.m("log10_step_ratio") for r in rs]
        axes[0].plot(x, [r.m("lmc_barrier") for r in rs], marker, label=fam, alpha=0.8)
        axes[1].plot(x, [r.m("merge_gain") for r in rs], marker, label=fam, alpha=0.8)
    for ax, lab in zip(axes, ("LMC barrier (nats/token)", "merge gain (nats/token)")):
        ax.axhline(0, color="k", lw=0.8)
        for x in (0.5, 1.5):
            ax.axvline(x, color="gray", ls=":", lw=0.8)
        ax.set_xlabel("trajectory distance log10(step_b / step_a)")
        ax.set_ylabel(lab)
        ax.legend(fontsize=8)
    fig.suptitle("Checkpoint merging vs trajectory distance (merge gain > 0: merging beats the better endpoint)")
    fig.tight_layout()
    return fig



def checkpoint_labels(rows) -> tuple[tuple[list[str], list[str]], dict[str, str]]:
    """Each checkpoint pair's two checkpoints (``model_a`` / ``model_b`` tags, ``name@revision``) and each checkpoint's
    training run (its name): the checkpoint-level null permutes checkpoint labels within a run."""
    a, b = [str(r.tags.get("model_a", "")) for r in rows], [str(r.tags.get("model_b", "")) for r in rows]
    return (a, b), {m: base_name(m) for m in a + b}


def correlations_checkpoint(an: Analysis, number: str) -> list[Section]:
    """One row per checkpoint pair (native weight merging), then the same per family when there are several. Pairs
    share checkpoints, so beside the row-shuffle null each table has the checkpoint-level (Mantel) null, the labels
    permuted within each training run."""
    an.frames["checkpoint"] = {c: np.array([_value(r, c) for r in checkpoint_runs(an)], dtype=np.float64)
                               for c in CHECKPOINT_DIAGNOSTICS}
    models, strata = checkpoint_labels(checkpoint_runs(an))
    sec = tabled(an, "checkpoint", "corr_checkpoint", f"{number}. Diagnostic x diagnostic Spearman correlations: checkpoint arm",
                  len(checkpoint_runs(an)), "One row per checkpoint pair (native weight merging).",
                  ("correlations_checkpoint", "diagnostic correlation heatmap, checkpoint arm", "checkpoint arm"),
                  "tables/checkpoint_correlations.csv", models=models, strata=strata, **CHECKPOINT_NULL)
    return [sec, *family_sections(an, number)]


def family_sections(an: Analysis, number: str) -> list[Section]:
    """8a per checkpoint family (one training run each), when the study has more than one, and whether the
    pooled table's significant cells replicate in every family (same sign, BH q < 0.05 within the family)."""
    families = list(dict.fromkeys(base_name(r.tags.get("model_a", "")) for r in checkpoint_runs(an)))
    if len(families) < 2:
        return []
    out, tables = [], {}
    for fam in families:
        rows = [r for r in checkpoint_runs(an) if base_name(r.tags.get("model_a", "")) == fam]
        frame = {c: np.array([_value(r, c) for r in rows], dtype=np.float64) for c in CHECKPOINT_DIAGNOSTICS}
        models, strata = checkpoint_labels(rows)
        sec, table, _ = correlation_section(f"corr_checkpoint_{fam}", f"{number}. Checkpoint arm, family {fam}", frame, len(rows),
                                            an.n_permutations, f"One row per checkpoint pair of {fam} only.",
                                            models=models, strata=strata, **CHECKPOINT_NULL)
        if table is not None:
            tables[fam] = table
            cols = COLUMNS + MANTEL_COLUMNS
            an.csv[f"tables/checkpoint_correlations_{fam}.csv"] = csv_text(cols, table[cols].itertuples(index=False, name=None))
        out.append(sec)
    out[0].text.insert(0, replication_text(an.correlations.get("checkpoint"), tables, families))
    return out


def replication_text(pooled, tables: dict[str, Any], families: list[str]) -> str:
    """Which of the pooled table's BH-significant cells replicate in every family (same sign, q < 0.05 there), on the
    checkpoint-level null (q_mantel) when the tables have it, else on the row-shuffle one (q_bh)."""
    if pooled is None or len(tables) < len(families):
        return "Replication across families: not tested (a family has too few checkpoint pairs for its own table)."
    qc = "q_mantel" if "q_mantel" in pooled and all("q_mantel" in t for t in tables.values()) else "q_bh"
    sig = pooled[pooled[qc] < 0.05]
    ok = []
    for a, c, rho in zip(sig["a"], sig["b"], sig["rho"]):
        cells = [t[(t["a"] == a) & (t["b"] == c)] for t in tables.values()]
        if all(len(x) and x[qc].iloc[0] < 0.05 and np.sign(x["rho"].iloc[0]) == np.sign(rho) for x in cells):
            ok.append(f"{a} x {c}")
    return (f"Replication across families ({', '.join(families)}; {qc}, the "
            f"{'checkpoint-level' if qc == 'q_mantel' else 'row-shuffle'} null): {len(ok)} of the {len(sig)} pooled cells with {qc}<0.05 "
            f"have the same sign and q<0.05 in every family" + (f" ({', '.join(ok[:6])}{', ...' if len(ok) > 6 else ''})." if ok else "."))
