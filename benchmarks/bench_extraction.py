"""Batched, length-sorted extraction vs one sentence at a time (target: >= 5x on CPU).

    python benchmarks/bench_extraction.py [--n 256] [--hidden 256] [--layers 4]
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
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    a = ap.parse_args()
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    sents = (FLORES / "devtest" / "eng_Latn.devtest").read_text(encoding="utf-8").splitlines()[: a.n]
    tok = make_tokenizer(sents, vocab_size=2000)
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
    diff = float(np.abs(batched - single).max() / np.abs(single).max())
    print(f"sentences={a.n} tokens={stats['n_tokens']} batches={stats['n_batches']} threads={torch.get_num_threads()}")
    print(f"one at a time : {t_single:8.3f} s")
    print(f"batched       : {t_batched:8.3f} s")
    print(f"speed-up      : {t_single / t_batched:8.2f}x   (target >= 5x)   max rel. diff {diff:.2e}")


if __name__ == "__main__":
    main()
