"""Cost of transport-based fusion (probe, layer alignment, neuron plans), and of its alpha grid + random-plan
control against the naive way: the plans refitted for every alpha and for the control.

A NeoX target and a Llama donor of a different depth, random-initialised in-process (float32) at a few
widths, probed on random token-id sentences (a tiny fake tokenizer, no files). The transport settings
are conf/merge/transport.yaml's. Each step runs once per width, in a FRESH subprocess that builds the
models, loads the earlier steps' outputs (probes, layer alignment) from a temporary folder (untimed),
warms torch up, then measures the step:

- CPU: frees what it can (gc + malloc_trim), resets the kernel's resident-set high-water mark
  (``echo 5 > /proc/self/clear_refs``; sees torch's allocations, unlike tracemalloc) and reports
  VmHWM after the step minus the RSS before it (fallback where clear_refs is not writable:
  getrusage ru_maxrss delta, which only sees growth above the earlier high-water mark);
- CUDA (``--device cuda``): torch.cuda.max_memory_allocated during the step minus the allocation before it.

Steps: (1) probe = both models' activations at every interface; (2) align_layers = the layer-level
OT; (3) fusion, as the transport job does it: fuse once (every neuron plan, target layer by target
layer, T and T_rand at the masked rows), then every alpha x (OT, control) weight set built and written
into the target; (4) naive, in its own process: for every alpha and again for the control, fuse from
scratch (every plan refitted) and write that one weight set. The grid is printed as naive / ours in
wall time (the speed-up from fitting the plans once) and in peak memory.

Per-layer design: fuse keeps one (target layer, donor layer) pair's plans at a time. For the largest
width, the most plan bytes alive at once during fuse are measured (every plan Q that Sinkhorn returns
and every scaled Phi fuse makes from it, tracked by weakref until freed) and printed against the float64
size of the full plans of one layer pair and of every layer pair, computed arithmetically.

    python benchmarks/bench_transport.py [--widths 64:256,128:512,256:1024] [--target-layers 3]
        [--donor-layers 4] [--n 192] [--vocab 512] [--threads 2] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class FakeTokenizer:
    """Sentences are space-separated token ids; ``tokenize`` calls tok(list, add_special_tokens=, truncation=)."""
    pad_token_id = 0

    def __call__(self, texts, add_special_tokens=True, truncation=False):
        return {"input_ids": [[int(t) for t in s.split()] for s in texts]}


def _sentences(n: int, vocab: int, seed: int, min_len: int = 8, max_len: int = 48) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [" ".join(map(str, rng.integers(1, vocab, size=int(rng.integers(min_len, max_len + 1))))) for _ in range(n)]


def _models(a, hidden: int, ffn: int, device):
    import torch
    from transformers import AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig

    heads = max(1, hidden // 32)
    tcfg = GPTNeoXConfig(vocab_size=a.vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=a.target_layers,
                         num_attention_heads=heads, max_position_embeddings=128)
    dcfg = LlamaConfig(vocab_size=a.vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=a.donor_layers,
                       num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=128)
    out = []
    for seed, cfg in ((0, tcfg), (1, dcfg)):
        torch.manual_seed(seed)
        out.append(AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).to(device).eval())
    return out


class Meter:
    """Wall time and peak memory of a step, relative to what was allocated when it started."""

    def __init__(self, device):
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"
        self.page = os.sysconf("SC_PAGE_SIZE")
        try:
            import ctypes
            self.libc = ctypes.CDLL("libc.so.6")
        except OSError:
            self.libc = None

    def _rss(self) -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * self.page

    def _hwm(self) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def start(self) -> None:
        import gc
        import resource

        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats()
            self.base = self.torch.cuda.memory_allocated()
        else:
            if self.libc is not None:
                self.libc.malloc_trim(0)
            self.base = self._rss()
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                self.how = "VmHWM"
            except OSError:
                self.how = "ru_maxrss delta"
                self.base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.t0 = time.perf_counter()

    def read(self) -> tuple[float, int]:
        """(seconds, peak bytes) since start(); start() is not reset, so a later read covers more."""
        import resource

        if self.cuda:
            self.torch.cuda.synchronize()
            return time.perf_counter() - self.t0, self.torch.cuda.max_memory_allocated() - self.base
        t = time.perf_counter() - self.t0
        if self.how == "VmHWM":
            return t, self._hwm() - self.base
        return t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.base


def _write(model, weights) -> None:
    """As the transport job does: copy every fused tensor into the target's parameters."""
    sd = model.state_dict()
    for k, v in weights.items():
        sd[k].copy_(v.to(sd[k].device, sd[k].dtype))


class PlanTally:
    """Live bytes of the neuron plans fuse holds: every Q that ``tot.solve`` returns and every Phi made from it
    (``row_stochastic`` / ``column_stochastic``), tracked by weakref until freed. The Phi made inside
    plan_diagnostics (a transient of the diagnostics, not a held plan) is not counted."""

    def __init__(self, tot):
        self.live = self.peak = self.count = 0
        for name in ("row_stochastic", "column_stochastic"):
            setattr(tot, name, self._wrap(getattr(tot, name), lambda out: out))
        tot.solve = self._wrap(tot.solve, lambda out: out[0])

    def _wrap(self, inner, plan_of):
        import weakref

        def tracked(*args, **kwargs):
            out = inner(*args, **kwargs)
            if sys._getframe(1).f_code.co_name != "plan_diagnostics":
                plan = plan_of(out)
                n = plan.numel() * plan.element_size()
                self.live += n
                self.count += 1
                self.peak = max(self.peak, self.live)
                weakref.finalize(plan, self._free, n)
            return out

        return tracked

    def _free(self, n: int) -> None:
        self.live -= n


def child(a, step: str, hidden: int, ffn: int) -> dict:
    """One step, measured; its inputs (probes, alignment) come from the earlier steps' files in --cache."""
    import torch

    from mergescope.transport import fusion as fus
    from mergescope.transport import interfaces as itf
    from mergescope.transport import ot as tot
    from mergescope.transport.settings import TransportSettings

    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    s = TransportSettings.defaults()  # conf/merge/transport.yaml, validated
    target, donor = _models(a, hidden, ffn, device)
    t_ad, d_ad = itf.adapter_for(target.config.model_type), itf.adapter_for(donor.config.model_type)
    tok = FakeTokenizer()
    st, sd = _sentences(a.n, a.vocab, 10), _sentences(a.n, a.vocab, 11)
    kw = {"max_length": 128, "progress": False}
    cache = Path(a.cache) / f"{hidden}_{ffn}"
    cache.mkdir(parents=True, exist_ok=True)
    meter = Meter(device)
    res: dict = {"step": step}
    # warm-up: torch's code pages, thread pools (not the step's memory)
    fus.probe(target, tok, st[:4], t_ad, **kw), fus.probe(donor, tok, sd[:4], d_ad, **kw)

    if step == "probe":
        meter.start()
        tp, dp = fus.probe(target, tok, st, t_ad, **kw), fus.probe(donor, tok, sd, d_ad, **kw)
        res["probe"] = meter.read()
        torch.save((tp, dp), cache / "probes.pt")
        return res
    tp, dp = torch.load(cache / "probes.pt", map_location=device, weights_only=False)
    if step == "align":
        tot.solve(torch.rand(8, 8, dtype=torch.float64, device=device), 0.1)  # POT's backend, warm
        meter.start()
        align = fus.align_layers(tp, dp, s, progress=False)
        res["align"] = meter.read()
        res["align_plans"] = len(align.infos)
        res["align_fallbacks"] = sum(1 for i in align.infos if i.solver != "sinkhorn")
        torch.save(align, cache / "align.pt")
        return res
    align = torch.load(cache / "align.pt", weights_only=False)
    donor_sd = {k: v.detach() for k, v in donor.state_dict().items()}
    grid = [(alpha, ctl) for alpha in s.alphas for ctl in (False, True)]
    tot.solve(torch.rand(8, 8, dtype=torch.float64, device=device), 0.1)  # POT's backend, warm
    if step == "naive":  # the plans refitted for every alpha and for the control: one fuse per weight set
        meter.start()
        for alpha, ctl in grid:
            fusion = fus.fuse(target, donor_sd, tp, dp, t_ad, d_ad, align, s, progress=False)
            _write(target, fusion.weights(alpha, control=ctl))
            fusion = None
            _sync(meter)
        res["naive"] = meter.read()
        return res
    tally = PlanTally(tot)
    meter.start()  # ours: fuse once, then every alpha x (OT, control) built and written
    fusion = fus.fuse(target, donor_sd, tp, dp, t_ad, d_ad, align, s, progress=False)
    res["fuse"] = meter.read()
    writes = []
    for alpha, ctl in grid:
        t0 = time.perf_counter()
        _write(target, fusion.weights(alpha, control=ctl))
        _sync(meter)
        writes.append(time.perf_counter() - t0)
    res["grid"] = meter.read()
    res["writes"], res["n_weight_sets"] = writes, len(grid)
    tensors = [*fusion.original.values(), *fusion.transported.values(), *fusion.control.values(), *fusion.masks.values(),
               *fusion.rows.values()]
    res["fusion_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    # float64 full plans Q of one (target layer, donor layer) pair at the interfaces fuse transports
    d_role = {role: name for name, role, _, _ in itf.transported_weights(d_ad)}
    needed = set()
    for name, role, o, i in itf.transported_weights(t_ad):
        if role in d_role and f"{d_ad.layers_attr}.0.{d_role[role]}" in donor_sd:
            needed |= {o} | ({i} if i else set())

    def dim(p, iface):
        return p.pooled["mlp_pre" if iface == itf.HIDDEN else iface][0].shape[1]

    res["pair_plan_bytes"] = 8 * sum(dim(tp, f) * dim(dp, f) for f in needed)
    res["interfaces"] = sorted(needed)
    res["kept_per_layer"] = int(max((align.kept > 0).sum(1)))
    res["plans_peak"], res["plans_made"] = tally.peak, tally.count
    res["plans"] = len(fusion.infos)
    res["fallbacks"] = sum(1 for i in fusion.infos if i.solver != "sinkhorn")
    return res


def _sync(meter) -> None:
    if meter.cuda:
        meter.torch.cuda.synchronize()


def run_child(a, step: str, hidden: int, ffn: int, cache: str) -> dict:
    cmd = [sys.executable, __file__, "--child", step, "--child-width", f"{hidden}:{ffn}", "--cache", cache,
           "--device", a.device, "--threads", str(a.threads), "--target-layers", str(a.target_layers),
           "--donor-layers", str(a.donor_layers), "--n", str(a.n), "--vocab", str(a.vocab)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"child {step} at {hidden}:{ffn} failed (exit {p.returncode})")
    return json.loads(p.stdout.strip().splitlines()[-1])


def mib(b: float) -> str:
    return f"{b / 2**20:7.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="64:256,128:512,256:1024", help="hidden:ffn,... (target and donor share a width)")
    ap.add_argument("--target-layers", type=int, default=3)
    ap.add_argument("--donor-layers", type=int, default=4)
    ap.add_argument("--n", type=int, default=192, help="probe sentences per side (random token ids, 8-48 tokens)")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu | cuda (models, probes and plans on that device)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-width", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        h, f = map(int, a.child_width.split(":"))
        from mergescope.models import quiet_transformers
        quiet_transformers()
        print(json.dumps(child(a, a.child, h, f)))
        return
    if a.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda asked for, but torch sees no CUDA device")
    import yaml

    m = yaml.safe_load((REPO / "conf" / "merge" / "transport.yaml").read_text())
    widths = [tuple(map(int, w.split(":"))) for w in a.widths.split(",")]
    cuda = a.device.startswith("cuda")
    print(f"NeoX target ({a.target_layers} layers) <- Llama donor ({a.donor_layers} layers), float32 on {a.device}, "
          f"{a.n} random probe sentences per side, {a.threads} threads; conf/merge/transport.yaml: epsilon={m['epsilon']} "
          f"layer_topk={m['layer_topk']} top_k={m['top_k']} alphas={m['alphas']}")
    print(f"each cell: wall time, then {'peak CUDA allocated' if cuda else 'peak RSS (VmHWM)'} during the step minus what "
          "was allocated before it; each step in a fresh subprocess")
    print(f"{'width h/ffn':>11s} | {'probe (both)':>18s} | {'align_layers':>18s} | {'fuse':>18s} | {'ours: grid+control':>18s} | "
          f"{'naive: refit each':>18s} | naive/ours: time  mem")
    results, t_start, load0 = [], time.perf_counter(), os.getloadavg()[0]
    cell = lambda x: f"{x[0]:6.2f} s {x[1] / 2**20:6.1f} MiB"
    with tempfile.TemporaryDirectory() as tmp:
        for h, f in widths:
            r = {s: run_child(a, s, h, f, tmp) for s in ("probe", "align", "fusion", "naive")}
            p, al, fu, nv = r["probe"], r["align"], r["fusion"], r["naive"]
            rt, rm = nv["naive"][0] / fu["grid"][0], nv["naive"][1] / max(fu["grid"][1], 1)
            print(f"{h:>5d}/{f:<5d} | {cell(p['probe'])} | {cell(al['align'])} | {cell(fu['fuse'])} | {cell(fu['grid'])} | "
                  f"{cell(nv['naive'])} | {rt:9.2f}x {rm:5.2f}x")
            results.append((h, f, r))
    print()
    worst = math.inf
    for h, f, r in results:
        fu, w = r["fusion"], r["fusion"]["writes"]
        worst = min(worst, r["naive"]["naive"][0] / fu["grid"][0])
        print(f"{h}/{f}: ours = fuse {fu['fuse'][0]:.2f} s + {len(w)} weight sets ({len(m['alphas'])} alphas x OT/control) built + "
              f"written {sum(w) * 1000:.0f} ms; naive = {fu['n_weight_sets']} fuses; plans per fuse: "
              f"{r['align']['align_plans']} layer-alignment (fitted once, not timed here) + {fu['plans']} fusion, "
              f"{r['align']['align_fallbacks'] + fu['fallbacks']} log-domain fallbacks")
    print(f"alpha grid {m['alphas']} + random-plan control: naive (plans refitted per alpha and for the control) / ours "
          f"(plans fitted once): at least {worst:.2f}x in wall time")
    h, f, r = results[-1]
    fu = r["fusion"]
    pair, L_a, L_b = fu["pair_plan_bytes"], a.target_layers, a.donor_layers
    print()
    print(f"plans at width {h}/{f} (float64; interfaces {', '.join(fu['interfaces'])}):")
    print(f"  measured: at most {mib(fu['plans_peak'])} of plans (Q and the Phi made from it) alive at once during fuse "
          f"({fu['plans_made']} made in all)")
    print(f"  arithmetic: the full Q of one layer pair at every interface {mib(pair)}; of every layer pair {L_a}x{L_b} at once "
          f"{mib(pair * L_a * L_b)}")
    print(f"  fuse peak {'allocated' if cuda else 'RSS'} {mib(fu['fuse'][1])} = the Fusion's own tensors (originals in the model's "
          f"dtype, T and T_rand at the top-{m['top_k']} rows, masks) {mib(fu['fusion_bytes'])} + working memory "
          f"{mib(fu['fuse'][1] - fu['fusion_bytes'])} (one pair's plans + Sinkhorn/EMD scratch)")
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"total {time.perf_counter() - t_start:.0f} s wall, {ru.ru_utime + ru.ru_stime:.0f} s CPU in the subprocesses; "
          f"1-min load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end on {os.cpu_count()} CPUs "
          "(a load above the CPU count means other work shared the cores and the times are inflated)")


if __name__ == "__main__":
    main()
