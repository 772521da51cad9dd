"""The LM head's online log-sum-exp, per tile of 512 positions x 8192 vocabulary rows, against the head's matrix product
alone: what scoring a sentence costs beyond the product the floating-point count charges. Three ways on one random
float32 head: the product alone; ``mergescope.scoring.bpb``'s tile (the tile's maximum, exponentials and row sums in
float32, the running sums in float64); and the same tile widened to float64 before anything else (how it was done
before: a 4M-entry float64 copy per tile). Prints milliseconds per 512 positions, each way over the product alone,
and the largest difference in the log-sum-exp between the two tiles (the target logits and argmax rows must agree).

    python benchmarks/bench_head_tile.py [--vocab 262144 --hidden 640 --repeats 3]

Gemma-3-270M's head is 262144 x 640, SmolLM2-135M's 49152 x 576, Qwen2.5-Coder-0.5B's 151936 x 896.
"""

from __future__ import annotations

import argparse
import math
import time

import torch


def widened_tile(head, h: torch.Tensor, tgt: torch.Tensor, block: int):
    """The tile with its logits widened to float64 first (the reference)."""
    n = h.shape[0]
    top = torch.full((n,), -math.inf, dtype=torch.float64)
    total = torch.zeros(n, dtype=torch.float64)
    picked = torch.zeros(n, dtype=torch.float64)
    best = torch.zeros(n, dtype=torch.long)
    for v0 in range(0, head.vocab, block):
        lg = head(h, slice(v0, min(v0 + block, head.vocab))).double()
        here = (tgt >= v0) & (tgt < v0 + lg.shape[1])
        picked[here] = lg[here, tgt[here] - v0]
        btop, barg = lg.max(-1)
        best = torch.where(btop > top, barg + v0, best)
        new = torch.maximum(top, btop)
        total = total * torch.exp(top - new) + lg.sub_(new.unsqueeze(1)).exp_().sum(-1)
        top = new
    return top + total.log(), picked, best


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--hidden", type=int, default=640)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from mergescope.scoring import bpb

    g = torch.Generator().manual_seed(0)
    positions, block = bpb.TILE_POSITIONS, bpb.CHUNK_ELEMENTS["cpu"] // bpb.TILE_POSITIONS
    head = bpb.Head.__new__(bpb.Head)  # a bare head: the weight alone, no bias, no soft-capping
    head.weight = torch.randn(a.vocab, a.hidden, generator=g) * (3.0 / math.sqrt(a.hidden))
    head.rows, head.bias, head.cap, head.vocab = a.vocab, None, None, a.vocab
    h = torch.randn(positions, a.hidden, generator=g)
    tgt = torch.randint(0, a.vocab, (positions,), generator=g)

    product = best_of(lambda: [torch.nn.functional.linear(h, head.weight[v:v + block]) for v in range(0, a.vocab, block)], a.repeats)
    tile = best_of(lambda: bpb._tile(head, h, tgt, block), a.repeats)
    wide = best_of(lambda: widened_tile(head, h, tgt, block), a.repeats)
    ours, ref = bpb._tile(head, h, tgt, block), widened_tile(head, h, tgt, block)
    assert torch.equal(ours[1], ref[1]) and torch.equal(ours[2], ref[2]), "the target logits or the argmax rows differ"
    gap = float((ours[0] - ref[0]).abs().max())
    assert gap < 1e-5, f"the log-sum-exp differs by {gap:.2e}"
    gflops = 2.0 * positions * a.vocab * a.hidden / product / 1e9
    print(f"head {a.vocab} x {a.hidden}, {positions} positions, tiles of {block} rows; torch threads {torch.get_num_threads()}")
    print(f"  product alone {product * 1e3:.0f} ms ({gflops:.0f} GFLOP/s); tile {tile * 1e3:.0f} ms ({tile / product:.2f}x the product); "
          f"widened to float64 {wide * 1e3:.0f} ms ({wide / product:.2f}x); widened / tile {wide / tile:.2f}x; "
          f"log-sum-exp max difference {gap:.1e} nats")


if __name__ == "__main__":
    main()
