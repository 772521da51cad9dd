"""The 1B study's arms at the spec's true shapes, on this machine's CPU: wall time and peak RSS per arm.

The five models cannot be downloaded here, so they are built at their true configurations with random
weights (saved as bfloat16 safetensors, loaded as float32 as the studies load them, each with a small
byte-level BPE tokenizer: token ids stay far below every vocabulary):

| model | family | hidden / layers / heads / KV | FFN | vocab | tied |
|---|---|---|---|---|---|
| pythia-1.4b | GPT-NeoX | 2048 / 24 / 16 / 16 | 8192 | 50304 | no |
| zh-pythia-1.4b | GPT-NeoX | 2048 / 24 / 16 / 16 | 8192 | 49953 | no |
| tucano-1b1 | Llama | 2048 / 22 / 16 / 4 | 5632 | 32000 | no |
| bielik-1.5b-v3 | Llama (Qwen2.5 geometry) | 1536 / 32 / 12 / 2 | 8960 | 32000 | yes |
| minerva-1b | Mistral | 2048 / 16 / 16 / 4 | 7168 | 32768 | no |

(conf/model/*.yaml and the spec's config check; the KV head counts of Tucano and Minerva are the spec's
"GQA with 2 or 4 KV heads", assumed 4.) Pythia-1.4B is built three times as a checkpoint run: ``step0`` (the
task-vector base) and ``step1000`` / ``step143000`` (the base plus independent noise).

Every arm runs in a FRESH subprocess through the project's own job code, reading the saved folders, and
reports its wall time and the process's peak resident set (VmHWM: everything, imports included):

- ``quality:<model>``: one model loaded and run (task=quality, 8 sentences): what the representation arm holds;
- ``weights``: the native job's pair loading (``native.pair.Loaded``: the host model, with a, b and the base
  streamed tensor by tensor from safetensors) and its weight + task-vector diagnostics, for the Pythia pair;
- ``weights-eager@Nl``: the same at reduced depth with streaming switched off (a, b and the base held whole, as
  before), next to ``weights@Nl`` (streamed, same depth), extrapolated per layer to 24 layers (labelled);
- ``merge``: task=merge merge=ties on the Pythia pair (one merged model, written into the host tensor by tensor;
  NLLs on 2 sentences);
- ``transport``: task=transport for the largest rectangular direction, pythia-1.4b <- bielik-1.5b-v3 (the
  largest target and donor of different widths), adaptation off, through the public job
  (``--transport-probes`` probe sentences).

    python benchmarks/bench_real_shapes.py [--dir /tmp/x] [--arms quality,weights,eager,merge,transport]
        [--eager-layers 4] [--transport-probes 64] [--keep] [--out results.json]

Disk: about 19 GB of bfloat16 folders at once (deleted at the end unless --keep); RAM: see the figures.
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
SPEC_MODELS = ("pythia-1.4b", "zh-pythia-1.4b", "tucano-1b1", "bielik-1.5b-v3", "minerva-1b")


def _spec_models() -> dict[str, tuple[str, dict]]:
    """The spec's five at their published configurations: the ``shape:`` of their conf/model entries (one source)."""
    import yaml

    out = {}
    for name in SPEC_MODELS:
        entry = yaml.safe_load((REPO / "conf" / "model" / f"{name}.yaml").read_text())
        out[name] = (entry["lang"], dict(entry["shape"]))
    return out


MODELS = _spec_models()
STEPS = {"step0": 0, "step1000": 1, "step143000": 2}  # Pythia checkpoints: base, then noise of this many x 0.002 added


# ------------------------------------------------------------------------------------------------ children


def peak_rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def build(folder: Path, name: str, layers: int | None) -> dict:
    """One model at its true configuration (``layers`` overrides the depth), random init, saved as bfloat16. Pythia is
    saved as a run: ``step0``, then ``step1000`` = step0 + noise, then ``step143000`` = step1000 + more noise."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mergescope.zoo import sample_lines, train_tokenizer

    lang, spec = MODELS[name]
    spec = {**spec, **({"num_hidden_layers": layers} if layers else {})}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec), dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    g = torch.Generator().manual_seed(0)
    tok = train_tokenizer(sample_lines(lang), 1000)
    with torch.no_grad():
        for pname, p in model.named_parameters():  # N(0, 0.02) matrices, unit norm gains, zero biases
            p.copy_(torch.randn(p.shape, generator=g).mul_(0.02)) if p.ndim > 1 else p.fill_(float(pname.endswith("weight")))
        for step in (STEPS if name == "pythia-1.4b" else [None]):
            if STEPS.get(step):
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g).mul_(0.002 * STEPS[step]).to(p.dtype))
            out = folder / step if step else folder
            model.save_pretrained(out)
            tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    return {"params": n, "fp32_gib": n * 4 / GiB}


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import mergescope.config  # noqa: F401  (resolvers)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def pythia_pair(d: Path, run: str) -> list[str]:
    p = d / run
    return ["pair=custom", f"pair.a.name_or_path={p}", "pair.a.revision=step1000", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={p}", "pair.b.revision=step143000", "pair.b.lang=eng_Latn", "pair.a.dtype=float32",
            "pair.b.dtype=float32"]


def base_overrides(d: Path) -> list[str]:
    data = os.environ.get("MERGESCOPE_DATA", str(REPO.parent / "shared" / "data"))
    return [f"paths.root={d / 'root'}", f"paths.data={data}", "progress=false", "device=cpu", "data.max_sentences=8"]


def weights_arm(d: Path, run: str, streamed: bool) -> dict:
    """The native job's pair loading and its diagnostics (coverage, weight diagnostics on all shared tensors and
    on the matrices, task vectors against step0), as ``task=native`` computes them before its LMC curve."""
    from mergescope.native import pair as pair_mod
    from mergescope.native.weights import task_vector_diagnostics, weight_diagnostics

    if not streamed:  # the naive way, as before: a, b and the base loaded whole
        pair_mod.streamed_state = lambda *a, **k: None
    cfg = compose([*base_overrides(d), *pythia_pair(d, run)])
    loaded = pair_mod.Loaded(cfg, need_base=True)
    shared = loaded.coverage.shared
    out = weight_diagnostics(loaded.sd_a, loaded.sd_b, shared, device="cpu")
    mats = [n for n in shared if loaded.sd_a[n].ndim >= 2]
    weight_diagnostics(loaded.sd_a, loaded.sd_b, mats, device="cpu")
    out.update(task_vector_diagnostics(loaded.sd_a, loaded.sd_b, loaded.sd_base, shared, density=0.2, device="cpu"))
    return {"weight_cosine": out["weight_cosine"], "tv_cosine": out["tv_cosine"], "n_params": out["n_params"],
            "streamed": type(loaded.sd_b).__name__ == "StreamedState"}


def job_arm(d: Path, task: str, overrides: list[str]) -> dict:
    from mergescope.cli import handler

    cfg = compose([*base_overrides(d), f"task={task}", *overrides])
    r = handler(task)(cfg, [])
    return {k: v for k, v in r.metrics.items() if k in ("nll", "nll_a", "nll_t1", "merge_gain", "transport_fused_nll")}


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    d, arm = Path(args.dir), args.child
    t0 = time.perf_counter()
    if arm.startswith("build:"):
        _, name, folder, layers = arm.split(":")
        extra = build(Path(folder), name, int(layers) or None)
    elif arm.startswith("quality:"):
        name = arm.split(":", 1)[1]
        rev = ["model.revision=step1000"] if name == "pythia-1.4b" else []
        extra = job_arm(d, "quality", ["model=custom", f"model.name_or_path={d / name}", f"model.lang={MODELS[name][0]}",
                                       f"model.name={name}", *rev])
    elif arm.startswith("weights"):
        run = arm.split("@", 1)[1] if "@" in arm else "pythia-1.4b"
        extra = weights_arm(d, run, streamed=not arm.startswith("weights-eager"))
    elif arm == "merge":
        extra = job_arm(d, "merge", [*pythia_pair(d, "pythia-1.4b"), "merge=ties", "native.nll_sentences=2"])
    else:  # transport@<layers>
        extra = job_arm(d, "transport", transport_overrides(d, args.transport_probes, int(arm.split("@")[1])))
    print("RESULT " + json.dumps({"arm": arm, "wall_s": time.perf_counter() - t0, "peak_rss_gib": peak_rss() / GiB, **extra}))


def transport_overrides(d: Path, probes: int, layers: int) -> list[str]:
    return ["pair=custom", f"pair.a.name_or_path={d / f'pythia-{layers}l' / 'step1000'}", "pair.a.lang=eng_Latn",
            f"pair.b.name_or_path={d / f'bielik-{layers}l'}", "pair.b.lang=pol_Latn", "merge=transport", "merge.target=a",
            f"merge.probe_sentences={probes}", "merge.adapt.enabled=false", "merge.alphas=[0.1]", "merge.headline_alpha=0.1"]


# ------------------------------------------------------------------------------------------------ parent


def run_child(args, arm: str) -> dict:
    cmd = [sys.executable, __file__, "--child", arm, "--dir", args.dir, "--threads", str(args.threads),
           "--transport-probes", str(args.transport_probes), "--transport-layers", ",".join(map(str, args.transport_layers))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        tail = (r.stderr or r.stdout).strip().splitlines()[-8:]
        return {"arm": arm, "error": f"exit {r.returncode}: " + " | ".join(tail), "wall_s": time.perf_counter() - t0}
    return json.loads(lines[-1][len("RESULT "):])


def show(res: dict) -> None:
    if "error" in res:
        print(f"{res['arm']:<28} FAILED {res['error']}", flush=True)
        return
    extra = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items() if k not in ("arm", "wall_s", "peak_rss_gib")}
    print(f"{res['arm']:<28} {res['wall_s']:8.1f} s  peak RSS {res['peak_rss_gib']:6.2f} GiB  {extra}", flush=True)


def build_all(args, d: Path, names: list[str]) -> list[dict]:
    out = [run_child(args, f"build:{name}:{d / name}:0") for name in names]
    depths = {args.eager_layers} if "eager" in args.arms else set()
    depths |= set(args.transport_layers) if "transport" in args.arms else set()
    for n in sorted(depths):
        out.append(run_child(args, f"build:pythia-1.4b:{d / f'pythia-{n}l'}:{n}"))
        if "transport" in args.arms and n in args.transport_layers:
            out.append(run_child(args, f"build:bielik-1.5b-v3:{d / f'bielik-{n}l'}:{n}"))
    for r in out:
        show(r)
    return out


def layer_bytes(name: str) -> int:
    """float32 bytes of one transformer block of a model (attention, MLP, norms, biases)."""
    c = MODELS[name][1]
    h, f, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c.get("num_key_value_heads")
    if c["model_type"] == "gpt_neox":
        return 4 * (4 * h * h + 2 * h * f + 9 * h + f)
    kv_dim = h // heads * kv
    return 4 * (2 * h * h + 2 * h * kv_dim + 3 * h * f + 2 * h)


def extrapolate_transport(results: dict[str, dict], depths: list[int], known: dict[int, dict] | None = None) -> dict | None:
    """Transport at full depth (target 24 layers <- donor 32) from the reduced depths measured (both models at L
    layers; ``known``: depths measured in an earlier run, {L: {"wall_s", "peak_rss_gib"}}, stated as such): wall time
    t = c (L_target x L_donor)^e with c and the exponent e fitted by least squares in log-log (e = 1 when the layer
    pass, one OT per layer pair, dominates; below 1 while the per-layer work still weighs); peak RSS linear in the
    layers (least squares), its slope split between target and donor layers by their float32 sizes. EXTRAPOLATED."""
    import numpy as np

    pts = {L: v for L, v in (known or {}).items()}
    for n in depths:
        r = results.get(f"transport@{n}")
        if r is not None and "error" not in r:
            pts[n] = r
    if len(pts) < 2:
        return None
    L = np.array(sorted(pts), dtype=float)
    wall = np.array([pts[int(x)]["wall_s"] for x in L])
    peak = np.array([pts[int(x)]["peak_rss_gib"] for x in L])
    e, logc = np.polyfit(np.log(L * L), np.log(wall), 1)
    slope, icpt = np.polyfit(L, peak, 1)  # GiB per (target layer + donor layer)
    bt, bd = layer_bytes("pythia-1.4b"), layer_bytes("bielik-1.5b-v3")
    top = L[-1]
    full = peak[-1] + slope * ((24 - top) * bt + (32 - top) * bd) / (bt + bd)
    return {"arm": f"transport (24 <- 32 layers, EXTRAPOLATED from {', '.join(str(int(x)) for x in L)} layers)",
            "peak_rss_gib": float(full), "wall_s": float(np.exp(logc) * (24 * 32) ** e), "time_exponent": float(e),
            "peak_slope_gib_per_layer": float(slope)}


def extrapolate(results: dict[str, dict], layers: int) -> dict | None:
    """Eager peak at 24 layers from the reduced-depth pair of measurements: the streamed run's growth per layer is
    one float32 layer (the host); the eager run holds four (host, a, b, base) -- so eager(24) = eager(L) + (24 - L)
    x 4 x (float32 bytes of one Pythia layer). Labelled as an extrapolation, never as a measurement."""
    e, s = results.get(f"weights-eager@pythia-{layers}l"), results.get(f"weights@pythia-{layers}l")
    if not e or not s or "error" in e or "error" in s:
        return None
    return {"arm": f"weights-eager (24 layers, EXTRAPOLATED from {layers})", "wall_s": float("nan"),
            "peak_rss_gib": e["peak_rss_gib"] + (24 - layers) * 4 * layer_bytes("pythia-1.4b") / GiB}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None)
    p.add_argument("--arms", default="quality,weights,eager,merge,transport")
    p.add_argument("--eager-layers", type=int, default=4)
    p.add_argument("--transport-probes", type=int, default=64)
    p.add_argument("--transport-layers", default="2,4", help="reduced depths of the transport measurement (both models)")
    p.add_argument("--transport-known", default="", help="depths measured before, L:wall_s:peak_gib,... (joined to the fit)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None)
    args = p.parse_args()
    args.transport_layers = [int(x) for x in str(args.transport_layers).split(",")]
    if args.child:
        return child(args)
    d = Path(args.dir or tempfile.mkdtemp(prefix="ms-real-shapes-"))
    args.dir = str(d)
    arms = args.arms.split(",")
    full = any(a in arms for a in ("weights", "eager", "merge"))  # the arms that read the full-depth pair
    names = list(MODELS) if "quality" in arms else (["pythia-1.4b", "bielik-1.5b-v3"] if full else [])
    print(f"building {', '.join(names)} in {d} (bfloat16)", flush=True)
    results = {r["arm"]: r for r in build_all(args, d, names)}
    todo = [f"quality:{n}" for n in names] if "quality" in arms else []
    todo += ["weights"] if "weights" in arms else []
    todo += [f"weights-eager@pythia-{args.eager_layers}l", f"weights@pythia-{args.eager_layers}l"] if "eager" in arms else []
    todo += ["merge"] if "merge" in arms else []
    todo += [f"transport@{n}" for n in args.transport_layers] if "transport" in arms else []
    for arm in todo:
        results[arm] = run_child(args, arm)
        show(results[arm])
        name = arm.split(":", 1)[1] if arm.startswith("quality:") else None
        if name and name not in ("pythia-1.4b", "bielik-1.5b-v3") and not args.keep:
            shutil.rmtree(d / name, ignore_errors=True)  # disk: only the pair and the donor are needed later
    known = {int(a): {"wall_s": float(b), "peak_rss_gib": float(c)}
             for a, b, c in (x.split(":") for x in args.transport_known.split(",") if x)}
    for ext in (extrapolate(results, args.eager_layers), extrapolate_transport(results, args.transport_layers, known)):
        if ext:
            results[ext["arm"]] = ext
            show(ext)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    if not args.keep:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
