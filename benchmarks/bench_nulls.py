"""The permutation nulls of the representation metrics: each metric's vectorised null (Grams, masks or factors built
once, a gather per permutation) against recomputing the metric on every permuted copy, at the real study's shape
(1012 sentences, widths 576 and 1536, float64), with the largest difference between the two.

    python benchmarks/bench_nulls.py [--n 1012] [--da 576] [--db 1536] [--permutations 50]

Prints per metric the seconds per permutation of each path and their ratio (loop / vectorised).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from mergescope.metrics.calibrate import draw_permutations
from mergescope.registry import metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1012)
    ap.add_argument("--da", type=int, default=576)
    ap.add_argument("--db", type=int, default=1536)
    ap.add_argument("--permutations", type=int, default=50)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((a.n, a.da))
    y = x @ rng.standard_normal((a.da, a.db)) / np.sqrt(a.da) + rng.standard_normal((a.n, a.db))
    perms = draw_permutations(a.n, a.permutations, seed=1)
    print(f"n = {a.n}, widths {a.da} and {a.db}, {a.permutations} permutations, {torch.get_num_threads()} threads")
    print("| metric | loop s / permutation | vectorised s / permutation | loop / vectorised | largest difference |")
    print("|---|---|---|---|---|")
    metrics.discover()
    for entry in metrics.entries():
        null = entry.meta.get("null")
        if null is None:
            continue
        name, headline = entry.name, entry.headline
        t0 = time.perf_counter()
        loop = [entry.fn(x, y[p.numpy()], device="cpu")[headline] for p in perms]
        t_loop = (time.perf_counter() - t0) / len(perms)
        t0 = time.perf_counter()
        fast = null(x, y, perms, device="cpu")
        t_fast = (time.perf_counter() - t0) / len(perms)
        diff = float(np.max(np.abs(np.asarray(loop) - np.asarray(fast))))
        print(f"| {name} | {t_loop:.4f} | {t_fast:.4f} | {t_loop / t_fast:.1f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
