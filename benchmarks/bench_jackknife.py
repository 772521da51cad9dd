"""Cost of the 50-block jackknife CKA interval as a multiple of one linear CKA.

    python benchmarks/bench_jackknife.py                 # the study's shapes: n=1012, dA=2048, dB=1536
    python benchmarks/bench_jackknife.py --n 500 --da 256 --db 128 --repeats 7

Times (median of --repeats) one ``linear_cka``, ``cka_jackknife(n_blocks=G)`` (downdated moments)
and a naive jackknife (G full recomputations of linear CKA with one contiguous block deleted),
prints the ratios jackknife / one CKA (target <= 1.5x) and naive / jackknife, and checks that the
naive and fast intervals agree to 1e-10. Exit status 1 if they do not.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from mergescope.metrics import cka_jackknife, linear_cka
from mergescope.device import resolve_device
from mergescope.metrics.cka import Z95, block_slices

TARGET = 1.5  # the speed targets: the interval <= 1.5x one CKA


def make_data(n: int, da: int, db: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sides sharing a 64-dim latent plus noise (a non-trivial CKA), float64 on ``device``."""
    r = np.random.default_rng(seed)
    z = r.standard_normal((n, 64))
    x = z @ r.standard_normal((64, da)) + 2.0 * r.standard_normal((n, da)) + 1.0
    y = z @ r.standard_normal((64, db)) + 2.0 * r.standard_normal((n, db)) - 3.0
    return (torch.as_tensor(x, device=device), torch.as_tensor(y, device=device))


def naive_jackknife(x: torch.Tensor, y: torch.Tensor, n_blocks: int, device: str) -> tuple[float, float, float]:
    """G full recomputations of linear CKA with one contiguous block deleted."""
    n = x.shape[0]
    est = linear_cka(x, y, device=device)
    loo = []
    for s in block_slices(n, n_blocks):
        keep = torch.cat([torch.arange(0, s.start), torch.arange(s.stop, n)]).to(x.device)
        loo.append(linear_cka(x[keep], y[keep], device=device))
    loo_t = torch.tensor(loo, dtype=torch.float64)
    g = n_blocks
    se = float(torch.sqrt((g - 1) / g * (loo_t - loo_t.mean()).pow(2).sum()))
    return est, est - Z95 * se, est + Z95 * se


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> tuple[float, list[float], object]:
    times, out = [], None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1012, help="sentences (rows)")
    ap.add_argument("--da", type=int, default=2048, help="width of side A")
    ap.add_argument("--db", type=int, default=1536, help="width of side B")
    ap.add_argument("--blocks", type=int, default=50, help="jackknife blocks")
    ap.add_argument("--repeats", type=int, default=5, help="repeats of one CKA and of the fast jackknife")
    ap.add_argument("--naive-repeats", type=int, default=3, help="repeats of the naive jackknife")
    ap.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    x, y = make_data(args.n, args.da, args.db, args.seed, device)
    dev = str(device)
    print(
        f"n={args.n} dA={args.da} dB={args.db} blocks={args.blocks} device={device} "
        f"threads={torch.get_num_threads()} torch={torch.__version__}"
    )

    # warm-up (allocator, BLAS thread pools, CUDA kernels)
    linear_cka(x, y, device=dev)
    cka_jackknife(x, y, n_blocks=args.blocks, device=dev)

    t_one, ts_one, est = timed(lambda: linear_cka(x, y, device=dev), args.repeats, device)
    t_jk, ts_jk, fast = timed(lambda: cka_jackknife(x, y, n_blocks=args.blocks, device=dev), args.repeats, device)
    t_nv, ts_nv, naive = timed(lambda: naive_jackknife(x, y, args.blocks, dev), args.naive_repeats, device)

    def fmt(ts: list[float]) -> str:
        return ", ".join(f"{t:.4f}" for t in ts)

    print(f"one linear_cka        median {t_one:9.4f} s   [{fmt(ts_one)}]")
    print(f"cka_jackknife (fast)  median {t_jk:9.4f} s   [{fmt(ts_jk)}]")
    print(f"naive jackknife       median {t_nv:9.4f} s   [{fmt(ts_nv)}]")
    ratio = t_jk / t_one
    print(f"ratio jackknife / one CKA = {ratio:.2f}x  (target <= {TARGET:g}x: {'OK' if ratio <= TARGET else 'ABOVE'})")
    print(f"ratio naive / jackknife   = {t_nv / t_jk:.1f}x")

    diff = max(abs(a - b) for a, b in zip(fast, naive))
    print(f"CKA = {fast[0]:.12f}  fast CI = [{fast[1]:.12f}, {fast[2]:.12f}]")
    print(f"                       naive CI = [{naive[1]:.12f}, {naive[2]:.12f}]")
    print(f"max |fast - naive| = {diff:.2e}  ({'agree to 1e-10' if diff <= 1e-10 else 'DISAGREE'})")
    assert abs(fast[0] - float(est)) <= 1e-12
    return 0 if diff <= 1e-10 else 1


if __name__ == "__main__":
    raise SystemExit(main())
