"""Peak memory of one NLL batch on a Gemma-sized vocabulary (262144 rows): the full-logits path against the project's
chunked head (:mod:`mergescope.scoring.bpb`). Not a timing.

A tiny Gemma 3 text model (2 layers, hidden 64, final-logit soft-capping 30, float32) scores a batch of
``--batch`` x ``--length`` random tokens twice, each in a fresh process so that neither sees the other's peak:

- ``full``: what the NLL paths did before (the model's forward returns every position's logits, batch x length x
  vocabulary float32, then a float64 copy and a log-softmax over it);
- ``chunked``: :func:`mergescope.scoring.bpb.window_scores` (the forward keeps one position's logits; the head, the
  soft-capping and the log-softmax run on chunks of at most ``CHUNK_ELEMENTS`` logits).

plus ``body``, the model's forward alone with one position's logits (what every path needs). Each process runs one
small warm-up forward, then reports its peak resident memory above what it held just before the measured forward (``ru_maxrss`` against the
current RSS; glibc's mmap threshold is fixed at 1 MB, so that a freed tensor leaves the resident set and the figure is
the live tensors' peak, not the allocator's fragmentation; on CUDA, ``torch.cuda.max_memory_allocated`` above the
allocation before), and the NLLs, which must agree. The script prints the peaks and the full / chunked ratio.

    python benchmarks/bench_nll_memory.py [--batch 4] [--length 128] [--vocab 262144] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def model_and_batch(vocab: int, batch: int, length: int, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma3_text", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=32,
                               final_logit_softcapping=30.0, max_position_embeddings=max(length, 64))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, vocab, (batch, length), generator=g).to(device)
    m = torch.ones_like(x)
    p = torch.arange(length, device=device).expand(batch, length)
    targets = torch.nn.functional.pad(x[:, 1:], (0, 1))
    scored = torch.nn.functional.pad(m[:, 1:], (0, 1))
    return model, x, m, p, targets, scored


def one(mode: str, vocab: int, batch: int, length: int, device: str) -> dict:
    from mergescope.scoring.bpb import Head, window_scores

    model, x, m, p, targets, scored = model_and_batch(vocab, batch, length, device)
    with torch.inference_mode():  # warm-up: the libraries' one-time allocations are not the path's
        model(input_ids=x[:1, :8], use_cache=False, logits_to_keep=1)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        before = rss_mb()
    with torch.inference_mode():
        if mode == "body":
            model(input_ids=x, attention_mask=m, position_ids=p, use_cache=False, logits_to_keep=1)
            nll = torch.zeros(1)
        elif mode == "full":
            logits = model(input_ids=x, attention_mask=m, position_ids=p, use_cache=False).logits.double()
            lp = torch.log_softmax(logits, -1).gather(2, targets.unsqueeze(-1)).squeeze(-1)
            nll = -(lp * scored).sum(1)
        else:
            nll = window_scores(model, Head(model, vocab), x, m, p, targets, scored)[0]
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20 - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    return {"mode": mode, "peak_mb": peak, "nll": nll.double().cpu().tolist()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=262144)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.vocab, args.batch, args.length, args.device)))
        return 0
    res = {}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    for mode in ("body", "full", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--one", mode, "--batch", str(args.batch), "--length", str(args.length),
                              "--vocab", str(args.vocab), "--device", args.device], capture_output=True, text=True, check=True, env=env)
        res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    full, chunked = res["full"], res["chunked"]
    gap = max(abs(a - b) / abs(a) for a, b in zip(full["nll"], chunked["nll"]))
    logits_mb = args.batch * args.length * args.vocab * 4 / 2**20
    print(f"{args.batch} x {args.length} tokens, vocabulary {args.vocab} ({args.device}); one float32 logits tensor = {logits_mb:.0f} MB")
    print(f"peak memory above the model: its forward alone {res['body']['peak_mb']:.0f} MB; "
          f"full logits {full['peak_mb']:.0f} MB, chunked {chunked['peak_mb']:.0f} MB, "
          f"ratio {full['peak_mb'] / max(chunked['peak_mb'], 1e-9):.1f}x; per-row NLL max relative difference {gap:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
