"""Peak memory of an N = 3 TIES merge at a 1.4B shape, streamed (the memory target: <= 1.5x one model in float32).

A base and three "fine-tunes" (the base plus independent N(0, 0.002) noise) at Pythia-1.4B's true configuration
(GPT-NeoX, hidden 2048, 24 layers, FFN 8192, vocabulary 50304, untied; ``--layers`` reduces the depth), random
weights saved as bfloat16 safetensors as ``bench_real_shapes.py`` builds them. The merge runs in a FRESH
subprocess through the public job (``task=merge merge=ties +merge.models=[ft1,ft2,ft3] +merge.base=base``: the host
= ft1 loaded in float32, every model and the base streamed tensor by tensor; NLLs on 2 sentences per language),
and reports its wall time and peak resident set (VmHWM, imports included) as a ratio to one model in float32, and
the same after subtracting the process's resident set before loading any model (imports, data, MLflow).

    python benchmarks/bench_merge_n.py [--layers 24] [--dir /tmp/x] [--keep] [--threads 2]

Disk: 4 bfloat16 folders (11 GB at 24 layers); deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 1024**3
PYTHIA = dict(model_type="gpt_neox", hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, intermediate_size=8192,
              vocab_size=50304, rotary_pct=0.25, max_position_embeddings=2048, use_parallel_residual=True,
              tie_word_embeddings=False)


def rss(field: str = "VmHWM") -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def build(d: Path, layers: int) -> dict:
    """base, ft1..ft3 = base + noise (seeded), bfloat16 safetensors, one small tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mergescope.zoo import sample_lines, train_tokenizer

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**PYTHIA, "num_hidden_layers": layers}),
                                                 dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    tok = train_tokenizer(sample_lines("eng_Latn"), 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():  # N(0, 0.02) matrices, unit norm gains, zero biases
            p.copy_(torch.randn(p.shape, generator=g).mul_(0.02)) if p.ndim > 1 else p.fill_(float(name.endswith("weight")))
        base = {k: v.clone() for k, v in model.state_dict().items()}
        for i, folder in enumerate(["base", "ft1", "ft2", "ft3"]):
            if i:
                for k, p in model.state_dict().items():
                    if p.is_floating_point():
                        p.copy_(base[k] + torch.randn(p.shape, generator=g).mul_(0.002).to(p.dtype))
            model.save_pretrained(d / folder)
            tok.save_pretrained(d / folder)
    n = sum(p.numel() for p in model.parameters())
    return {"params": n, "fp32_gib": n * 4 / GiB}


def merge(d: Path) -> dict:
    from hydra import compose, initialize_config_dir

    import mergescope.config  # noqa: F401  (resolvers)
    from mergescope.cli import handler

    data = os.environ.get("MERGESCOPE_DATA", str(REPO.parent / "shared" / "data"))
    models = ",".join("{name_or_path:" + str(d / f) + ",lang:eng_Latn}" for f in ("ft1", "ft2", "ft3"))
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            f"paths.root={d / 'root'}", f"paths.data={data}", "progress=false", "device=cpu", "data.max_sentences=2",
            "native.nll_sentences=2", "task=merge", "merge=ties", "merge.weights=[0.5,0.3,0.2]",
            f"+merge.models=[{models}]", f"+merge.base={d / 'base'}"])
    before = rss("VmRSS")
    r = handler("merge")(cfg, [])
    return {"rss_before_models": before, "nll": r.metrics["nll"], "merge_gain": r.metrics["merge_gain"]}


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    out = build(Path(args.dir), args.layers) if args.child == "build" else merge(Path(args.dir))
    print("RESULT " + json.dumps({**out, "wall_s": time.perf_counter() - t0, "peak_rss": rss()}))


def run_child(args, arm: str) -> dict:
    cmd = [sys.executable, __file__, "--child", arm, "--dir", args.dir, "--layers", str(args.layers), "--threads", str(args.threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode or line is None:
        raise SystemExit(f"{arm} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads(line[7:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dir", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--child", default=None)
    args = p.parse_args()
    if args.child:
        return child(args)
    args.dir = args.dir or tempfile.mkdtemp(prefix="bench_merge_n_")
    try:
        b = run_child(args, "build")
        m = run_child(args, "merge")
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    one = b["params"] * 4
    res = {"layers": args.layers, "params": b["params"], "one_model_fp32_gib": one / GiB, "build_s": b["wall_s"],
           "merge_s": m["wall_s"], "peak_rss_gib": m["peak_rss"] / GiB, "peak_over_one_model": m["peak_rss"] / one,
           "peak_minus_before_models_over_one_model": (m["peak_rss"] - m["rss_before_models"]) / one,
           "rss_before_models_gib": m["rss_before_models"] / GiB, "nll": m["nll"], "merge_gain": m["merge_gain"]}
    print(json.dumps(res, indent=1))
    print(f"N=3 TIES at {args.layers} layers ({b['params'] / 1e9:.2f}B params, {one / GiB:.2f} GiB in float32): "
          f"peak RSS {m['peak_rss'] / GiB:.2f} GiB = {res['peak_over_one_model']:.2f}x one model "
          f"({res['peak_minus_before_models_over_one_model']:.2f}x without the process's {res['rss_before_models_gib']:.2f} GiB "
          f"before any model); merge job {m['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
