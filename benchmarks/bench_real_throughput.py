"""The real model's forward throughput against this CPU's measured matmul rate (the physical limit here).

Reads ``real/smollm2-135m`` (``make real``) and prints, with the torch thread count in use:

- the float32 GEMM rate of this CPU at the model's own largest shape (tokens x 576 @ 576 x 1536, the MLP's up
  projection, for a batch of 32 x 48 tokens) and at a square 2048^3 (the peak a BLAS reaches here), GFLOP/s, best
  of several repeats;
- one forward of the project's NLL path (``bpb.token_nll``) on 32 FLORES-sized sentences of 48
  tokens, as tokens/s and GFLOP/s, where the FLOPs are counted from the model's shapes: 2 x (the 30 layers' matmul
  weights + the tied head) per token plus the attention scores and values (4 x T x d per layer per token, causal
  average T/2); the ratio of that rate to each GEMM rate is the share of the physical limit the forward reaches.

    python benchmarks/bench_real_throughput.py [--folder real/smollm2-135m] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def gemm_rate(m: int, k: int, n: int, repeats: int, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(5):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - t) / 5)
    return 2.0 * m * k * n / best / 1e9


def forward_flops_per_token(cfg, seq: int) -> float:
    d, f, L, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    hd = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f  # q, k, v, o, gate / up / down
    attn = 2 * 2 * (seq / 2) * q  # scores and weighted values, causal average length
    return 2.0 * (L * per_layer + d * v) + L * attn


PRECISIONS = ("float32", "medium", "bfloat16")


def gemm_rates(m: int, k: int, n: int, repeats: int) -> dict[str, float]:
    """This CPU's matmul rate at one shape in each precision (mergescope.precision): float32, float32 with bfloat16
    products (matmul precision "medium"), and bfloat16 operands."""
    out = {"float32": gemm_rate(m, k, n, repeats)}
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        out["medium"] = gemm_rate(m, k, n, repeats)
    finally:
        torch.set_float32_matmul_precision(before)
    out["bfloat16"] = gemm_rate(m, k, n, repeats, torch.bfloat16)
    return out


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", default="real/smollm2-135m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = Path(args.folder)
    if not (folder / "config.json").exists():
        print(f"skipped: {folder} is missing (run `make real` first)")
        return 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergescope.scoring.bpb import token_nll
    from mergescope.precision import cpu_bf16_units
    from mergescope.represent import embed

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    cfg = base.config
    batch, seq = 32, 48
    # 32 sentences of exactly 48 tokens: one batch of the NLL path, no padding
    ids = torch.randint(100, tok.vocab_size - 100, (batch, seq), generator=torch.Generator().manual_seed(0))
    sentences = [tok.decode(r) for r in ids]
    exact = [s for s in sentences if len(tok(s)["input_ids"]) == seq]
    sentences = (exact * (batch // max(len(exact), 1) + 1))[:batch] if exact else sentences
    n_tok = sum(len(tok(s)["input_ids"]) for s in sentences)
    rates = gemm_rates(batch * seq, cfg.hidden_size, cfg.intermediate_size, args.repeats)
    units = cpu_bf16_units()
    print(f"torch threads {torch.get_num_threads()}  (cpu count {os.cpu_count()}); bfloat16 units: {', '.join(units) or 'none'}")
    print(f"GEMM {batch * seq}x{cfg.hidden_size}@{cfg.hidden_size}x{cfg.intermediate_size}: "
          + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()) + " GFLOP/s")
    flops_nll = forward_flops_per_token(cfg, seq) * n_tok
    flops_embed = flops_nll - 2.0 * cfg.hidden_size * cfg.vocab_size * n_tok  # extraction never runs the head
    ref, ref_t = None, {}
    print(f"{'precision':<10} {'path':<8} {'s':>7} {'tokens/s':>9} {'GFLOP/s':>8} {'of GEMM':>8} {'vs float32':>10}  max |d| vs float32")
    for prec in args.precisions.split(","):
        if prec != "float32" and not units:
            print(f"{prec:<10} skipped: no bfloat16 units on this CPU")
            continue
        model = base if prec != "bfloat16" else AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("medium" if prec == "medium" else before)
        try:
            got = {}
            t_nll = timed(lambda: got.__setitem__("nll", token_nll(model, tok, sentences, batch_tokens=batch * seq * 2,
                                                                    progress=False)), args.repeats)
            t_emb = timed(lambda: got.__setitem__("emb", embed(model, tok, sentences, pooling="mean", layer=-1,
                                                                batch_tokens=batch * seq * 2, progress=False)[0]), args.repeats)
        finally:
            torch.set_float32_matmul_precision(before)
        if ref is None:
            ref, ref_t = got, {"nll": t_nll, "extract": t_emb}
        for path, t, fl in (("nll", t_nll, flops_nll), ("extract", t_emb, flops_embed)):
            g = fl / t / 1e9
            diff = (abs(got["nll"]["nll"] - ref["nll"]["nll"]) if path == "nll" else
                    float(abs(got["emb"] - ref["emb"]).max() / abs(ref["emb"]).max()))
            print(f"{prec:<10} {path:<8} {t:7.2f} {n_tok / t:9.0f} {g:8.1f} {g / rates[prec]:8.2f} "
                  f"{ref_t[path] / t:9.2f}x  {diff:.2e}" + (" nats/token" if path == "nll" else " (relative)"))
    print("of GEMM: the forward's rate over the GEMM rate at the model's MLP shape in the same precision; "
          "FLOPs counted from the shapes (extraction without the vocabulary head).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
