"""The coverage of the paired interval on planted nulls (mergescope.intervals), beside the plain percentile bootstrap
over articles it replaced, and the tie rate of a control seed held out against the others.

Each planted null has two arms with equal expected NLL per token, FLORES devtest's article sizes, a shared article
difficulty, and an arm difference with mean 0 made of an article part and a sentence part drawn from one of four
shapes (normal, t with 3 degrees of freedom, lognormal(0, 0.5) and lognormal(0, 1), centred). Prints one Markdown
table (coverage of the 95% interval, its Monte Carlo standard error) and the held-out seed's tie rate.

    python benchmarks/coverage.py [--reps 600]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from mergescope.intervals import paired_difference

SIZES = np.array([3, 4, 5, 2, 3, 5, 4, 3, 2, 5, 3, 4, 2, 3, 5, 4, 3, 3, 2, 4, 5, 3, 4, 2, 3, 6, 4, 3, 5, 2])
SHAPES = {"normal": lambda r, m: r.normal(0, 1, m), "t(3)": lambda r, m: r.standard_t(3, m),
          "lognormal(0, 0.5)": lambda r, m: r.lognormal(0, 0.5, m) - math.exp(0.125),
          "lognormal(0, 1)": lambda r, m: r.lognormal(0, 1.0, m) - math.exp(0.5)}


def _null(rng, g: int, shape: str):
    gi = np.repeat(np.arange(g), rng.choice(SIZES, g))
    n = gi.size
    tok = rng.integers(15, 45, n).astype(float)
    base = rng.normal(3.0, 0.3, g)[gi] + rng.normal(0, 0.3, n)
    diff = 0.02 * SHAPES[shape](rng, n) + 0.02 * SHAPES[shape](rng, g)[gi]
    return (base + diff / 2) * tok, (base - diff / 2) * tok, tok, gi


def _percentile(na, nb, tok, gi, rng, n_boot=2000) -> bool:
    """The plain percentile bootstrap over groups (the interval this project used before): does it cover 0?"""
    g = gi.max() + 1
    nd, d = np.bincount(gi, na - nb, g), np.bincount(gi, tok, g)
    w = rng.multinomial(g, np.full(g, 1.0 / g), size=n_boot).astype(float)
    lo, hi = np.quantile((w @ nd) / (w @ d), [0.025, 0.975])
    return bool(lo <= 0 <= hi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=600)
    args = ap.parse_args()
    t0 = time.time()
    print("| shape | articles | studentized (this rule) | percentile (before) |\n|---|---|---|---|")
    se = math.sqrt(0.95 * 0.05 / args.reps)
    for shape in SHAPES:
        for g in (10, 15, 30, 60):
            new = old = 0
            for s in range(args.reps):
                rng = np.random.default_rng([g, s, len(shape)])
                na, nb, tok, gi = _null(rng, g, shape)
                r = paired_difference(na, nb, tok, groups=gi, seed=s)
                new += r.lo <= 0 <= r.hi
                old += _percentile(na, nb, tok, gi, rng)
            print(f"| {shape} | {g} | {new / args.reps:.3f} | {old / args.reps:.3f} |", flush=True)
    print(f"\n({args.reps} planted nulls per cell; Monte Carlo standard error about {se:.3f} at 0.95)")
    ties = total = 0
    for s in range(args.reps // 5):
        rng = np.random.default_rng([7, s])
        gi = np.repeat(np.arange(40), rng.integers(2, 6, 40))
        tok = rng.integers(15, 45, gi.size).astype(float)
        base = rng.normal(3, 0.3, 40)[gi] + rng.normal(0, 0.3, gi.size)
        seeds = np.stack([(base + rng.normal(0, 0.003)) * tok for _ in range(5)])
        for h in range(5):
            ties += paired_difference(seeds[h], np.delete(seeds, h, 0), tok, groups=gi, seed=s).verdict == "tie"
            total += 1
    print(f"held-out control seed against the other four (seed-level spread only): tie in {ties / total:.3f} of {total}")
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
