"""Cost of transport-based fusion (probe, layer alignment, neuron plans) and of its alpha grid + control
(target: the whole grid {0.01, 0.03, 0.1} plus the random-plan control costs <= 1.5x ONE fusion).

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
OT; (3) fuse = every neuron plan, target layer by target layer, and the OT and control tensors;
(4) in the same process and from the same start: one alpha's weights built and written into the
target (the reading then is ONE fusion: fuse + one alpha), then the other alphas and the control
(the reading then is the whole grid: fuse + 3 alphas x (OT, control), each built and written). The
grid is printed as a multiple of one fusion in wall time and in peak memory. Taking both from one
process keeps fuse's run-to-run noise (large on a shared machine) out of the ratio; the fuse they
share is the real, single fuse the transport job runs.

Per-layer design: fuse keeps one (target layer, donor layer) pair's plans (OT + control) at a time.
For the largest width, the most plan bytes alive at once during fuse are measured (every Phi that
fuse makes, tracked by weakref until it is freed) and printed against the float64 size of the plans
of one pair, of the kept pairs (L_target x layer_topk) and of every layer pair, computed
arithmetically; with fuse's peak split into the Fusion's own tensors and its working memory.

    python benchmarks/bench_transport.py [--widths 64:256,128:512,256:1024] [--target-layers 3]
        [--donor-layers 4] [--n 192] [--vocab 512] [--threads 2] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = 1.5


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
    """Live bytes of the neuron plans fuse holds: every Phi it makes (tot.row_stochastic's output, the OT
    plans and the control's), tracked by weakref until freed. Phi made inside plan_diagnostics (a
    transient of the diagnostics, not a held plan) is not counted."""

    def __init__(self, tot):
        import weakref

        self.live = self.peak = self.count = 0
        inner = tot.row_stochastic

        def tracked(Q):
            out = inner(Q)
            if sys._getframe(1).f_code.co_name != "plan_diagnostics":
                n = out.numel() * out.element_size()
                self.live += n
                self.count += 1
                self.peak = max(self.peak, self.live)
                weakref.finalize(out, self._free, n)
            return out

        tot.row_stochastic = tracked

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
    alphas = list(s.alphas)
    tally = PlanTally(tot) if s.plan_scale == "row_stochastic" else None
    tot.solve(torch.rand(8, 8, dtype=torch.float64, device=device), 0.1)
    # fuse, then every alpha x (OT, control) built and written, all from one start: the reading after the
    # first write is ONE fusion (fuse + one alpha's weights), the last one the whole grid + control
    meter.start()
    fusion = fus.fuse(target, donor_sd, tp, dp, t_ad, d_ad, align, s, progress=False)
    res["fuse"] = meter.read()
    writes = []
    for alpha in alphas:
        for ctl in (False, True):
            t0 = time.perf_counter()
            _write(target, fusion.weights(alpha, control=ctl))
            if meter.cuda:
                torch.cuda.synchronize()
            writes.append(time.perf_counter() - t0)
            if len(writes) == 1:
                res["one"] = meter.read()
    res["grid"] = meter.read()
    res["writes"], res["n_alphas"] = writes, len(alphas)
    tensors = [*fusion.original.values(), *fusion.transported.values(), *fusion.control.values(), *fusion.masks.values()]
    res["fusion_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    # float64 plans (OT + control) of one (target layer, donor layer) pair at the interfaces fuse transports
    # (as fuse decides: a target weight is transported when the donor has its role)
    d_role = {role: name for name, role, _, _ in itf.transported_weights(d_ad, False)}
    needed = set()
    for name, role, o, i in itf.transported_weights(t_ad, False):
        if role in d_role and f"{d_ad.layers_attr}.0.{d_role[role]}" in donor_sd:
            needed |= {o} | ({i} if i else set())

    def dim(p, iface):
        return p.pooled["mlp_pre" if iface == itf.HIDDEN else iface][0].shape[1]

    res["pair_plan_bytes"] = 2 * 8 * sum(dim(tp, f) * dim(dp, f) for f in needed)
    res["interfaces"] = sorted(needed)
    res["kept_per_layer"] = int(max((align.kept > 0).sum(1)))
    res["plans_peak"] = tally.peak if tally else None
    res["plans_made"] = tally.count if tally else None
    res["plans"] = len(fusion.infos)
    res["fallbacks"] = sum(1 for i in fusion.infos if i.solver != "sinkhorn")
    return res


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
    print(f"{'width h/ffn':>11s} | {'probe (both)':>18s} | {'align_layers':>18s} | {'fuse':>18s} | {'one fusion':>18s} | "
          f"{'grid + control':>18s} | grid/one: time   mem")
    results, t_start, load0 = [], time.perf_counter(), os.getloadavg()[0]
    cell = lambda x: f"{x[0]:6.2f} s {x[1] / 2**20:6.1f} MiB"
    with tempfile.TemporaryDirectory() as tmp:
        for h, f in widths:
            r = {s: run_child(a, s, h, f, tmp) for s in ("probe", "align", "fusion")}
            p, al, fu = r["probe"], r["align"], r["fusion"]
            rt, rm = fu["grid"][0] / fu["one"][0], fu["grid"][1] / max(fu["one"][1], 1)
            print(f"{h:>5d}/{f:<5d} | {cell(p['probe'])} | {cell(al['align'])} | {cell(fu['fuse'])} | {cell(fu['one'])} | "
                  f"{cell(fu['grid'])} | {rt:9.2f}x {rm:5.2f}x")
            results.append((h, f, r))
    print()
    worst = 0.0
    for h, f, r in results:
        fu, w = r["fusion"], r["fusion"]["writes"]
        worst = max(worst, fu["grid"][0] / fu["one"][0])
        print(f"{h}/{f}: one alpha's weights built + written {w[0] * 1000:.0f} ms, all {len(w)} weight sets "
              f"({fu['n_alphas']} alphas x OT/control) {sum(w) * 1000:.0f} ms, against fuse {fu['fuse'][0]:.2f} s; "
              f"plans: {r['align']['align_plans']} layer-alignment + {fu['plans']} fusion, "
              f"{r['align']['align_fallbacks'] + fu['fallbacks']} log-domain fallbacks")
    print(f"alpha grid {m['alphas']} + random-plan control vs ONE fusion (fuse + one alpha written): worst {worst:.2f}x "
          f"in time (target <= {TARGET}x): {'MET' if worst <= TARGET else 'NOT MET'}")
    h, f, r = results[-1]
    fu = r["fusion"]
    pair, k, L_a, L_b = fu["pair_plan_bytes"], fu["kept_per_layer"], a.target_layers, a.donor_layers
    print()
    print(f"plans at width {h}/{f} (Phi, float64, OT + control; interfaces {', '.join(fu['interfaces'])}):")
    if fu["plans_peak"] is not None:
        print(f"  measured: at most {mib(fu['plans_peak'])} of plans alive at once during fuse "
              f"({fu['plans_made']} plans made in all)")
    print(f"  arithmetic: one layer pair {mib(pair)}; the {L_a}x{k} kept pairs at once {mib(pair * L_a * k)}; "
          f"every layer pair {L_a}x{L_b} at once {mib(pair * L_a * L_b)}")
    print(f"  fuse peak {'allocated' if cuda else 'RSS'} {mib(fu['fuse'][1])} = the Fusion's own tensors (originals, T, T_rand, "
          f"masks) {mib(fu['fusion_bytes'])} + working memory {mib(fu['fuse'][1] - fu['fusion_bytes'])} "
          f"(one pair's plans + Sinkhorn/EMD scratch; every pair's plans would be {pair * L_a * L_b / 2**20:.0f} MiB)")
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"total {time.perf_counter() - t_start:.0f} s wall, {ru.ru_utime + ru.ru_stime:.0f} s CPU in the subprocesses; "
          f"1-min load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end on {os.cpu_count()} CPUs "
          "(a load above the CPU count means other work shared the cores and the times are inflated)")


if __name__ == "__main__":
    main()
