"""Peak memory of a union merge (Expand(small) then (1 - lambda) E(small) + lambda large, streamed tensor by tensor
into the large host, as task=adapt does), divided by the size of the large model. Target: <= 3.5.

Run: python benchmarks/bench_adapt.py [--hidden 1024] ; each measurement in a fresh child process (peak RSS above
the process's baseline after imports and after the two models were written to disk).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _arch(hidden: int, layers: int, heads: int) -> dict:
    return dict(hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 16 * 16, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=512)


def _write(folder: Path, hidden: int) -> None:
    from mergescope.zoo import build_model

    build_model({"family": "qwen2", **_arch(hidden // 2, 4, 8)}, 8192, 0).save_pretrained(folder / "small")
    build_model({"family": "qwen2", **_arch(hidden, 8, 16), "tie_word_embeddings": False}, 8192, 1).save_pretrained(folder / "large")


def child(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from mergescope.adapt import adapt_state, adapters, shape_of
    from mergescope.adapt.protocol import Ends, host_state, targets_of

    base = _rss_mb()
    small = AutoModelForCausalLM.from_pretrained(folder / "small", dtype=torch.float32)
    host = AutoModelForCausalLM.from_pretrained(folder / "large", dtype=torch.float32).eval()
    size_mb = sum(p.numel() * p.element_size() for p in host.parameters()) / 2**20
    sd_small, targets = host_state(small), targets_of(host)
    del small
    entry = adapters.get("expand")
    ends = Ends(host, None, lambda: adapt_state(entry, {"mode": "zero"}, sd_small, shape_of(sd_config(folder, "small")),
                                                shape_of(sd_config(folder, "large")), targets), host_state(host))
    for r in (0.02, 0.98):
        ends.set(r)
    print(json.dumps({"large_mb": size_mb, "peak_above_baseline_mb": _rss_mb() - base}))


def sd_config(folder: Path, name: str) -> dict:
    return json.loads((folder / name / "config.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        child(Path(args.child))
        return
    with tempfile.TemporaryDirectory() as tmp:
        _write(Path(tmp), args.hidden)
        out = subprocess.run([sys.executable, __file__, "--child", tmp], capture_output=True, text=True, check=True)
        res = json.loads(out.stdout.strip().splitlines()[-1])
    ratio = res["peak_above_baseline_mb"] / res["large_mb"]
    print(f"large model {res['large_mb']:.0f} MB; peak memory of the union merge {res['peak_above_baseline_mb']:.0f} MB "
          f"above baseline = {ratio:.2f}x the large model (target <= 3.5): {'OK' if ratio <= 3.5 else 'OVER'}")


if __name__ == "__main__":
    main()
