"""`make gpu-check`: what a user with a CUDA GPU runs first (the project has never run on one).

1. Agreement: every representation metric, the merge operators, Expand(zero) and an entropic OT plan computed on
   CUDA and on the CPU from the same float64 inputs must agree to 1e-6 (relative); each figure is printed.
2. Throughput: the representation arm's forward pass (batched, length-sorted, pooled) for the spec's five 1B shapes
   on random weights (bfloat16 on the GPU), sentences per second and peak GPU memory, one model at a time.

Without CUDA it says so in one line and exits 0 (nothing to check). ``--quick`` skips the 1B shapes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
TOL = 1e-6
DEV = "cuda"  # the device checked against the CPU (tests set "cpu" to run every check's code path here)


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-300))


def check_metrics(rng) -> list[tuple[str, float]]:
    from mergescope.registry import metrics

    X, Y = rng.standard_normal((400, 96)), rng.standard_normal((400, 80))
    Y[:, :40] += X[:, :40]
    out = []
    for e in metrics.entries():
        cpu = e.fn(X, Y, device="cpu")
        gpu = e.fn(X, Y, device=DEV)
        out.append((f"metric {e.name}", max(_rel([gpu[k]], [cpu[k]]) for k in cpu)))
    return out


def check_merges(rng) -> list[tuple[str, float]]:
    from omegaconf import OmegaConf

    from mergescope.config import CONF_DIR
    from mergescope.merge import merge_state_dicts, resolve_preset

    base = {"w": torch.from_numpy(rng.standard_normal((64, 48)))}
    sds = [{"w": base["w"] + 0.1 * torch.from_numpy(rng.standard_normal((64, 48)))} for _ in range(3)]
    out = []
    for path in sorted((CONF_DIR / "merge").glob("*.yaml")):
        preset = OmegaConf.to_container(OmegaConf.load(path))
        if preset.get("operator", preset.get("name")) in ("transport", "transport_released", "mergekit"):  # not per-tensor operators
            continue
        entry, kwargs = resolve_preset(preset)
        b = base if entry.meta.get("needs_base") else None
        try:
            cpu = merge_state_dicts(entry, kwargs, sds[:2], b, ["w"], device="cpu")["w"]
        except Exception as exc:  # an operator that needs other settings for two models: reported, not hidden
            out.append((f"merge {path.stem} (not checked: {str(exc)[:60]})", float("nan")))
            continue
        gpu = merge_state_dicts(entry, kwargs, sds[:2], b, ["w"], device=DEV)["w"]
        out.append((f"merge {path.stem}", _rel(gpu, cpu)))
    return out


def check_expand() -> list[tuple[str, float]]:
    from mergescope.adapt import adapters, shape_of
    from mergescope.zoo import build_model

    small = build_model({"family": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2}, 200, 0).double()
    big = build_model({"family": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
                       "num_attention_heads": 8, "num_key_value_heads": 2}, 200, 1).double()
    targets = {k: v.shape for k, v in big.state_dict().items()}
    entry = adapters.get("expand")
    cpu = dict(entry.fn(small.state_dict(), shape_of(small.config), shape_of(big.config), targets))
    gpu = dict(entry.fn({k: v.to(DEV) for k, v in small.state_dict().items()}, shape_of(small.config),
                        shape_of(big.config), targets))
    return [("expand(zero)", max(_rel(gpu[k].cpu(), cpu[k]) for k in cpu))]


def check_ot(rng) -> list[tuple[str, float]]:
    from mergescope.transport import ot

    C = torch.from_numpy(rng.uniform(0, 2, (96, 80)))
    q_cpu, _ = ot.solve(C, 0.05)
    q_gpu, _ = ot.solve(C.to(DEV), 0.05)
    out = [("entropic OT plan (96x80, eps 0.05)", _rel(q_gpu.cpu(), q_cpu))]
    # the layer pass's batched Sinkhorn (the GPU default of transport.fusion.align_layers) against POT on the CPU
    X = torch.from_numpy(rng.normal(size=(128, 64)))
    Cs = torch.stack([ot.pearson_cost(X, torch.from_numpy(rng.normal(size=(128, 48))) + s * X[:, :48]) for s in (0.2, 1.0, 4.0)])
    plans, _ = ot.sinkhorn_batched(Cs.to(DEV), 0.01)
    ref = [ot.solve(c, 0.01)[0] for c in Cs]
    out.append(("batched Sinkhorn, 3 plans (64x48, eps 0.01)", max(_rel(p.cpu(), r) for p, r in zip(plans, ref))))
    return out


def layer_pass_timing(layers: int = 8, width: int = 2048, probes: int = 512) -> list[tuple[str, str]]:
    """The transport layer pass at a 1B model's FFN width (the layer_subsample default, 2048) on random probes:
    ``layers`` x ``layers`` layer pairs, batched on the GPU against per problem (POT) on the GPU, wall time each."""
    from mergescope.transport import fusion as fus
    from mergescope.transport.settings import TransportSettings

    g = torch.Generator().manual_seed(0)
    pooled = lambda: {k: [torch.randn(probes, width, generator=g, dtype=torch.float64).to(DEV) for _ in range(layers)]  # noqa: E731
                      for k in ("mlp_pre", "mlp_post")}
    tp = fus.Probe(pooled(), {}, layers, 0)
    dp = fus.Probe(pooled(), {}, layers, 0)
    s = TransportSettings.defaults()
    rows = []
    sync = torch.cuda.synchronize if str(DEV).startswith("cuda") else (lambda: None)
    for batched in (True, False):
        sync()
        t0 = time.perf_counter()
        fus.align_layers(tp, dp, s, progress=False, batched=batched)
        sync()
        rows.append((f"{'batched' if batched else 'per problem'}", f"{time.perf_counter() - t0:.1f} s"))
    return rows


def throughput(n_sentences: int = 256) -> list[tuple[str, str]]:
    from bench_real_shapes import MODELS
    from transformers import AutoConfig, AutoModelForCausalLM

    from mergescope.represent.forward import embed
    from mergescope.zoo import sample_lines, train_tokenizer

    tok = train_tokenizer(sample_lines("eng_Latn", 2000), 4000)
    text = sample_lines("eng_Latn", n_sentences)
    rows = []
    for name, (_, arch) in MODELS.items():
        conf = AutoConfig.for_model(**{**arch, "vocab_size": max(arch["vocab_size"], len(tok))})
        torch.cuda.reset_peak_memory_stats()
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16).cuda().eval()
        embed(model, tok, text[:16], pooling="mean")  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        embed(model, tok, text, pooling="mean")
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        rows.append((name, f"{n_sentences / dt:.1f} sentences/s, peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"))
        del model
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="agreement checks only (no 1B shapes)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False): nothing to check")
        return 0
    print(f"gpu-check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    rng = np.random.default_rng(0)
    results = [*check_metrics(rng), *check_merges(rng), *check_expand(), *check_ot(rng)]
    bad = [(n, v) for n, v in results if np.isfinite(v) and v > TOL]
    for n, v in results:
        print(f"  {n:60s} max relative difference CUDA vs CPU {v:.2e} {'OK' if not np.isfinite(v) or v <= TOL else 'FAIL'}")
    if not args.quick:
        for n, v in throughput():
            print(f"  representation arm forward, {n:16s} {v}")
        for n, v in layer_pass_timing():
            print(f"  transport layer pass, 8 x 8 layer pairs at width 2048, {n:12s} {v}")
    print("gpu-check: " + ("every check agrees to 1e-6" if not bad else f"{len(bad)} check(s) differ by more than 1e-6"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
