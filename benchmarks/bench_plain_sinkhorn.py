"""Plain Sinkhorn on 256 x 256 neuron plans, the layer-cost pass's size: ``mergescope.transport.ot.sinkhorn_knopp``
(POT's steps without its backend's dispatch) against POT's ``ot.sinkhorn(method="sinkhorn")``. The costs are 1 - Pearson
correlation between two sides' neurons driven by one shared latent (dense, moderate correlations, as a model's pooled
activations give), at epsilon 0.01 and the project's stop (1e-5 / sqrt(256)). Every plan and iteration count must be
POT's to the bit; prints seconds for all plans each way, the mean iterations and the ratio.

    python benchmarks/bench_plain_sinkhorn.py [--plans 24 --n 256 --samples 128 --epsilon 0.01]
"""

from __future__ import annotations

import argparse
import math
import time
import warnings

import numpy as np


def costs(plans: int, n: int, samples: int, seed: int = 0) -> list[np.ndarray]:
    import torch

    from mergescope.transport.ot import pearson_cost

    rng = np.random.default_rng(seed)
    out = []
    for k in range(plans):
        z = rng.standard_normal((samples, 16))
        noise = 1.0 + 0.5 * (k % 4)
        x = z @ rng.standard_normal((16, n)) + noise * rng.standard_normal((samples, n))
        y = z @ rng.standard_normal((16, n)) + noise * rng.standard_normal((samples, n))
        out.append(pearson_cost(torch.from_numpy(x), torch.from_numpy(y)).numpy())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", type=int, default=24)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--epsilon", type=float, default=0.01)
    a = ap.parse_args()
    import ot

    from mergescope.transport.ot import sinkhorn_knopp

    Cs = costs(a.plans, a.n, a.samples)
    p = np.full(a.n, 1.0 / a.n)
    stop = 1e-5 / math.sqrt(a.n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ot.sinkhorn(p, p, Cs[0], a.epsilon, stopThr=stop, log=True, warn=False)  # POT's imports and first call apart
        t0 = time.perf_counter()
        refs = [ot.sinkhorn(p, p, C, a.epsilon, numItermax=20000, stopThr=stop, log=True, warn=False) for C in Cs]
        t_pot = time.perf_counter() - t0
        t0 = time.perf_counter()
        ours = [sinkhorn_knopp(p, p, C, a.epsilon, 20000, stop) for C in Cs]
        t_ours = time.perf_counter() - t0
    for (Q, it), (ref, log) in zip(ours, refs):
        assert it == log["niter"] and np.array_equal(Q, ref), "a plan or an iteration count differs from POT's"
    iters = np.mean([it for _, it in ours])
    print(f"{a.plans} plans of {a.n} x {a.n} at epsilon {a.epsilon}, {iters:.0f} iterations on average: POT {t_pot:.2f} s, "
          f"sinkhorn_knopp {t_ours:.2f} s ({t_pot / t_ours:.2f}x); every plan and iteration count identical")


if __name__ == "__main__":
    main()
