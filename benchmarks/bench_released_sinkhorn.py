"""merge=transport_released's neuron Sinkhorn: the same iterates in the scaling domain (two batched mat-vecs an
iteration) against the log domain (two log-sum-exps over the whole matrix), on a stack of correlation costs of a real
pair's shapes (SmolLM2-135M 576 x Qwen2.5-Coder-0.5B 896 by default, 128 pooled probe sentences). Prints per epsilon
the iterations (equal by construction), the wall time of each (median of --repeat) and the ratio log / scaling, and
the largest plan difference relative to the plan's largest entry.

    python benchmarks/bench_released_sinkhorn.py [--n 576] [--m 896] [--batch 4] [--samples 128] [--threads 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mergescope.transport import ot as tot
from mergescope.transport import released as rel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=576)
    ap.add_argument("--m", type=int, default=896)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(a.samples, a.n, generator=g, dtype=torch.float64)
    C = torch.stack([tot.pearson_cost(X, torch.randn(a.samples, a.m, generator=g, dtype=torch.float64)
                                      + s * X[:, torch.arange(a.m) % a.n]) for s in torch.linspace(0, 2, a.batch).tolist()])
    span = rel.SCALING_SPAN
    for eps in (0.1, 0.01):
        times, out = {}, {}
        for name, limit in (("scaling", span), ("log", -1.0)):
            rel.SCALING_SPAN = limit
            ts = []
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                out[name] = rel.released_sinkhorn(C, eps)
                ts.append(time.perf_counter() - t0)
            times[name] = statistics.median(ts)
        rel.SCALING_SPAN = span
        (Qs, its), (Ql, itl) = out["scaling"], out["log"]
        diff = float((Qs - Ql).abs().max() / Ql.abs().max())
        print(f"eps {eps}: iterations {its} (log domain {itl}); scaling {times['scaling']:.3f} s, log {times['log']:.3f} s, "
              f"ratio log / scaling {times['log'] / times['scaling']:.1f}x; max |plan diff| / max plan {diff:.1e}")


if __name__ == "__main__":
    main()
