"""Batched, length-sorted extraction vs one sentence at a time (target: >= 5x on CPU).

Two baselines, both printed:
- naive: the loop a script would write: tokenise one sentence, run the full causal LM with
  output_hidden_states=True (so the LM head runs too), pool in numpy;
- batch size 1: mergescope's own path with one sentence per batch (isolates the batching gain).
On a CPU the batched path is compute-bound, so the batching-only ratio shrinks as the model grows;
on a GPU it grows instead.

    python benchmarks/bench_extraction.py [--n 256] [--hidden 64] [--layers 3] [--vocab 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import FLORES, make_tokenizer  # noqa: E402

from mergescope.represent import embed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--batch-tokens", default="auto")
    a = ap.parse_args()
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    sents = (FLORES / "devtest" / "eng_Latn.devtest").read_text(encoding="utf-8").splitlines()[: a.n]
    tok = make_tokenizer(sents, vocab_size=a.vocab)
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=len(tok), hidden_size=a.hidden, num_hidden_layers=a.layers,
                                             num_attention_heads=8, intermediate_size=4 * a.hidden)).eval()
    embed(model, tok, sents[:8], progress=False)  # warm-up
    t0 = time.perf_counter()
    batched, stats = embed(model, tok, sents, batch_tokens=a.batch_tokens, progress=False)
    t_batched = time.perf_counter() - t0
    t0 = time.perf_counter()
    single, _ = embed(model, tok, sents, batch_tokens=1, progress=False)
    t_single = time.perf_counter() - t0
    t0 = time.perf_counter()
    naive = []
    with torch.no_grad():
        for s in sents:
            ids = torch.tensor([tok(s)["input_ids"]])
            h = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0].numpy().astype(np.float64)
            w = np.arange(1, h.shape[0] + 1, dtype=np.float64)
            naive.append((w[:, None] * h).sum(0) / w.sum())
    t_naive = time.perf_counter() - t0
    diff = float(np.abs(batched - single).max() / np.abs(single).max())
    diff_naive = float(np.abs(batched - np.array(naive)).max() / np.abs(single).max())
    print(f"sentences={a.n} tokens={stats['n_tokens']} batches={stats['n_batches']} threads={torch.get_num_threads()}")
    print(f"naive loop (full LM, per sentence) : {t_naive:8.3f} s")
    print(f"mergescope, batch size 1           : {t_single:8.3f} s")
    print(f"mergescope, batched                : {t_batched:8.3f} s")
    print(f"speed-up vs naive loop             : {t_naive / t_batched:8.2f}x   (target >= 5x)   max rel. diff {diff_naive:.2e}")
    print(f"speed-up from batching alone       : {t_single / t_batched:8.2f}x   max rel. diff {diff:.2e}")


if __name__ == "__main__":
    main()
