"""What a study's jobs cost before they run: FLOP and byte counts from the models' shapes and each job's settings,
turned into seconds and peak memory on this machine's CPU (rates fitted on the real-shape benchmark's measured
points, ``conf/costs.yaml``) and on a GPU of a stated size (its stated peak rates times a stated efficiency).

The counts (per job, :class:`Work`):

- a forward pass: 2 x (the parameters a token meets in matmuls) per token, plus 2 x hidden x vocab per token when
  the logits are needed (an NLL); the attention score term (4 x layers x hidden x length per token, under 1% at these
  sentence lengths) is left out. Tokens are UTF-8 bytes / ``bytes_per_token`` of the sentences the job reads (the
  data files are read for their sizes; 4.0 is stated in ``conf/costs.yaml``: SmolLM2's English tokenizer gives 4.77
  on FLORES English, a monolingual model's tokenizer on its own language about as much);
- training: 3x a forward's FLOPs per token (forward and backward);
- loading: the weights in float32 (the studies' dtype), read from their files;
- an entropic OT plan: 2 matrix-vector passes over the n x m float64 kernel per Sinkhorn iteration, at the
  iteration count fitted on the benchmark's transport points (memory-bound: counted as bytes);
- a representation is extracted once per (model, data, split, pooling, layer) per plan: the later jobs of the same
  extraction read the cache (as the runs do), so only the first is charged.

CPU seconds = the kind's per-job overhead + float32 bytes loaded / the load rate + FLOPs / the forward rate + Sinkhorn
iterations x bytes per iteration / the pass bandwidth. The load rate and the iteration count are fitted by least
squares on the real-shape benchmark's points; the forward rate (``bench_real_throughput.py``), the pass bandwidth and
the per-job overheads (the default study's per-arm times, what its toy jobs' counts leave) are measured. Mamba's CPU time is multiplied by its measured reference-path slowdown. GPU seconds
= the same load (the host reads the files) + the bytes over the host link + FLOPs / (peak x efficiency) + OT bytes /
(bandwidth x efficiency): an estimate from stated numbers, never measured here (no GPU has been lent to this project).
Peak memory on the CPU: the process's base plus the models the job holds at once in float32, times a factor fitted
per kind on the benchmark's peaks; on the GPU: the same models plus 20% (activations, allocator), against its size.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from mergescope.errors import MergescopeError

COSTS_FILE = Path(__file__).resolve().parents[2] / "conf" / "costs.yaml"
GiB = 1024**3


@dataclass(frozen=True)
class Shape:
    """A model's size as its matmuls see it."""

    name: str
    model_type: str
    params: int        # every parameter (a tied head counted once)
    embed: int         # input embedding parameters (a lookup, not a matmul)
    head: int          # vocab x hidden: the logits' matmul (the embedding itself when tied)
    layers: int
    hidden: int
    ffn: int
    tied: bool
    body: int          # matrix parameters a token meets before the head (every >= 2-D weight but the embedding and head)
    q_dim: int = 0     # the attention's query width (heads x head size; 0 = hidden) and its key/value width
    kv_dim: int = 0

    @property
    def f32_bytes(self) -> int:
        return 4 * self.params


def _count(config, name: str) -> Shape:
    """Exact parameter counts of a transformers config: the model built on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from mergescope.models import quiet_transformers

    quiet_transformers()
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config)
    emb, out = m.get_input_embeddings().weight, m.get_output_embeddings()
    tied = out is None or out.weight is emb
    head = emb.numel() if out is None else out.weight.numel()
    params = sum(p.numel() for p in m.parameters())  # parameters() yields a tied tensor once
    matrices = sum(p.numel() for p in m.parameters() if p.ndim >= 2) - emb.numel() - (0 if tied else head)
    s = lambda k, d=0: int(getattr(config, k, None) or d)  # noqa: E731
    hidden, heads = s("hidden_size", s("d_model")), s("num_attention_heads", 1)
    head_dim = s("head_dim", hidden // max(heads, 1))
    return Shape(name, str(config.model_type), int(params), int(emb.numel()), int(head), s("num_hidden_layers"),
                 hidden, s("intermediate_size", 2 * hidden), tied, int(matrices), heads * head_dim,
                 s("num_key_value_heads", heads) * head_dim)


@functools.lru_cache(maxsize=256)
def _shape_from_json(text: str, name: str) -> Shape:
    from transformers import AutoConfig

    d = json.loads(text)
    model_type = d.pop("model_type")
    return _count(AutoConfig.for_model(model_type, **d), name)


def shape_of(entry: Any) -> tuple[Shape | None, str]:
    """(the model's shape, where it was read from): its config.json when the weights are on disk (a local or trained
    zoo folder, the hub cache), else the ``zoo:`` architecture a zoo model is trained with, else the ``shape:``
    transformers config of its conf/model entry (for a hub model not downloaded yet); (None, why) otherwise."""
    from mergescope import models

    name = models.label(entry)
    try:
        ref = models.resolve(entry)
    except MergescopeError:
        ref = None
    path = None
    if ref is not None and ref.local and ref.gguf_file is None and (Path(ref.location) / "config.json").is_file():
        path = str(Path(ref.location) / "config.json")
    elif ref is not None and not ref.local:
        path = models.cached_hub_file(ref, "config.json")
    if path:
        d = json.loads(Path(path).read_text())
        if "model_type" in d:
            return _shape_from_json(json.dumps(d, sort_keys=True), name), "config.json"
    if ref is not None and ref.gguf_file is not None:
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(ref.location, gguf_file=ref.gguf_file, trust_remote_code=False)
        return _shape_from_json(json.dumps(c.to_dict(), sort_keys=True, default=str), name), "gguf"
    init_from = (entry.get("zoo") or {}).get("init_from")
    if init_from:  # a fine-tune not trained yet: its base's shape (never a default config of its family)
        base = Path(str(init_from)) / "config.json"
        if base.is_file():
            return _shape_from_json(base.read_text(), name), "base config.json"
        if not (entry.get("zoo") or {}).get("hidden_size"):  # else its own zoo: architecture (the base's, checked on training)
            return None, f"{name}: its base {init_from} is not on disk (install or train it first: make real for a real base)"
    if entry.get("zoo") is not None:
        from mergescope.zoo.build import zoo_config

        cfg = zoo_config(OmegaConf.to_container(entry.zoo), int(entry.zoo.vocab_size))
        return _shape_from_json(json.dumps(cfg.to_dict(), sort_keys=True, default=str), name), "zoo config"
    if entry.get("shape") is not None:
        return _shape_from_json(json.dumps(OmegaConf.to_container(entry.shape), sort_keys=True), name), "conf shape"
    return None, f"{name}: no config.json on disk and no shape: in its conf/model entry"


# ------------------------------------------------------------------------------------------------ the counts


@dataclass
class Work:
    """A job's counts. ``held`` are the models it holds at once (their float32 bytes bound its peak)."""

    kind: str
    flops: float = 0.0
    load_bytes: float = 0.0       # float32 bytes of weights loaded (read from files)
    ot_bytes: float = 0.0         # memory traffic of ONE Sinkhorn iteration of every plan (float64 kernels)
    product_flops: float = 0.0    # the fusion's float64 products (in a stage's floor at the float64 rate; the fitted
                                  # estimate holds them in its Sinkhorn term, fitted on whole transport jobs)
    cost_flops: float = 0.0       # the plans' Pearson costs, float64 matmuls (in a stage's floor at the float64 rate;
                                  # the fitted estimate charges them at the forward rate, as it was fitted)
    held: list[Shape] = field(default_factory=list)
    slow: float = 1.0             # CPU slowdown of a reference path (Mamba)
    missing: list[str] = field(default_factory=list)   # why a count is unknown (the estimate is then None)

    @property
    def total_flops(self) -> float:
        """Every counted FLOP, float32 and float64."""
        return self.flops + self.cost_flops + self.product_flops

    @property
    def float64_flops(self) -> float:
        """The float64 part of :attr:`total_flops` (a stage's floor takes it at the float64 rate)."""
        return self.cost_flops + self.product_flops

    def add_load(self, s: Shape) -> None:
        self.load_bytes += s.f32_bytes

    def add_forward(self, s: Shape, tokens: float, logits: bool, passes: float = 1.0) -> None:
        self.flops += passes * 2.0 * tokens * (s.body + (s.head if logits else 0))


class Counter:
    """Counts jobs in study order, remembering which extractions an earlier job of the plan already paid for."""

    def __init__(self, constants: DictConfig):
        self.k = constants
        self.seen: set[tuple] = set()
        self.problems: list[str] = []  # what could not be counted (a side of the data that cannot be read)

    def shape(self, entry: Any, w: Work) -> Shape | None:
        s, why = shape_of(entry)
        if s is None:
            w.missing.append(why)
        elif s.model_type.startswith("mamba"):
            w.slow = max(w.slow, float(self.k.mamba_cpu_slowdown))
        return s

    def tokens(self, data: Any, lang: str, n: int | None = None) -> tuple[int, float]:
        """(sentences, tokens) of the first ``n`` sentences of one side of the data (all when None)."""
        from mergescope import data as data_mod

        try:
            sents = data_mod.load_side(data, str(lang)).sentences
        except MergescopeError as exc:  # the job itself would stop on this line: its estimate is unknown, not zero
            self.problems.append(f"data: {exc}")
            return 0, 0.0
        sents = sents[:n] if n else sents
        return len(sents), sum(len(x.encode("utf-8")) for x in sents) / float(self.k.bytes_per_token)

    def extraction(self, cfg: DictConfig, entry: Any, s: Shape | None, w: Work, data: Any = None, key: tuple = ()) -> None:
        """A representation of one model on one side of the data: charged once per plan. Under
        ``represent.one_forward`` every arm's read of one model and side (scores, states of any pooling) is the one
        forward, with the LM head: charged once whatever ``key`` the arm gives."""
        data = cfg.data if data is None else data
        one = bool((cfg.get("represent") or {}).get("one_forward"))  # represent.one_forward: one pass with the head
        ident = (str(entry.get("name_or_path")), str(entry.get("revision")), str(data.get("name")), str(data.get("split")),
                 data.get("max_sentences"), str(entry.get("lang")), *(("one",) if one else key))
        if ident in self.seen or s is None:
            return
        self.seen.add(ident)
        _, tok = self.tokens(data, entry.lang, data.get("max_sentences"))
        w.add_load(s)
        w.add_forward(s, tok, logits=one)


def _w_train(c: Counter, cfg: DictConfig, w: Work) -> None:
    s = c.shape(cfg.model, w)
    if s:
        zoo = cfg.model.get("zoo") or {}
        t = {**dict(cfg.train), **dict(zoo.get("train") or {})}  # the entry's own steps and hyperparameters (a fine-tune)
        steps = zoo.get("steps") or t["steps"]
        w.add_forward(s, float(steps) * float(t["batch_size"]) * float(t["seq_len"]), logits=True, passes=3.0)
        w.held = [s]


def fused_products(t: tuple[int, int], d: tuple[int, int], rows: int, seeds: int, by_column: bool = False) -> float:
    """The float64 FLOPs of fusing one donor weight of shape ``d`` (out, in) into one target weight of shape ``t`` at
    ``rows`` masked target neurons, for T and each of ``seeds`` random-plan controls (what the fusion's matmuls do,
    torch's FLOP counter's count): by rows, the masked rows of Phi_out (T's and each control's) times W_B, then each
    block times Phi_in^T; by column (the released o_proj and down_proj), Phi_out W_B once over every target row, then
    times each one's masked columns of Phi_in."""
    (t_out, t_in), (d_out, d_in), blocks = t, d, 1 + seeds
    if by_column:
        return 2.0 * t_out * d_out * d_in + 2.0 * blocks * t_out * d_in * min(rows, t_in)
    k = min(rows, t_out)
    return 2.0 * blocks * k * d_out * d_in + 2.0 * blocks * k * d_in * t_in


FUSED_WEIGHTS = {"mlp_act": ("ffn", "hidden"), "mlp_up": ("ffn", "hidden"), "mlp_down": ("hidden", "ffn"),
                 "attn_o": ("hidden", "q")}
"""mergescope's fusion (:mod:`mergescope.transport.interfaces`): each transported weight's role and its (out, in)
widths; a model type in NO_UP_PROJ has no separate up projection."""
NO_UP_PROJ = ("gpt_neox",)


def _roles(st: Shape, sd: Shape, roles, absent: str) -> list[str]:
    """The roles both models have (``absent``: the role a model type in NO_UP_PROJ lacks)."""
    return [r for r in roles if r != absent or not ({st.model_type, sd.model_type} & set(NO_UP_PROJ))]


def transport_plans(w: Work, st: Shape, sd: Shape, probes: float, k: DictConfig, subsample: int, topk: int,
                    released: tuple[str, str, int, str] | None = None, rows: int = 0, seeds: int = 1) -> None:
    """Both models loaded and probed, the layer-cost pass (two subsampled neuron plans per layer pair, their cost
    matrices) and the fusion's plans (per target layer and kept donor layer: the hidden units' plan and four
    residual-width interfaces), as FLOPs and bytes per Sinkhorn iteration, and the fusion's float64 products at
    ``rows`` masked neurons with ``seeds`` control seeds (:func:`fused_products`); ``released`` (its sublayers, layer
    pairs, p_topk and solver): the released method's plans and products instead (:func:`released_plans`)."""
    for s in (st, sd):
        w.add_load(s)
        w.add_forward(s, probes * float(k.probe_tokens_per_sentence), logits=False)
    if released is not None:
        released_plans(w, st, sd, probes, k, released[0], released[1], subsample, topk, released[2], rows, seeds, released[3])
        return
    kk = min(subsample, st.ffn) * min(subsample, sd.ffn)
    pairs = float(st.layers * sd.layers)
    w.ot_bytes += 2 * pairs * 2 * 8.0 * kk
    w.cost_flops += 2 * pairs * 2 * probes * kk  # the layer pass's cost matrices (Pearson: one float64 matmul each)
    kept = float(st.layers * min(topk, sd.layers))
    w.ot_bytes += kept * 2 * 8.0 * (st.ffn * sd.ffn + 4 * st.hidden * sd.hidden)
    w.cost_flops += kept * 2 * probes * (st.ffn * sd.ffn + 4 * st.hidden * sd.hidden)
    for role in _roles(st, sd, FUSED_WEIGHTS, "mlp_up"):
        o, i = FUSED_WEIGHTS[role]
        w.product_flops += kept * fused_products((_width(st, o), _width(st, i)), (_width(sd, o), _width(sd, i)), rows, seeds)


RELEASED_VIEWS = {"q": (("attn_in", "hidden"), ("q_out", "q")), "k": (("attn_in", "hidden"), ("k_out", "kv")),
                  "v": (("attn_in", "hidden"), ("v_out", "kv")), "o": (("o_in", "q"), ("o_out", "hidden")),
                  "gate": (("mlp_in", "hidden"), ("gate_out", "ffn")), "up": (("mlp_in", "hidden"), ("up_out", "ffn")),
                  "down": (("down_in", "ffn"), ("down_out", "hidden"))}
"""The released method's modules (:mod:`mergescope.transport.released`): (input view, output view), each a named
activation and its width; a view several modules share (the attention's input feeds q, k and v) is one plan."""
RELEASED_SUBLAYERS = {"qkvo": ("q", "k", "v", "o"), "qkvo_mlp": ("q", "k", "v", "o", "gate", "up", "down"),
                      "mlp_attn_out": ("gate", "up", "down", "o")}
RELEASED_BY_COLUMN = ("o", "down")
"""The released modules fused by column (their input side masked: ``released.layout``'s by_column)."""


def _width(s: Shape, what: str) -> int:
    return {"hidden": s.hidden, "ffn": s.ffn, "q": s.q_dim or s.hidden, "kv": s.kv_dim or s.hidden}[what]


def released_plans(w: Work, st: Shape, sd: Shape, probes: float, k: DictConfig, sublayers: str, layer_pairs: str,
                   subsample: int, topk: int, p_topk: int = 0, rows: int = 0, seeds: int = 1, solver: str = "released") -> None:
    """The released method's plans (``merge=transport_released``): per distinct activation view of the modules both
    models have, one neuron plan per paired layer pair for the layer cost (zipped: the first min(L_A, L_B) layers of
    each; all: every pair; pruned: every pair on ``subsample`` neurons a side), then the fusion's plans per target layer
    and donor layer it keeps (pruned: ``topk``; else ``p_topk`` when set; else every paired one). Each plan is a Pearson
    cost (one float64 matmul over the probes) and a log-domain Sinkhorn, counted as ``released_ot_factor`` times a
    checked solver's passes over the plan; the fusion's plans the layer-cost pass solved on the same costs (the released
    ``solver``, every layer pair but ``pruned``'s subsamples) are rebuilt from its potentials: their costs are counted
    again, no Sinkhorn. Then each kept pair's float64 products, every module at ``rows`` masked neurons with ``seeds``
    control seeds (:func:`fused_products`; o_proj and down_proj by column)."""
    roles = _roles(st, sd, RELEASED_SUBLAYERS[sublayers], "up")
    views = {name: (_width(st, width), _width(sd, width)) for r in roles for name, width in RELEASED_VIEWS[r]}
    full = sum(float(t) * float(d) for t, d in views.values())
    n_t, n_d = (float(min(st.layers, sd.layers)),) * 2 if layer_pairs == "zipped" else (float(st.layers), float(sd.layers))
    layer = (sum(float(min(t, subsample)) * float(min(d, subsample)) for t, d in views.values())
             if layer_pairs == "pruned" else full)
    fused = (float(st.layers) * float(min(topk, sd.layers)) if layer_pairs == "pruned"
             else n_t * float(min(p_topk, n_d)) if p_topk else n_t * n_d)
    rebuilt = solver == "released" and layer_pairs != "pruned"
    w.ot_bytes += float(k.get("released_ot_factor", 1.0)) * 2 * 8.0 * (n_t * n_d * layer + (0.0 if rebuilt else fused * full))
    w.cost_flops += 2 * probes * (n_t * n_d * layer + fused * full)  # each plan's Pearson cost (a float64 matmul)
    for r in roles:
        (_, pw), (_, ow) = RELEASED_VIEWS[r]
        w.product_flops += fused * fused_products((_width(st, ow), _width(st, pw)), (_width(sd, ow), _width(sd, pw)), rows, seeds,
                                              by_column=r in RELEASED_BY_COLUMN)


def work_models() -> dict[str, Callable[[Counter, DictConfig, Work], None]]:
    """Per task, its counts: training's here, every other task's declared by its arm (``Arm.work``); a task with none
    is estimated from its runs in the store only."""
    from mergescope.arm import arms

    return {"train": _w_train, **{t: fn for a in arms() for t, fn in a.work.items()}}


def count(counter: Counter, task: str, cfg: DictConfig) -> Work | None:
    fn = work_models().get(task)
    if fn is None:
        return None
    w = Work(task)
    before = len(counter.problems)
    fn(counter, cfg, w)
    w.missing += counter.problems[before:]
    return w


# ------------------------------------------------------------------------------------------------ the rates


@functools.lru_cache(maxsize=4)
def constants(path: str | None = None) -> DictConfig:
    p = Path(path) if path else COSTS_FILE
    if not p.is_file():
        raise MergescopeError(f"{p} is missing: the plan's cost constants; restore it from git")
    return OmegaConf.load(p)


def point_work(p: DictConfig, k: DictConfig) -> Work:
    """A benchmark point's counts, by the same formulas as the plan's (its models built from their ``shape``s)."""
    from mergescope.config import load_conf

    from mergescope.models import label

    shapes = {}
    for name in p.models:
        entry = load_conf("model", str(name))
        if entry.get("shape") is None:
            raise MergescopeError(f"conf/costs.yaml point {p.arm}: conf/model/{name}.yaml has no shape:")
        d = OmegaConf.to_container(entry.shape)
        if p.get("layers"):
            d["num_hidden_layers"] = int(p.layers)  # the benchmark's reduced depth
        shapes[label(entry)] = _shape_from_json(json.dumps(d, sort_keys=True), label(entry))
    w = Work(str(p.kind))
    ss = [shapes[label(load_conf('model', str(n)))] for n in p.models]
    tok = float(p.sentences) * float(k.bench_tokens_per_sentence)
    if p.kind == "quality":
        w.add_load(ss[0])
        w.add_forward(ss[0], tok, logits=True)
        w.held = ss[:1]
    elif p.kind in ("native", "merge"):
        for s in ss:
            w.add_load(s)
        w.add_forward(ss[0], tok, logits=True, passes=float(p.get("passes", 1)))
        w.held = ss[:1]
    elif p.kind == "transport":
        transport_plans(w, ss[0], ss[1], float(p.probes), k, int(p.subsample), 3)
        w.add_forward(ss[0], tok, logits=True, passes=float(p.get("passes", 1)))
        w.held = ss[:1]  # the donor is probed and freed before the target loads
    else:
        raise MergescopeError(f"conf/costs.yaml point {p.arm}: unknown kind {p.kind}")
    return w


@dataclass(frozen=True)
class Rates:
    """The CPU's rates, fitted (``fit``), and how well they reproduce the points they were fitted on."""

    overhead_s: dict[str, float]  # per kind: per job, what the counts do not see (conf/costs.yaml, measured)
    load_gbps: float         # float32 GB of weights loaded (read, converted, checked) per second
    flops: float             # forward FLOP/s (measured separately)
    matvec_gbps: float       # one Sinkhorn pass's bytes per second (measured separately)
    sinkhorn_iters: float    # Sinkhorn iterations per plan (fitted: the transport points' OT time at that bandwidth)
    peak_base_gib: float
    peak_factor: dict[str, float]  # per kind: peak above the base, over the float32 bytes of the models it holds
    residuals: list[tuple[str, float, float]] = field(default_factory=list)       # (point, measured s, fitted s)
    peak_residuals: list[tuple[str, float, float]] = field(default_factory=list)  # (point, measured GiB, fitted GiB)


def overhead(w: Work, r: Rates) -> float:
    return r.overhead_s.get(w.kind, r.overhead_s["default"])


def cpu_seconds(w: Work, r: Rates) -> float:
    return w.slow * (overhead(w, r) + w.load_bytes / (r.load_gbps * 1e9) + (w.flops + w.cost_flops) / r.flops
                     + w.ot_bytes * r.sinkhorn_iters / (r.matvec_gbps * 1e9))


def held_gib(w: Work) -> float:
    return sum(s.f32_bytes for s in w.held) / GiB


def peak_kinds() -> dict[str, str]:
    """The benchmark kind whose fitted peak factor a task's peak takes (one forward over the models it holds): training's
    here, the others declared by their arms (``Arm.peak_kind``); a task with none takes its own kind's."""
    from mergescope.arm import arms

    return {"train": "quality", **{t: k for a in arms() for t, k in a.peak_kind.items()}}


def cpu_peak_gib(w: Work, r: Rates) -> float:
    kind = peak_kinds().get(w.kind, w.kind)
    return r.peak_base_gib + held_gib(w) * r.peak_factor.get(kind, max(r.peak_factor.values()))


@functools.lru_cache(maxsize=4)
def fit(path: str | None = None) -> Rates:
    """The CPU rates: non-negative least squares on the measured points of ``conf/costs.yaml`` for the load rate and
    the Sinkhorn iteration count (the forward FLOP rate, the pass bandwidth and the per-job overheads are measured
    separately); the peak factor per kind is the median over its points."""
    from scipy.optimize import nnls

    k = constants(path)
    cpu = k.cpu
    flops, bw = float(cpu.forward_gflops) * 1e9, float(cpu.matvec_gbps) * 1e9
    over = {str(a): float(b) for a, b in cpu.overhead_s.items()}
    pts = list(cpu.points)
    works = [point_work(p, k) for p in pts]
    y = np.array([float(p.wall_s) - (w.flops + w.cost_flops) / flops - over.get(w.kind, over["default"]) for p, w in zip(pts, works)])
    A = np.array([[w.load_bytes / 1e9, w.ot_bytes / bw] for w in works])
    (s_per_gb, iters), _ = nnls(A, y)
    base = float(cpu.peak_base_gib)
    factors: dict[str, list[float]] = {}
    for p, w in zip(pts, works):
        factors.setdefault(w.kind, []).append((float(p.peak_gib) - base) / held_gib(w))
    r = Rates(over, 1.0 / s_per_gb if s_per_gb > 0 else math.inf, flops, bw / 1e9, float(iters), base,
              {kind: float(np.median(v)) for kind, v in factors.items()})
    return Rates(**{**r.__dict__,
                    "residuals": [(str(p.arm), float(p.wall_s), cpu_seconds(w, r)) for p, w in zip(pts, works)],
                    "peak_residuals": [(str(p.arm), float(p.peak_gib), cpu_peak_gib(w, r)) for p, w in zip(pts, works)]})


def gpu_seconds(w: Work, r: Rates, g: DictConfig) -> float:
    """The same load as on the CPU (the host reads and converts the files), the weights over the host link, FLOPs and
    the Sinkhorn passes at the GPU's stated peaks times its stated efficiency, and the same per-job overhead."""
    eff = float(g.efficiency)
    return (overhead(w, r) + w.load_bytes / (r.load_gbps * 1e9) + w.load_bytes / (float(g.host_link_gbps) * 1e9)
            + w.total_flops / (float(g.fp32_tflops) * 1e12 * eff) + w.ot_bytes * r.sinkhorn_iters / (float(g.memory_tbps) * 1e12 * eff))


def gpu_peak_gib(w: Work) -> float:
    """The models the job holds at once (float32) plus 20% for activations and the allocator."""
    return 1.2 * held_gib(w)


def matmul_gflops(seconds: float = 2.0, n: int = 1024, dtype: str = "float32") -> float:
    """This machine's matrix-multiply rate now (GFLOP/s) in ``dtype``: n x n products on torch's threads for about
    ``seconds``, the best of three timed rounds (what a stage's counted FLOPs are divided by to give its floor: float32
    for the forwards and the costs, float64 for the fusion's products)."""
    import time

    import torch

    a, b = torch.randn(n, n, dtype=getattr(torch, dtype)), torch.randn(n, n, dtype=getattr(torch, dtype))
    a @ b  # warm-up
    best = 0.0
    for _ in range(3):
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3:
            a @ b
            reps += 1
        best = max(best, 2.0 * n**3 * reps / (time.perf_counter() - t0) / 1e9)
    return best


def machine() -> dict[str, str]:
    """The CPU a stage ran on and how busy the machine was when it started (tags of the stage's study run)."""
    import os

    name, flags = "unknown", set()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name") and name == "unknown":
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    units = [f for f in ("avx512_bf16", "amx_bf16") if f in flags] or ["none"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {"cpu": name, "cpu_bf16_units": ",".join(units), "cpus": str(os.cpu_count()), "load_at_start": f"{load:.2f}"}


def flop_floor_s(gflop: float, f64_gflop: float, f32_rate: float, f64_rate: float) -> float:
    """A stage's floor (s): its counted float32 FLOPs at the float32 matrix-multiply rate plus its float64 FLOPs (the
    plans' Pearson costs, the fusions' products) at the float64 rate (GFLOP and GFLOP/s, ``gflop`` the total). A float64
    part with no float64 rate measured (a launch before the rate was logged) is left out, as those launches' own floors
    left it."""
    f64 = f64_gflop if f64_rate == f64_rate and f64_rate > 0 else 0.0
    return (gflop - f64) / f32_rate + (f64 / f64_rate if f64 else 0.0)
