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


def gemm_rate(m: int, k: int, n: int, repeats: int) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", default="real/smollm2-135m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = Path(args.folder)
    if not (folder / "config.json").exists():
        print(f"skipped: {folder} is missing (run `make real` first)")
        return 0
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergescope.bpb import token_nll

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    batch, seq = 32, 48
    # 32 sentences of exactly 48 tokens: one batch of the NLL path, no padding
    ids = torch.randint(100, tok.vocab_size - 100, (batch, seq), generator=torch.Generator().manual_seed(0))
    sentences = [tok.decode(r) for r in ids]
    exact = [s for s in sentences if len(tok(s)["input_ids"]) == seq]
    sentences = (exact * (batch // max(len(exact), 1) + 1))[:batch] if exact else sentences
    n_tok = sum(len(tok(s)["input_ids"]) for s in sentences)
    token_nll(model, tok, sentences, batch_tokens=batch * seq * 2, progress=False)  # warm-up
    best = float("inf")
    for _ in range(args.repeats):
        t = time.perf_counter()
        token_nll(model, tok, sentences, batch_tokens=batch * seq * 2, progress=False)
        best = min(best, time.perf_counter() - t)
    fwd = forward_flops_per_token(model.config, seq) * n_tok / best / 1e9
    mlp = gemm_rate(batch * seq, model.config.hidden_size, model.config.intermediate_size, args.repeats)
    square = gemm_rate(2048, 2048, 2048, args.repeats)
    print(f"torch threads {torch.get_num_threads()}  (cpu count {os.cpu_count()})")
    print(f"GEMM float32 {batch * seq}x{model.config.hidden_size}@{model.config.hidden_size}x{model.config.intermediate_size}: "
          f"{mlp:.1f} GFLOP/s;  2048^3: {square:.1f} GFLOP/s")
    print(f"forward (token_nll) {batch} x {seq} tokens ({n_tok} tokens): {best:.2f} s, {n_tok / best:.0f} tokens/s, "
          f"{fwd:.1f} GFLOP/s ({forward_flops_per_token(model.config, seq) / 1e6:.0f} MFLOP/token)")
    print(f"ratio forward / GEMM at the model's shape: {fwd / mlp:.2f};  forward / 2048^3 GEMM: {fwd / square:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
