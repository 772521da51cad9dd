"""The report's figures (matplotlib, Agg): CKA matched vs shuffled, correlation heatmaps, the checkpoint arm
against trajectory distance, transport fusion deltas with the shuffled-plan control."""

from __future__ import annotations

from typing import Any

import numpy as np

from mergescope.analysis.calibration import figure_epsilon
from mergescope.analysis.records import Rec, Study, base_name, direction, is_checkpoint_pair
from mergescope.analysis.report import slug
from mergescope.analysis.tables import Analysis
from mergescope.plotting import pyplot

__all__ = ["pyplot", "figure_cka", "figure_correlation", "figure_checkpoint", "figure_transport", "make_figures", "close_figures"]

# figure name -> its caption in the "not drawn" line
FIGURES = (("cka_matched_vs_shuffled", "matched vs shuffled CKA"),
           ("correlations_checkpoint", "correlation heatmap, checkpoint arm"),
           ("correlations_cross_model", "correlation heatmap, cross-model arm"),
           ("checkpoint_vs_distance", "checkpoint merge results vs trajectory distance"),
           ("transport_deltas", "transport fusion deltas with the control"))


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


def figure_correlation(table, title: str):
    plt = pyplot()
    names = list(dict.fromkeys([*table["a"], *table["b"]]))
    k = len(names)
    R = np.eye(k)
    Q = np.full((k, k), np.nan)
    idx = {n: i for i, n in enumerate(names)}
    for r in table.itertuples():
        i, j = idx[r.a], idx[r.b]
        R[i, j] = R[j, i] = r.rho
        Q[i, j] = Q[j, i] = r.q_bh
    fig, ax = plt.subplots(figsize=(0.7 * k + 3, 0.6 * k + 2))
    im = ax.imshow(np.nan_to_num(R, nan=0.0), vmin=-1, vmax=1, cmap="RdBu_r")
    ax.set_xticks(range(k), names, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(k), names, fontsize=8)
    for i in range(k):
        for j in range(k):
            if i != j and np.isfinite(R[i, j]):
                star = "*" if np.isfinite(Q[i, j]) and Q[i, j] < 0.05 else ""
                ax.text(j, i, f"{R[i, j]:.2f}{star}", ha="center", va="center", fontsize=7,
                        color="w" if abs(R[i, j]) > 0.6 else "k")
    ax.set_title(title + "\n(Spearman rho; * = BH q < 0.05)", fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    return fig


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


def _transport_bars(ax, transport: list[Rec]) -> None:
    dirs = sorted({direction(r) for r in transport})
    alphas = sorted({r.m("alpha") if np.isfinite(r.m("alpha")) else float(r.tags.get("alpha", "nan")) for r in transport})
    w = 0.8 / max(1, len(alphas))
    for ai, a in enumerate(alphas):
        xs, ot, rd = [], [], []
        for di, d in enumerate(dirs):
            r = next((r for r in transport if direction(r) == d and (r.m("alpha") == a or r.tags.get("alpha") == str(a))), None)
            if r is None:
                continue
            xs.append(di + (ai - (len(alphas) - 1) / 2) * w)
            ot.append(r.m("delta_target_lang"))
            rd.append(r.m("delta_target_lang") - r.m("ot_minus_rand_target_lang"))
        ax.bar(xs, ot, width=w, label=f"OT plan, alpha={a:g}")
        ax.plot(xs, rd, "k_", ms=10, mew=2, label="shuffled-plan control" if ai == 0 else None)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(dirs)), dirs, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("delta NLL on target's language (fused - unfused)")
    ax.legend(fontsize=7)


def figure_transport(transport: list[Rec]):
    plt = pyplot()
    n_dirs = len({direction(r) for r in transport})
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 0.6 * n_dirs + 6), 4.5), gridspec_kw={"width_ratios": [2, 1]})
    _transport_bars(axes[0], transport)
    ax = axes[1]
    x = np.array([r.m("delta_target_lang") - r.m("ot_minus_rand_target_lang") for r in transport])
    y = np.array([r.m("delta_target_lang") for r in transport])
    ax.scatter(x, y, s=14)
    lim = [np.nanmin([x.min(), y.min()]), np.nanmax([x.max(), y.max()])]
    ax.plot(lim, lim, "k--", lw=0.8)
    ax.set_xlabel("shuffled-plan delta")
    ax.set_ylabel("OT-plan delta")
    ax.set_title("below the diagonal: OT beats control", fontsize=9)
    fig.suptitle("Transport fusion without adaptation")
    fig.tight_layout()
    return fig


def _draw(an: Analysis, study: Study, wanted: set[str]) -> dict[str, Any]:
    figs: dict[str, Any] = {}
    if "cka_matched_vs_shuffled" in wanted:
        figs["cka_matched_vs_shuffled"] = figure_cka(an.cka_matrix, an.models, an.pairs)
    if "correlations_checkpoint" in wanted:
        figs["correlations_checkpoint"] = figure_correlation(an.correlations["checkpoint"], "checkpoint arm")
    if "correlations_cross_model" in wanted:
        figs["correlations_cross_model"] = figure_correlation(an.correlations["cross"], f"cross-model arm (n={len(an.pairs)})")
    if "checkpoint_vs_distance" in wanted:
        figs["checkpoint_vs_distance"] = figure_checkpoint([r for r in study.native if is_checkpoint_pair(r)])
    if "transport_deltas" in wanted:
        figs["transport_deltas"] = figure_transport(study.kind("transport"))
    if "epsilon_calibration" in wanted:
        figs["epsilon_calibration"] = figure_epsilon(study.kind("transport"))
    return figs


def make_figures(an: Analysis, study: Study) -> dict[str, Any]:
    """The figures the sections ask for, as matplotlib Figures keyed by name; section 9 lists them (and what was not drawn)."""
    figs = _draw(an, study, {name for s in an.sections for name, _ in s.figures})
    for s in an.sections:
        figs.update(s.drawn)
    sec = an.section("figures")
    for s in an.sections:  # an index, not a second copy: each figure is shown once, in its section
        if s is sec:
            continue
        for name, cap in s.figures:
            if name in figs:
                sec.text.append(f"- {cap}: [{s.title}](#{slug(s.title)}) (`figures/{name}.png`)")
    for name, cap in FIGURES:
        if name not in figs:
            sec.missing.append(f"figure '{cap}': not drawn (its section was not measured; see above)")
    an.figures = figs
    return figs


def close_figures(an: Analysis) -> None:
    plt = pyplot()
    for fig in an.figures.values():
        plt.close(fig)
