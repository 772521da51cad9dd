"""The batched per-layer plans: mergescope's home-made batched Sinkhorn (``transport.ot.sinkhorn_batched``, POT's
``sinkhorn_knopp`` step for step, each problem stopping on its own) against POT's maintained batched solvers
(``ot.batch.solve_batch``, POT >= 0.9.6: ``method="sinkhorn"`` and ``"log_sinkhorn"``, the whole batch stopping
together), on the stacks ``align_layers`` solves: one target layer's 2 x L_donor neuron-cost matrices (1 - Pearson
between correlated random activations).

Per solver: wall time (median of ``--repeat``), iterations, the largest L1 marginal error over the stack (rows and
columns), and the largest entry difference to a reference plan per problem (POT's log-domain Sinkhorn on that problem
alone to a marginal error of 1e-13), and to our plan. Then the ratio POT / ours in time. At the working tolerance
(``--tol``, merge.marginal_tol) the two solvers stop at different iterates (POT updates the row scaling first and stops
when the worst problem of the batch meets the tolerance; ours updates the column scaling first and stops each problem
on its own), so their plans agree to the tolerance, not to 1e-10; at ``--tol 1e-13`` both reach the reference.

    python benchmarks/bench_batch_sinkhorn.py [--n 256] [--m 320] [--batch 16] [--eps 0.01] [--tol 1e-5]
        [--device cpu|cuda] [--threads 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings

import numpy as np
import torch


def costs(n: int, m: int, batch: int, samples: int = 256, seed: int = 0) -> torch.Tensor:
    from mergescope.transport.ot import pearson_cost

    g = torch.Generator().manual_seed(seed)
    X = torch.randn(samples, n, generator=g, dtype=torch.float64)
    out = []
    for b in range(batch):
        strength = 0.2 + 3.0 * b / max(1, batch - 1)  # from weakly to strongly correlated layer pairs
        Y = torch.randn(samples, m, generator=g, dtype=torch.float64) + strength * X[:, torch.randperm(m, generator=g) % n]
        out.append(pearson_cost(X, Y))
    return torch.stack(out)


def marginal_l1(Q: torch.Tensor) -> float:
    n, m = Q.shape
    return float(max((Q.sum(1) - 1 / n).abs().sum(), (Q.sum(0) - 1 / m).abs().sum()))


def timed(fn, repeat: int, device: str):
    times, out = [], None
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--m", type=int, default=320)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--eps", type=float, default=0.01)
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--max-iter", type=int, default=20000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import ot
    from ot.batch import solve_batch

    from mergescope.transport.ot import sinkhorn_batched

    C = costs(a.n, a.m, a.batch).to(a.device)
    ref = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for Ci in C.cpu():
            ref.append(torch.from_numpy(ot.sinkhorn(np.full(a.n, 1 / a.n), np.full(a.m, 1 / a.m), Ci.numpy(), a.eps,
                                                    method="sinkhorn_log", stopThr=1e-13, numItermax=200_000)))
    stop = a.tol / math.sqrt(max(a.n, a.m))  # the L2 marginal stop that gives an L1 error under tol (ours uses it too)
    t_ours, (plans, iters) = timed(lambda: sinkhorn_batched(C, a.eps, a.max_iter, a.tol), a.repeat, a.device)
    rows = [("ours (sinkhorn_batched)", t_ours, f"{min(iters)}-{max(iters)}", [p.cpu() for p in plans])]
    for method in ("sinkhorn", "log_sinkhorn"):
        def run(method=method):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return solve_batch(C, reg=a.eps, max_iter=a.max_iter, tol=stop, method=method, grad="detach")
        t, res = timed(run, a.repeat, a.device)
        rows.append((f"ot.batch {method}", t, str(res.log.get("n_iter", "?")) if getattr(res, "log", None) else "?",
                     [p for p in res.plan.cpu()]))
    print(f"stack of {a.batch} plans {a.n} x {a.m}, epsilon {a.eps}, tol {a.tol:g} (L1), device {a.device}, "
          f"{a.threads} threads, median of {a.repeat}")
    print(f"{'solver':28s} {'time s':>8s} {'iters':>10s} {'max L1 marg.':>13s} {'max |Q - ref|':>14s} {'max |Q - ours|':>15s}")
    for name, t, it, P in rows:
        marg = max(marginal_l1(p) for p in P) if all(p is not None for p in P) else math.inf
        dref = max(float((p - r).abs().max()) for p, r in zip(P, ref)) if all(p is not None for p in P) else math.inf
        dours = max(float((p - q).abs().max()) for p, q in zip(P, rows[0][3]))
        print(f"{name:28s} {t:8.3f} {it:>10s} {marg:13.2e} {dref:14.2e} {dours:15.2e}")
    for name, t, _, _ in rows[1:]:
        print(f"ratio {name} / ours: {t / t_ours:.2f}x ({'POT faster' if t < t_ours else 'ours faster'})")


if __name__ == "__main__":
    main()
