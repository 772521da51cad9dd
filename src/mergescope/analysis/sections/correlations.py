"""The diagnostic x diagnostic Spearman tables (spec section 8): one per arm that declares its rows (the checkpoint
arm's in :mod:`mergescope.native.report_checkpoint`) and the cross-model pairs' here, each with its power statement
(:func:`mergescope.stats.power_statement`) and what survives BH."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mergescope.analysis.context import N_PERMUTATIONS, Analysis
from mergescope.analysis.tables import RTable, Section, cross_diagnostics, csv_text, f3
from mergescope.plotting import pyplot
from mergescope.stats import correlation_table, mantel_table, power_statement

__all__ = ["correlation_section", "correlations_cross", "figure_correlation", "tabled", "COLUMNS", "MANTEL_COLUMNS", "N_PERMUTATIONS"]

COLUMNS = ["a", "b", "n", "rho", "p_perm", "q_bh"]


def _usable(frame: dict[str, np.ndarray], n_rows: int) -> tuple[dict[str, np.ndarray], list[str]]:
    """The columns defined for at least 3 rows and not constant; the others, each with why it was left out."""
    usable, dropped = {}, []
    for c, col in frame.items():
        fin = col[np.isfinite(col)]
        if fin.size < 3:
            dropped.append(f"{c} (defined for {fin.size} of {n_rows} rows)")
        elif np.ptp(fin) == 0:
            dropped.append(f"{c} (constant)")
        else:
            usable[c] = col
    return usable, dropped


def _power(table, n_rows: int) -> tuple[Any, dict[str, Any]]:
    """The tested cells and the power statement at n_rows, with what survives BH at q < 0.05."""
    tested = table.dropna(subset=["p_perm"])
    power = power_statement(n_rows, n_tests=max(1, len(tested)))
    survivors = tested[tested["q_bh"] < 0.05]
    surv = ("nothing survives BH at q<0.05" if survivors.empty else
            f"{len(survivors)} of {len(tested)} cells survive BH at q<0.05 (" +
            ", ".join(f"{a} x {b}" for a, b in zip(survivors["a"][:6], survivors["b"][:6])) +
            (", ..." if len(survivors) > 6 else "") + ")")
    power["survivors"] = int(len(survivors))
    power["text_full"] = f"{power['text']} Here {surv}."
    return tested, power


MANTEL_COLUMNS = ["p_mantel", "q_mantel"]


def add_mantel(table, frame: dict[str, np.ndarray], models: tuple[list[str], list[str]], n_permutations: int,
               strata: dict[str, str] | None = None) -> str:
    """The model-level null beside the pair-level one (``stats.mantel_table``), with BH across the tested cells; the
    sentence that says why. ``strata``: checkpoints of one training run (rows pair checkpoints of one run only), so
    labels are permuted within each run."""
    from scipy.stats import false_discovery_control

    m = mantel_table({c: frame[c] for c in dict.fromkeys([*table["a"], *table["b"]])}, *models,
                     n_permutations=n_permutations, seed=0, strata=strata)
    table["p_mantel"] = [m.get((a, b), {}).get("p_mantel", np.nan) for a, b in zip(table["a"], table["b"])]
    p = table["p_mantel"].to_numpy(dtype=np.float64)
    q = np.full_like(p, np.nan)
    ok = np.isfinite(p) & np.isfinite(table["p_perm"].to_numpy(dtype=np.float64))
    if ok.any():
        q[ok] = false_discovery_control(p[ok])
    table["q_mantel"] = q
    n_models = len(set(models[0]) | set(models[1]))
    sig = int(np.sum(q[ok] < 0.05))
    n_rel = max((v.get("n_relabellings", 0.0) for v in m.values()), default=0.0)
    table.attrs["mantel_relabellings"] = float(n_rel if n_rel else math.factorial(n_models) if n_models <= 8 else n_permutations)
    if strata is not None:
        runs = len(set(strata.values()))
        return (f"Dependence: the {len(models[0])} checkpoint pairs are built from {n_models} checkpoints of {runs} training "
                f"run(s), so pairs that share a checkpoint are not independent and p_perm (row shuffles) treats them as if "
                f"they were. p_mantel permutes the checkpoint labels within each run instead (a Mantel-style null"
                + (f", {int(n_rel)} relabellings" if n_rel else "") + f"), q_mantel is BH across the table: {sig} cell(s) "
                "with q_mantel < 0.05.")
    return (f"Dependence: the {len(models[0])} pairs are built from {n_models} models, so pairs that share a model are not "
            f"independent and p_perm (row shuffles) treats them as if they were. p_mantel permutes the model labels "
            f"instead (a Mantel-style null, exact over all {n_models}! relabellings; its smallest attainable p is "
            f"about 1/{math.factorial(n_models) if n_models <= 8 else n_permutations}), q_mantel is BH across the "
            f"table: {sig} cell(s) with q_mantel < 0.05.")


def correlation_section(key: str, title: str, frame: dict[str, np.ndarray], n_rows: int, n_permutations: int,
                        intro: str, models: tuple[list[str], list[str]] | None = None,
                        strata: dict[str, str] | None = None, unit: str = "model",
                        null: str = "model-level null (model labels permuted)") -> tuple[Section, Any, dict[str, Any]]:
    """One correlation section: (the section, the correlation table or None when too small, the power statement).
    With ``models`` (each row's two models) the table also gets the model-level null (:func:`add_mantel`; ``strata``:
    permuted within each group, the checkpoints of one run); ``unit`` names what the rows share and ``null`` that
    null, in the table's note."""
    sec = Section(key, title)
    usable, dropped = _usable(frame, n_rows)
    if n_rows < 4 or len(usable) < 2:
        sec.missing.append(f"{title}: not measured ({n_rows} rows and {len(usable)} usable diagnostics; "
                           "a correlation table needs at least 4 rows and 2 diagnostics)")
        return sec, None, {}
    table = correlation_table(usable, n_permutations=n_permutations, seed=0)
    tested, power = _power(table, n_rows)
    top = tested.reindex(tested["rho"].abs().sort_values(ascending=False).index).head(1)
    strongest = (f"; the strongest cell is {top['a'].iloc[0]} x {top['b'].iloc[0]}, rho {top['rho'].iloc[0]:+.2f} "
                 f"(p_perm {top['p_perm'].iloc[0]:.3g})" if len(top) else "")
    need = power["min_significant_rho"]
    reach = (f"at this n an uncorrected test needs |rho| >= {need:.2f}" if math.isfinite(need) else
             f"at n={n_rows} no |rho| can reach p <= 0.05 (even |rho| = 1 has a larger permutation p)")
    sec.finding = (f"{power['survivors']} of {len(tested)} diagnostic pairs survive BH at q<0.05 over n={n_rows} rows"
                   f"{strongest}; {reach}.")
    sec.text.append(intro)
    sec.text.append(f"Power: {power['text_full']} Permutation null: {n_permutations} label shuffles per cell; "
                    "q_bh is Benjamini-Hochberg across the whole table.")
    cols = COLUMNS
    if models is not None:
        sec.text.append(add_mantel(table, frame, models, n_permutations, strata))
        cols = COLUMNS + MANTEL_COLUMNS
        sec.finding = mantel_finding(table, tested, n_rows, unit, strata is not None) + (
            f" Row shuffles, which treat the {n_rows} rows as independent (they are not: this is not a finding), would "
            f"give {power['survivors']} of {len(tested)}{strongest}.")
    if dropped:
        sec.missing.append(f"{title}: left out of the table, not measured or not varying: {', '.join(dropped)}")
    rows = sorted(table.to_dict("records"), key=lambda r: -abs(r["rho"]) if np.isfinite(r["rho"]) else 0)
    sec.tables.append(RTable(f"{title} (n={n_rows}, {len(tested)} cells)", cols,
                             [[r["a"], r["b"], str(r["n"]), f3(r["rho"]), f3(r["p_perm"], 4), f3(r["q_bh"], 4),
                               *(f3(r[c], 4) for c in cols[len(COLUMNS):])] for r in rows],
                             note="p_perm: two-sided permutation p (row shuffles: treats the rows as independent"
                                  + (f", which pairs sharing a {unit} are not" if models is not None else "")
                                  + "); q_bh: Benjamini-Hochberg across the table"
                                  + (f"; p_mantel / q_mantel: the {null} and its BH, the null that respects the shared {unit}s"
                                     if models is not None else "")
                                  + " (power: in the text above)"))
    return sec, table, power


def mantel_finding(table, tested, n_rows: int, unit: str, within: bool) -> str:
    """The finding of a table whose rows share models (or checkpoints): what survives BH under the null that respects
    it, and, where the design cannot reach q < 0.05 (too few relabellings for so many cells), "untestable at this n"
    with the strongest cells' signs."""
    n_cells = len(tested)
    q = table["q_mantel"].to_numpy(dtype=np.float64)
    sig = int(np.sum(q < 0.05))
    n_rel = float(table.attrs.get("mantel_relabellings") or 0.0)
    floor = 1.0 / n_rel if n_rel else float("nan")
    need = math.ceil(floor * n_cells / 0.05 - 1e-12) if math.isfinite(floor) else n_cells + 1
    what = "checkpoint-level null (labels permuted within each run)" if within else "model-level null (model labels permuted)"
    head = (f"Under the {what}, which respects that the {n_rows} rows share {unit}s, {sig} of {n_cells} diagnostic pairs "
            "survive BH at q<0.05")
    if need > 1 and math.isfinite(floor):
        top = tested.reindex(tested["rho"].abs().sort_values(ascending=False).index).head(3)
        signs = ", ".join(f"{a} x {b} {r:+.2f}" for a, b, r in zip(top["a"], top["b"], top["rho"]))
        reach = (f"untestable at this n: with {int(n_rel)} relabellings the smallest attainable p is {floor:.3g}, so one "
                 "cell alone cannot reach q < 0.05 "
                 + (f"(it takes at least {need} of the {n_cells} cells at that p)" if need <= n_cells else
                    "(not even with every cell at that p)"))
        return f"{head}; {reach}. Read the signs (the strongest: {signs})."
    return f"{head}."


def tabled(an: Analysis, arm: str, key: str, title: str, n_rows: int, intro: str, figure: tuple[str, str, str], csv_path: str,
            models: tuple[list[str], list[str]] | None = None, strata: dict[str, str] | None = None, **note: str) -> Section:
    """One arm's correlation section from its frame, with its heatmap (``figure`` = name, caption, heatmap title) and
    CSV table; the table joins the analysis."""
    sec, table, power = correlation_section(key, title, an.frames[arm], n_rows, an.n_permutations, intro, models=models,
                                            strata=strata, **note)
    if table is not None:
        sec.add_figure(figure[0], figure[1], lambda: figure_correlation(table, figure[2]))
        cols = COLUMNS + (MANTEL_COLUMNS if models is not None else [])
        an.csv[csv_path] = csv_text(cols, table[cols].itertuples(index=False, name=None))
        an.console_tables.append(sec.tables[0])
    an.correlations.update({arm: table, f"{arm}_power": power})
    return sec


def correlations_cross(an: Analysis, number: str) -> Section:
    """One row per cross-model pair, with the model-level (Mantel) null beside the pair-level one."""
    an.frames["cross"] = {c: np.array([p["values"].get(c, np.nan) for p in an.pairs], dtype=np.float64)
                          for c in cross_diagnostics(an.pairs)}
    n_pairs = len(an.pairs)
    return tabled(an, "cross", "corr_cross", f"{number}. Diagnostic x diagnostic Spearman correlations: cross-model arm", n_pairs,
                   "One row per cross-model pair. nll_mean = mean of the two models' NLL; transport_* = mean over "
                   "the two directions at the headline alpha (merge.headline_alpha), in the report's NLL scope. "
                   "typology_featural is URIEL's featural distance, which includes the syntax_knn features that "
                   "typology_syntactic is made of: their correlation is partly true by construction.",
                   ("correlations_cross_model", f"diagnostic correlation heatmap, cross-model arm (n={n_pairs})",
                    f"cross-model arm (n={n_pairs})"),
                   "tables/cross_model_correlations.csv", models=([str(p["a"]) for p in an.pairs], [str(p["b"]) for p in an.pairs]))


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
