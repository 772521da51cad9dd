"""Where a model's attention sink sits with and without the start token, on the real models (`make real`).

For each model, FLORES devtest sentences in its study language are fed two ways: the sentence alone (what the separate
representation path feeds a tokenizer that adds no BOS) and ``[start token] + the sentence`` (the scoring input, what
``represent.one_forward`` feeds). Printed per model and input: the norm of the first sentence token's hidden state
against the median of the sentence's other tokens, at the middle layer and after the final norm (means over the
sentences). A first token whose mid-depth norm is tens of times its neighbours' is the sink: fed without a start token,
it sits on the sentence and enters every pooling of it; with one, it sits on the start token, which is never pooled.

    python benchmarks/start_token.py [--sentences 16] [--root .]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

MODELS = {"smollm2-135m": "eng_Latn", "gemma3-270m": "pol_Latn", "qwen2.5-coder-0.5b": "por_Latn",
          "qwen2.5-coder-1.5b": "zho_Hans"}


def norms(model, ids: list[int], skip: int) -> tuple[float, float, float, float]:
    with torch.inference_mode():
        out = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    mid = out.hidden_states[len(out.hidden_states) // 2][0].norm(dim=-1)
    last = out.last_hidden_state[0].norm(dim=-1)
    return float(mid[skip]), float(mid[skip + 1:].median()), float(last[skip]), float(last[skip + 1:].median())


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergescope.scoring.bpb import start_id

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=16)
    ap.add_argument("--root", default=".")
    a = ap.parse_args()
    root = Path(a.root).resolve()
    print("| model | input | mid layer: first token / median of the rest | final: first token / median of the rest |")
    print("|---|---|---|---|")
    for name, lang in MODELS.items():
        folder = root / "real" / name
        if not folder.is_dir():
            print(f"| {name} | not installed (make real) | | |")
            continue
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
        lines = (root / "data" / "flores200" / "devtest" / f"{lang}.devtest").read_text(encoding="utf-8").splitlines()
        start = start_id(tok)
        for label, fed in (("the sentence alone", False), ("start token + the sentence", True)):
            rows = []
            for s in lines[: a.sentences]:
                ids = tok(s, add_special_tokens=False)["input_ids"]
                rows.append(norms(model, [start, *ids] if fed else ids, 1 if fed else 0))
            m = np.mean(rows, axis=0)
            print(f"| {name} | {label} | {m[0]:.1f} / {m[1]:.1f} ({m[0] / m[1]:.1f}x) | {m[2]:.1f} / {m[3]:.1f} ({m[2] / m[3]:.2f}x) |")
        del model


if __name__ == "__main__":
    main()
