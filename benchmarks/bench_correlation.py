"""Speed of the vectorised permutation correlation table against a scipy.stats.spearmanr loop.

    python benchmarks/bench_correlation.py                       # 11 columns (55 cells), n=106, 20000 perms
    python benchmarks/bench_correlation.py --cols 11 --rows 106 --perms 20000 --loop-perms 200 --repeats 3

Times (median of --repeats) ``mergescope.stats.correlation_table`` on a synthetic checkpoint-arm
table (n=106 rows like the spec's checkpoint arm, 11 diagnostics with a few planted correlations
and 10% missing values in one column). The baseline is the naive loop: for every cell and every
permutation, ``scipy.stats.spearmanr(a[perm], b)`` on the pairwise-complete rows. Running it in full
(55 x 20000 = 1.1M spearmanr calls) takes minutes, so only ``--loop-perms`` permutations per cell are
timed and the time is extrapolated linearly to ``--perms``; the script says so in its output.
Prints both times and the ratio (target >= 50x); exit status 1 below the target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from scipy import stats

from mergescope.stats import correlation_table

TARGET = 50.0


def make_frame(rows: int, cols: int, seed: int) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    x = r.standard_normal(rows)
    out: dict[str, np.ndarray] = {}
    for j in range(cols):
        if j % 3 == 0:
            out[f"d{j}"] = x * (0.2 + 0.1 * j) + r.standard_normal(rows)
        elif j % 3 == 1:
            out[f"d{j}"] = np.exp(0.5 * x + r.standard_normal(rows))
        else:
            out[f"d{j}"] = r.standard_normal(rows)
    gaps = r.choice(rows, rows // 10, replace=False)
    out["d1"][gaps] = (
        np.nan
    )  # one column with missing values: its cells use pairwise-complete rows
    return out


def loop_baseline(frame: dict[str, np.ndarray], n_perm: int, seed: int) -> np.ndarray:
    """Naive: one scipy.stats.spearmanr call per permutation per cell. Returns the p-values."""
    rng = np.random.default_rng(seed)
    names = list(frame)
    ps = []
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            a, b = frame[names[i]], frame[names[j]]
            mask = np.isfinite(a) & np.isfinite(b)
            a, b = a[mask], b[mask]
            obs = abs(stats.spearmanr(a, b).statistic)
            hits = 0
            for _ in range(n_perm):
                hits += (
                    abs(stats.spearmanr(a[rng.permutation(a.size)], b).statistic)
                    >= obs - 1e-12
                )
            ps.append((hits + 1) / (n_perm + 1))
    return np.array(ps)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, default=106)
    ap.add_argument("--cols", type=int, default=11)
    ap.add_argument("--perms", type=int, default=20000)
    ap.add_argument(
        "--loop-perms",
        type=int,
        default=200,
        help="permutations per cell actually run in the loop",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    frame = make_frame(args.rows, args.cols, args.seed)
    n_cells = args.cols * (args.cols - 1) // 2
    correlation_table(
        frame, n_permutations=200, seed=args.seed
    )  # warm-up (imports, caches)

    fast_times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        table = correlation_table(frame, n_permutations=args.perms, seed=args.seed)
        fast_times.append(time.perf_counter() - t0)
    fast = statistics.median(fast_times)

    loop_times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        loop_baseline(frame, args.loop_perms, args.seed)
        loop_times.append(time.perf_counter() - t0)
    loop_measured = statistics.median(loop_times)
    loop_full = loop_measured * args.perms / args.loop_perms

    ratio = loop_full / fast
    print(
        f"table: {args.cols} columns -> {n_cells} cells, n={args.rows} rows, {args.perms} permutations per cell"
    )
    print(
        f"correlation_table (vectorised):   {fast:8.3f} s   (median of {args.repeats})"
    )
    print(
        f"spearmanr loop, {args.loop_perms} perms/cell: {loop_measured:8.3f} s measured (median of {args.repeats}); "
        f"extrapolated linearly to {args.perms} perms/cell: {loop_full:8.1f} s"
    )
    print(f"speed-up: {ratio:.0f}x (target >= {TARGET:.0f}x)")
    n_disc = (
        int((table["q_bh"] < 0.05).sum())
        if hasattr(table, "columns")
        else sum(r["q_bh"] < 0.05 for r in table)
    )
    print(f"(sanity: {n_disc} of {n_cells} cells with q_bh < 0.05)")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
