"""Tables and figures built from MLflow runs (never from private files)."""

from __future__ import annotations

import csv
import io
from typing import Any

import numpy as np
from omegaconf import DictConfig
from rich.table import Table

from mergescope.progress import console
from mergescope.stats import correlation_table, power_statement  # noqa: F401  (the analysis API)
from mergescope.tracking import Tracker

REPR_METRICS = [("cka", "cka"), ("procrustes", "procrustes"), ("svcca", "svcca"), ("retrieval", "retrieval_p1"), ("mutual_knn", "mutual_knn")]


def fetch(tracker: Tracker, run_ids: list[str]) -> list[dict[str, Any]]:
    """Runs as flat records: tags, metrics (latest value), run id."""
    out = []
    for rid in run_ids:
        r = tracker.client.get_run(rid)
        out.append({"run_id": rid, **{f"tag.{k}": v for k, v in r.data.tags.items()}, **r.data.metrics})
    return out


def cka_matrix(records: list[dict[str, Any]], models: list[str]) -> np.ndarray:
    """Lower triangle matched CKA, upper triangle shuffled control, diagonal NaN (spec section 3)."""
    idx = {m: i for i, m in enumerate(models)}
    M = np.full((len(models), len(models)), np.nan)
    for r in records:
        if r.get("tag.metric") != "cka":
            continue
        i, j = idx[r["tag.model_a"]], idx[r["tag.model_b"]]
        lo, hi = max(i, j), min(i, j)
        M[lo, hi] = r["cka"]
        M[hi, lo] = r["cka_shuffled"]
    return M


def _matrix_table(M: np.ndarray, models: list[str]) -> Table:
    t = Table(title="Last-layer CKA: lower = matched, upper = shuffled control")
    t.add_column("")
    for m in models:
        t.add_column(m, justify="right")
    for i, m in enumerate(models):
        cells = []
        for j in range(len(models)):
            v = M[i, j]
            cells.append("—" if np.isnan(v) else (f"[italic dim]{v:.3f}[/]" if j > i else f"{v:.3f}"))
        t.add_row(m, *cells)
    return t


def _matrix_csv(M: np.ndarray, models: list[str]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([""] + models)
    for i, m in enumerate(models):
        w.writerow([m] + ["" if np.isnan(v) else f"{v:.6f}" for v in M[i]])
    return buf.getvalue()


def _matrix_figure(M: np.ndarray, models: list[str]):
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.2 * len(models) + 2, 1.0 * len(models) + 1.5))
    im = ax.imshow(np.nan_to_num(M, nan=0.0), vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks(range(len(models)), models, rotation=40, ha="right")
    ax.set_yticks(range(len(models)), models)
    for i in range(len(models)):
        for j in range(len(models)):
            if not np.isnan(M[i, j]):
                ax.text(j, i, f"{M[i, j]:.2f}", ha="center", va="center", color="w" if M[i, j] < 0.5 else "k", fontsize=9)
    ax.set_title("CKA: matched (lower) vs shuffled (upper)")
    fig.colorbar(im, ax=ax, fraction=0.046)
    return fig


def pair_table(records: list[dict[str, Any]]) -> tuple[Table, list[list[str]]]:
    """Per pair: every metric matched / shuffled."""
    by_pair: dict[str, dict[str, Any]] = {}
    for r in records:
        by_pair.setdefault(r["tag.pair"], {}).update({k: v for k, v in r.items() if not k.startswith("tag.")})
    cols = [key for _, key in REPR_METRICS]
    t = Table(title="Matched / shuffled, every metric")
    t.add_column("pair")
    for c in cols:
        t.add_column(c, justify="right")
    rows = []
    for pair, vals in by_pair.items():
        cells = [f"{vals[c]:.3f} / {vals[c + '_shuffled']:.3f}" if c in vals else "" for c in cols]
        t.add_row(pair, *cells)
        rows.append([pair, *cells])
    return t, rows


def coverage_table(rows) -> Table:
    """Spec section 2: per pair, which routes are defined and which difference blocks the rest."""
    t = Table(title="Coverage: which routes are defined for each pair")
    for c in ("pair", "native", "transport", "adapt"):
        t.add_column(c)
    for pair, rt in rows:
        cells = []
        for route in ("native", "transport", "adapt"):
            r = rt[route]
            cells.append(f"yes ({r['scope']})" if r["defined"] and r.get("scope") else "yes" if r["defined"] else f"no: {r['blocked_by']}")
        t.add_row(pair, *cells)
    return t


def native_table(records: list[dict[str, Any]]) -> Table:
    cols = ["log10_step_ratio", "weight_cosine", "weight_cosine_matrices", "relative_l2", "norm_ratio", "tv_cosine", "ties_sign_agreement", "cka",
            "lmc_barrier", "nll_a", "nll_t1", "best_merged_nll", "merge_gain"]
    t = Table(title="Native weight-space arm (per pair)")
    t.add_column("pair")
    for c in cols:
        t.add_column(c, justify="right")
    for r in records:
        t.add_row(r["tag.pair"], *[f"{r[c]:.3f}" if c in r else "—" for c in cols])
    return t


CHECKPOINT_DIAGNOSTICS = ["log10_step_ratio", "weight_cosine", "relative_l2", "tv_cosine", "ties_sign_agreement",
                          "cka", "lmc_barrier", "merge_gain"]


def checkpoint_correlations(records: list[dict[str, Any]], n_permutations: int = 20000) -> tuple[Table, str]:
    """Spec section 8 (checkpoint arm): Spearman rho between diagnostics over checkpoint pairs,
    permutation p-values and BH q-values across the table, with the power statement for this n."""
    frame = {c: np.array([r.get(c, np.nan) for r in records], dtype=np.float64) for c in CHECKPOINT_DIAGNOSTICS}
    table = correlation_table(frame, n_permutations=n_permutations, seed=0)
    rows = table.to_dict("records") if hasattr(table, "to_dict") else list(table)
    power = power_statement(len(records), n_tests=len(rows))
    t = Table(title=f"Checkpoint arm: diagnostic x diagnostic Spearman (n={len(records)} pairs, "
                    f"{n_permutations} permutations, BH across the table)", caption=power["text"])
    for c in ("a", "b", "n", "rho", "p_perm", "q_bh"):
        t.add_column(c, justify="right")
    for r in sorted(rows, key=lambda r: -abs(r["rho"]) if np.isfinite(r["rho"]) else 0):
        t.add_row(r["a"], r["b"], str(r["n"]), *[f"{r[k]:.3f}" if np.isfinite(r[k]) else "—" for k in ("rho", "p_perm", "q_bh")])
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["a", "b", "n", "rho", "p_perm", "q_bh"])
    w.writerows([[r["a"], r["b"], r["n"], r["rho"], r["p_perm"], r["q_bh"]] for r in rows])
    return t, buf.getvalue()


def summarise_study(cfg: DictConfig, models: list[str], results, quality, train_results, overrides: list[str],
                    coverage_rows=(), native=()) -> dict[str, Any]:
    tracker = Tracker(cfg)
    records = fetch(tracker, [r.run_id for _, r in results])
    M = cka_matrix(records, models)
    console.print(_matrix_table(M, models))
    ptable, prows = pair_table(records)
    console.print(ptable)

    qrec = {m: fetch(tracker, [q.run_id])[0] for m, q in quality.items()}
    trec = {m: fetch(tracker, [t.run_id])[0] for m, t in train_results.items()}
    qt = Table(title="Per-model quality (nats/token)")
    for c in ("model", "FLORES nll", "held-out nll (train text)", "unigram nll"):
        qt.add_column(c, justify="right")
    for m in models:
        tr = trec.get(m, {})
        fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else ""  # noqa: E731
        qt.add_row(m, fmt(qrec[m].get("nll")), fmt(tr.get("heldout_nll")), fmt(tr.get("unigram_nll")))
    console.print(qt)

    extra_tables = []
    if coverage_rows:
        extra_tables.append(coverage_table(coverage_rows))
    nrec = fetch(tracker, [r.run_id for _, r in native])
    corr_csv = None
    if nrec:
        extra_tables.append(native_table(nrec))
        ck = [r for r in nrec if r.get("tag.arm") == "checkpoint"]
        if len(ck) >= 4:
            corr, corr_csv = checkpoint_correlations(ck)
            extra_tables.append(corr)
    for t in extra_tables:
        console.print(t)

    n_above = int(sum(1 for r in records if r.get("tag.metric") == "cka" and r["cka"] > r["cka_shuffled"]))
    n_cka = int(sum(1 for r in records if r.get("tag.metric") == "cka"))
    with tracker.start(cfg, "analysis:study", {"kind": "analysis", "study": cfg.tracking.experiment}, overrides) as job:
        job.log_text(_matrix_csv(M, models), "tables/cka_matrix.csv")
        buf = io.StringIO()
        csv.writer(buf).writerows([["pair"] + [k for _, k in REPR_METRICS]] + prows)
        job.log_text(buf.getvalue(), "tables/pairs_matched_shuffled.csv")
        console_text = _tables_text([_matrix_table(M, models), ptable, qt, *extra_tables])
        job.log_text(console_text, "tables/summary.txt")
        if corr_csv is not None:
            job.log_text(corr_csv, "tables/checkpoint_correlations.csv")
        fig = _matrix_figure(M, models)
        job.log_figure(fig, "figures/cka_matched_vs_shuffled.png")
        job.log_metrics({"pairs_cka_above_shuffled": n_above, "pairs_cka": n_cka})
        job.log_params({"runs": [r.run_id for _, r in results], "native_runs": [r.run_id for _, r in native]})
    return {"cka_matrix": M, "models": models, "records": records, "pairs_above": n_above, "pairs": n_cka}


def _tables_text(tables: list[Table]) -> str:
    from rich.console import Console

    c = Console(record=True, width=160, file=io.StringIO())
    for t in tables:
        c.print(t)
    return c.export_text()


def latest_by_hash(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (pair, metric): the most recent FINISHED run (records come newest first)."""
    seen, out = set(), []
    for r in records:
        key = (r.get("tag.pair"), r.get("tag.metric"))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the CKA matrix and the matched/shuffled table of an experiment, from MLflow alone.

    python -m mergescope.analysis [--experiment toy] [--root .]
    """
    import argparse

    from omegaconf import OmegaConf

    p = argparse.ArgumentParser(description="Tables of an experiment's measure runs, read from MLflow.")
    p.add_argument("--experiment", default="toy")
    p.add_argument("--root", default=".")
    a = p.parse_args(argv)
    cfg = OmegaConf.create({"paths": {"root": a.root}, "tracking": {"experiment": a.experiment}})
    tracker = Tracker(cfg)
    runs = tracker.runs("tags.kind = 'measure'")
    records = latest_by_hash([{"run_id": r.info.run_id, **{f"tag.{k}": v for k, v in r.data.tags.items()}, **r.data.metrics} for r in runs])
    if not records:
        print(f"no FINISHED measure runs in experiment '{a.experiment}'")
        return 1
    models: list[str] = []
    for r in records:
        for k in ("tag.model_a", "tag.model_b"):
            if r[k] not in models:
                models.append(r[k])
    console.print(_matrix_table(cka_matrix(records, models), models))
    console.print(pair_table(records)[0])
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
