"""Transport-and-merge fusion (Cui et al., arXiv 2602.05495), directional: target <- donor.

1. Probe activations at the shared interfaces (``interfaces.py``), mean-pooled over each probe
   sentence's real tokens; a leading BOS (or other special token) is fed to the model but left out
   of the pooling and of the magnitudes: its activation is the same for every sentence, and Llama
   tokenizers add one where NeoX's do not. Each model reads its own language, the two sides share
   only the sentence index. The mean |activation| over the pooled tokens ranks the target's neurons.
2. Layer alignment: for every (target layer l, donor layer m) the entropic-OT transport cost
   <C, Q> of the MLP's pre-activation and of its post-activation neurons (on a fixed random
   subsample of at most ``layer_subsample`` neurons per side); a layer-level OT on each cost
   matrix; P_eff = the mean of the two layer plans, row-normalised, cut to the ``layer_topk``
   donor layers per target layer and renormalised.
3. Fusion, target layer by target layer (only one layer pair's plans exist at any time): for each
   kept donor layer m, neuron plans Q at every interface and T = sum_m P_eff[l,m] Phi_out W_B Phi_in^T,
   with Phi_out = n_target Q (row-stochastic) on the output side and Phi_in = n_donor Q
   (column-stochastic) on the input side; ``plan_scale=raw`` uses Q on both. The two agree for a
   square plan. The input-side scale is a deliberate deviation from the spec's wording (Phi = n Q on
   both sides): a donor whose hidden neurons are split in two (outgoing weights halved, the same
   function) must come back with its down projection at 1.0x, and row-stochastic Phi_in gives 0.5x
   (the split-neuron test). Only the top-k masked rows of T are computed (M = the top-k target
   neurons of the weight's output interface): W(alpha) = W_A + alpha M * (T - W_A). The originals
   stay in the model's dtype; the donor weight is never copied whole to float64.
4. The random-plan control: one row permutation per (target layer, interface), shared by every
   donor layer, so its T_rand is exactly T with its rows and columns permuted (same norms, same
   marginals); only the learned correspondence is gone. Plans are fitted once; every alpha and the
   control reuse them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mergescope.progress import bar
from mergescope.scoring.batching import batch_token_budget, length_batches, pad_batch, pad_id, tokenize
from mergescope.scoring.batching import leading_special  # the one rule for a leading BOS, shared with pooling
from mergescope.transport import interfaces as itf
from mergescope.transport import ot as tot
from mergescope.transport.settings import TransportSettings


@dataclass
class Probe:
    """One model's activations on the probe set: per interface, per layer."""
    pooled: dict[str, list[torch.Tensor]]   # (n_samples, d) float64, mean over real tokens (a leading special one excluded)
    magnitude: dict[str, list[torch.Tensor]]  # (d,) mean |activation| over the same tokens
    n_layers: int
    n_tokens: int                            # tokens pooled


@torch.inference_mode()
def probe(model, tokenizer, sentences, adapter: itf.Adapter, batch_tokens="auto",
          max_length: int = 512, progress: bool = True, label: str = "probe", skip_leading_special: bool = True,
          pool_dtype: torch.dtype | None = None) -> Probe:
    """Activations at every interface of every layer, batched and length-sorted, via forward hooks.
    ``skip_leading_special=False`` pools every real token, a leading BOS included (the released code's pooling).
    ``pool_dtype``: each sentence's token sum taken in this dtype (``torch.bfloat16``: the released code's probes, a
    model run and pooled in bfloat16); by default in float32 at least (a half-precision sum loses the small neurons)."""
    device = next(model.parameters()).device
    ids, _ = tokenize(tokenizer, sentences, max_length)
    lead = leading_special(ids, tokenizer) if skip_leading_special else np.zeros(len(ids), dtype=bool)
    lengths = np.array([len(s) for s in ids])
    site_map = itf.sites(adapter)
    layer_mods = itf.layers(model, adapter)
    L, n = len(layer_mods), len(sentences)
    pooled: dict[str, list[torch.Tensor | None]] = {k: [None] * L for k in site_map}
    mag: dict[str, list[torch.Tensor | None]] = {k: [None] * L for k in site_map}
    state: dict[str, Any] = {}
    handles = []

    def hook(iface: str, li: int, side: str):
        def fn(module, inputs, output):
            x = inputs[0] if side == "in" else output
            if pool_dtype is not None:
                x = x.to(pool_dtype)
            elif x.dtype not in (torch.float32, torch.float64):
                x = x.float()  # half-precision sums over a sentence would lose the small neurons
            m = state["mask"].to(x.dtype)
            # sums over one sentence's tokens in the activation's dtype, everything after in float64
            s = (x * m).sum(1).to(torch.float64) / state["count"]
            if pooled[iface][li] is None:
                pooled[iface][li] = torch.empty((n, x.shape[-1]), dtype=torch.float64, device=device)
                mag[iface][li] = torch.zeros(x.shape[-1], dtype=torch.float64, device=device)
            pooled[iface][li][state["rows"]] = s
            mag[iface][li] += (x.abs() * m).sum((0, 1)).to(torch.float64)
        return fn

    for li, layer in enumerate(layer_mods):
        for iface, (path, side) in site_map.items():
            handles.append(itf.get_path(layer, path).register_forward_hook(hook(iface, li, side)))
    try:
        with bar() as pb:
            task = pb.add_task(label, total=n, visible=progress)
            for b in length_batches(lengths, batch_token_budget(batch_tokens, device)):
                x, m, p = pad_batch([ids[i] for i in b], pad_id(tokenizer), "right", device)
                pool = m.clone()  # right padding: position 0 is each sentence's first token
                pool[torch.as_tensor(lead[b], device=device), 0] = 0
                state["mask"] = pool.unsqueeze(-1).to(torch.float32)
                state["count"] = pool.sum(1, keepdim=True).to(torch.float64)
                state["rows"] = torch.as_tensor(b, device=device)
                model.base_model(input_ids=x, attention_mask=m, position_ids=p, use_cache=False)
                pb.advance(task, len(b))
    finally:
        for h in handles:
            h.remove()
    total = int(lengths.sum() - lead.sum())
    return Probe({k: list(v) for k, v in pooled.items()}, {k: [t / total for t in v] for k, v in mag.items()}, L, total)


def _cost(tp: Probe, dp: Probe, iface: str, l: int, m: int, idx_t=None, idx_d=None) -> torch.Tensor:
    def cols(p: Probe, name: str, layer: int, idx):
        x = p.pooled[name][layer]
        return x if idx is None else x[:, idx]

    if iface == itf.HIDDEN:
        return sum(tot.pearson_cost(cols(tp, s, l, idx_t), cols(dp, s, m, idx_d)) for s in itf.HIDDEN_SOURCES) / 2
    return tot.pearson_cost(cols(tp, iface, l, idx_t), cols(dp, iface, m, idx_d))


def _subsample(d: int, k: int, gen: torch.Generator) -> torch.Tensor | None:
    return None if d <= k else torch.sort(torch.randperm(d, generator=gen)[:k]).values


@dataclass
class LayerAlignment:
    cost_pre: np.ndarray       # (L_A, L_B) neuron-OT transport cost of the pre-activation interface
    cost_post: np.ndarray
    plan: np.ndarray           # P_eff before pruning: mean of the two layer plans, row-normalised
    kept: np.ndarray           # (L_A, L_B) P_eff after keeping the top-k donor layers, renormalised
    infos: list[tot.PlanInfo] = field(default_factory=list)


def _layer_costs_batched(tp: Probe, dp: Probe, l: int, idx_t, idx_d, s: TransportSettings,
                         costs: dict[str, np.ndarray], budget_bytes: int = 1 << 28, *, solver: str = "home") -> list[tot.PlanInfo]:
    """Target layer l's row of the layer costs, its plans solved in batches (``align_layers``' ``batched``): the
    problems in the per-problem order (donor layer, then source), as many cost matrices at a time as fit
    ``budget_bytes``."""
    probs = [(m, src) for m in range(dp.n_layers) for src in itf.HIDDEN_SOURCES]
    infos: list[tot.PlanInfo] = []
    first = _cost(tp, dp, probs[0][1], l, probs[0][0], idx_t, idx_d)
    per = max(1, int(budget_bytes // (first.numel() * 8)))
    for c0 in range(0, len(probs), per):
        chunk = probs[c0:c0 + per]
        C = torch.stack([first if c0 == 0 and i == 0 else _cost(tp, dp, src, l, m, idx_t, idx_d)
                         for i, (m, src) in enumerate(chunk)]).to(torch.float64)
        plans, iters = (tot.sinkhorn_batched(C, s.epsilon, s.max_iter, s.marginal_tol, budget_bytes) if solver == "home"
                        else tot.sinkhorn_batched_pot(C, s.epsilon, s.max_iter, s.marginal_tol))
        n, k = C.shape[1:]
        a = torch.full((n,), 1.0 / n, dtype=torch.float64, device=C.device)
        b = torch.full((k,), 1.0 / k, dtype=torch.float64, device=C.device)
        for (m, src), Ci, Q, it in zip(chunk, C, plans, iters):
            ok, err = tot.plan_checks(Q, a, b, s.marginal_tol)
            if ok:
                info = tot.PlanInfo("sinkhorn" if solver == "home" else "ot.batch", err, int(it))
            else:  # the same problem through solve's chain (plain Sinkhorn again, then the reduced cost's solvers)
                Q, info = tot.solve(Ci, s.epsilon, s.max_iter, s.marginal_tol, what=f"{src} neuron plan (layer cost {l},{m})")
            costs[src][l, m] = float((Q * Ci).sum())
            infos.append(info)
    return infos


def align_layers(tp: Probe, dp: Probe, settings: TransportSettings, progress: bool = True,
                 batched: bool | None = None, batched_solver: str = "home") -> LayerAlignment:
    """P_eff from the neuron-OT transport costs of every (target layer, donor layer) pair (``epsilon``,
    ``layer_subsample``), the layer-level plans (``layer_epsilon``) and the ``layer_topk`` cut.

    ``batched`` (default: when the probes are on a GPU) solves each target layer's 2 x L_donor neuron plans together
    (``ot.sinkhorn_batched``: POT's plain Sinkhorn step for step, in batched products on the device); a plan that
    fails the checks is solved again alone by ``ot.solve``'s chain. On this project's 2-core CPU the batched products
    were slower than POT's per-problem numpy (0.33 s against 0.15 s for 8 plans of 256 x 256), so the CPU default is
    per problem; both give the same iterations and plans (``tests/test_transport.py``). ``batched_solver="pot"`` takes
    POT's maintained batched solver instead (``ot.sinkhorn_batched_pot``); it is not the default: at the working
    tolerance its plans are another iterate (2.7e-7 apart, the whole batch stopping together), and at tolerances where
    the two agree to 1e-10 the home-made solver measured faster (``benchmarks/bench_batch_sinkhorn.py``)."""
    s = settings
    epsilon, max_iter, tol = s.epsilon, s.max_iter, s.marginal_tol
    gen = torch.Generator().manual_seed(s.control_seed)
    d_t, d_d = tp.pooled["mlp_pre"][0].shape[1], dp.pooled["mlp_pre"][0].shape[1]
    idx_t, idx_d = _subsample(d_t, s.layer_subsample, gen), _subsample(d_d, s.layer_subsample, gen)
    if batched is None:
        batched = tp.pooled["mlp_pre"][0].device.type == "cuda"
    costs = {src: np.zeros((tp.n_layers, dp.n_layers)) for src in itf.HIDDEN_SOURCES}
    infos = []
    with bar() as pb:
        task = pb.add_task("layer costs", total=tp.n_layers * dp.n_layers, visible=progress)
        for l in range(tp.n_layers):
            if batched:
                infos += _layer_costs_batched(tp, dp, l, idx_t, idx_d, s, costs, solver=batched_solver)
                pb.advance(task, dp.n_layers)
                continue
            for m in range(dp.n_layers):
                for src in itf.HIDDEN_SOURCES:
                    C = _cost(tp, dp, src, l, m, idx_t, idx_d)
                    Q, info = tot.solve(C, epsilon, max_iter, tol, what=f"{src} neuron plan (layer cost {l},{m})")
                    costs[src][l, m] = float((Q * C).sum())
                    infos.append(info)
                pb.advance(task)
    plans = []
    for src in itf.HIDDEN_SOURCES:
        P, info = tot.solve(torch.from_numpy(costs[src]), s.layer_epsilon, max_iter, tol, what=f"{src} layer plan")
        plans.append(P.cpu().numpy())
        infos.append(info)
    P = (plans[0] + plans[1]) / 2
    P = P / P.sum(1, keepdims=True)
    k = max(1, min(s.layer_topk, dp.n_layers))
    kept = np.zeros_like(P)
    top = np.argsort(-P, axis=1, kind="stable")[:, :k]
    rows = np.arange(P.shape[0])[:, None]
    kept[rows, top] = P[rows, top]
    kept = kept / kept.sum(1, keepdims=True)
    return LayerAlignment(costs["mlp_pre"], costs["mlp_post"], P, kept, infos)


@dataclass
class Fusion:
    """Per fused parameter: the original (model dtype), its masked output rows (or input columns, for the names in
    ``by_column``), and T and T_rand there. Every method reads a column-masked tensor through its transpose, so
    ``rows``, ``transported`` and ``control`` always index its masked slices as rows."""
    original: dict[str, torch.Tensor]
    rows: dict[str, torch.Tensor]          # sorted indices of the masked output rows (input columns for by_column)
    transported: dict[str, torch.Tensor]   # (k, ...) float64: T at ``rows`` (T^T at the columns for by_column)
    control: dict[str, torch.Tensor]       # (k, ...) float64: T_rand at ``rows``
    masks: dict[str, torch.Tensor]         # bool over the masked axis (True at ``rows``)
    control_perms: dict[tuple[int, str], torch.Tensor]  # (target layer, interface) -> the control's row permutation
    diagnostics: dict[str, float] = field(default_factory=dict)
    infos: list[tot.PlanInfo] = field(default_factory=list)
    by_column: set[str] = field(default_factory=set)  # masked by input column (the released code's o_proj)
    extra_controls: list[dict[str, torch.Tensor]] = field(default_factory=list)  # T_rand of control seeds 2.. (merge.control_seeds)

    @property
    def n_controls(self) -> int:
        """How many random-plan controls (seeds) were built: ``control`` and ``extra_controls``."""
        return 1 + len(self.extra_controls)

    def control_of(self, seed: int) -> dict[str, torch.Tensor]:
        """T_rand of control seed ``seed`` (0 = ``control``, the one every earlier run has)."""
        return self.control if seed == 0 else self.extra_controls[seed - 1]

    def _o(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """The tensor with its masked axis first (a view)."""
        return w.T if name in self.by_column else w

    def fused_rows(self, name: str, alpha: float, control: bool = False, shrink: bool = False, seed: int = 0) -> torch.Tensor:
        """The masked rows of the fused tensor, in the model's dtype: W + alpha (T - W) (``control``: T_rand of control
        seed ``seed``). ``shrink``: the shrink-only control, the same fusion with the transported term set to zero,
        W + alpha (0 - W)."""
        w = self._o(name, self.original[name])[self.rows[name]].to(torch.float64)
        t = torch.zeros_like(w) if shrink else (self.control_of(seed) if control else self.transported)[name].to(w.device)
        return (w + alpha * (t - w)).to(self.original[name].dtype)

    def weights(self, alpha: float, control: bool = False, shrink: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
        out = {}
        for name, w in self.original.items():
            new = w.clone()
            self._o(name, new)[self.rows[name]] = self.fused_rows(name, alpha, control, shrink, seed)
            out[name] = new
        return out

    def weight_stats(self, alpha: float, control: bool = False,
                     shrink: bool = False) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """Cosine and relative L2 of each fused tensor (as the model holds it) against the target's original,
        per tensor and over all fused tensors as one vector (``fused_weight_cosine``, ``fused_relative_l2``)."""
        per, tot_w = {}, np.zeros(4)  # sums of |W|^2, |W_fused|^2, <W_fused, W>, |W_fused - W|^2
        for name, w in self.original.items():
            # |W|^2 in float64, a few million entries at a time (no float64 copy of the whole tensor)
            w2 = sum(float(torch.linalg.vector_norm(c, dtype=torch.float64)) ** 2
                     for c in torch.split(w, max(1, (1 << 22) // max(1, w[0].numel()))))
            wr = self._o(name, w)[self.rows[name]].to(torch.float64)
            d = self.fused_rows(name, alpha, control, shrink).to(torch.float64) - wr
            new2 = w2 + float((d * (2 * wr + d)).sum())
            sums = np.array([w2, new2, w2 + float((d * wr).sum()), float((d * d).sum())])
            tot_w += sums
            per[name] = _cos_rel(sums)
        agg = _cos_rel(tot_w)
        return {"fused_weight_cosine": agg["cosine"], "fused_relative_l2": agg["relative_l2"]}, per

    def transported_stats(self) -> dict[str, float]:
        """The transported term against the target weight on the masked entries, over all fused tensors as one
        vector: ``transported_relative_norm`` = |M*T| / |M*W| (the spec document's claim: about 0 with raw plans),
        its largest value over the tensors (``_max``), and the cosine of M*T with M*W (``transported_cosine``); the same
        norm over the weight matrices alone (``_weights``) and the bias vectors alone (``_biases``): on a Qwen2 pair a
        "0.1% term" can be almost all q/k/v bias."""
        sums = {"": [0.0, 0.0, 0.0], "_weights": [0.0, 0.0, 0.0], "_biases": [0.0, 0.0, 0.0]}
        worst = 0.0
        for name, w in self.original.items():
            wr = self._o(name, w)[self.rows[name]].to(torch.float64)
            t = self.transported[name].to(wr.device)
            a, b, c = float((t * t).sum()), float((wr * wr).sum()), float((t * wr).sum())
            for part in ("", "_biases" if w.ndim == 1 else "_weights"):
                sums[part] = [sums[part][0] + a, sums[part][1] + b, sums[part][2] + c]
            if b > 0:
                worst = max(worst, (a / b) ** 0.5)
        t2, w2, dot = sums[""]
        out = {"transported_relative_norm": (t2 / w2) ** 0.5 if w2 > 0 else float("nan"),
               "transported_relative_norm_max": worst,
               "transported_cosine": dot / (t2 * w2) ** 0.5 if t2 > 0 and w2 > 0 else float("nan")}
        for part in ("_weights", "_biases"):
            a, b, _ = sums[part]
            out[f"transported_relative_norm{part}"] = (a / b) ** 0.5 if b > 0 else float("nan")
        return out


def _cos_rel(s: np.ndarray) -> dict[str, float]:
    w2, new2, dot, d2 = (float(x) for x in s)
    ok = w2 > 0 and new2 > 0
    return {"cosine": dot / float(np.sqrt(w2 * new2)) if ok else float("nan"),
            "relative_l2": float(np.sqrt(d2 / w2)) if w2 > 0 else float("nan")}


def _top_k_rows(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` most active target neurons (by mean |activation|), sorted."""
    return torch.sort(torch.topk(magnitude, min(int(k), magnitude.shape[0])).indices).values


def _left(rows: torch.Tensor, wb: torch.Tensor, chunk_elems: int = 1 << 22) -> torch.Tensor:
    """``rows @ wb`` in float64 without a float64 copy of the whole donor weight (row chunks of it)."""
    if wb.ndim == 1:
        return rows @ wb.to(rows.device, torch.float64)
    step = max(1, chunk_elems // max(1, wb.shape[1]))
    out = torch.zeros((rows.shape[0], wb.shape[1]), dtype=torch.float64, device=rows.device)
    for c in range(0, wb.shape[0], step):
        out += rows[:, c:c + step] @ wb[c:c + step].to(rows.device, torch.float64)
    return out


@dataclass
class _PairPlan:
    """One (target layer, donor layer) plan at one interface, in the forms the weights need."""
    rows: torch.Tensor | None       # Phi_out = n_target Q at the target's masked rows (output side)
    rows_rand: list[torch.Tensor] | None  # each control seed's: the rows perm[rows] of Phi_out
    phi_in: torch.Tensor | None     # Phi_in = n_donor Q, all rows (input side)


@dataclass
class _Ctx:
    tp: Probe
    dp: Probe
    s: TransportSettings
    align: LayerAlignment
    donor_sd: Mapping[str, torch.Tensor]  # a dict, or the donor's weights streamed from its files (native.stream)
    d_prefix: str
    d_role: dict[str, str]
    device: torch.device
    gen: torch.Generator
    diag: dict[str, list[float]] = field(default_factory=dict)
    extra_gens: list[torch.Generator] = field(default_factory=list)  # control seeds 2..: control_seed + 1, + 2, ...


def _pair_plan(c: _Ctx, f: Fusion, iface: str, l: int, m: int, rows: torch.Tensor | None, perms: list[torch.Tensor],
               as_input: bool) -> _PairPlan:
    """The plan of one interface between target layer l and donor layer m, with each control seed's shuffled rows
    (``perms``: one permutation per seed, the first the one every earlier run has)."""
    perm = perms[0]
    C = _cost(c.tp, c.dp, iface, l, m).to(c.device)
    Q, info = tot.solve(C, c.s.epsilon, c.s.max_iter, c.s.marginal_tol, what=f"{iface} neuron plan (layer {l} <- {m})")
    f.infos.append(info)
    for k, v in tot.plan_diagnostics(Q, C, epsilon=c.s.epsilon, seed=c.s.control_seed).items():
        c.diag.setdefault(f"{k}_{iface}", []).append(v)
    if l == m and Q.shape[0] == Q.shape[1]:  # same depth, same width: how near the plan is to the identity
        for k, v in diagonal_shares(Q, perm).items():
            c.diag.setdefault(f"{k}_{iface}", []).append(v)
    del C
    scaled = c.s.plan_scale == "row_stochastic"
    out = out_r = phi_in = None
    if rows is not None:
        out, out_r = Q[rows], [Q[p[rows]] for p in perms]
        if scaled:
            out, out_r = tot.row_stochastic(out), [tot.row_stochastic(x) for x in out_r]
    if as_input:
        phi_in = tot.column_stochastic(Q) if scaled else Q
    return _PairPlan(out, out_r, phi_in)


def diagonal_shares(Q: torch.Tensor, perm: torch.Tensor) -> dict[str, float]:
    """A square plan between the same layer of two models of one architecture (two fine-tunes of one base): the share
    of its rows whose maximum is on the diagonal (``diagonal_share``: 1 = the identity matching, 1/n = chance), and the
    same for the random-plan control's rows (row r of the control is row perm[r] of the plan: ``control_diagonal_share``)."""
    idx = torch.arange(Q.shape[0], device=Q.device)
    top = Q.argmax(1)
    return {"diagonal_share": float((top == idx).double().mean()),
            "control_diagonal_share": float((top[perm.to(Q.device)] == idx).double().mean()),
            "chance_diagonal_share": 1.0 / Q.shape[0]}


def rms(w: torch.Tensor) -> float:
    """Root mean square of a tensor's entries, in float64 a few million entries at a time."""
    flat = w.reshape(-1)
    total = sum(float(torch.linalg.vector_norm(c, dtype=torch.float64)) ** 2 for c in torch.split(flat, 1 << 22))
    return (total / max(1, flat.numel())) ** 0.5


def scale_ratio(w_target: torch.Tensor, w_donor: torch.Tensor) -> float:
    """``merge.scale_match=rms``: the factor that brings the donor weight's entries to the target weight's scale,
    rms(W_target) / rms(W_donor) (1 where either is all zero). The correlation cost ignores scale, so without it the
    transported term carries the donor's scale (0.08-0.11x the target's on SmolLM2 <- Qwen2.5-0.5B)."""
    a, b = rms(w_target), rms(w_donor)
    return a / b if a > 0 and b > 0 else 1.0


def _width(p: Probe, iface: str, layer: int) -> int:
    return p.pooled["mlp_pre" if iface == itf.HIDDEN else iface][layer].shape[1]


def _fuse_layer(c: _Ctx, f: Fusion, l: int, t_sd: dict[str, torch.Tensor], t_adapter: itf.Adapter) -> None:
    """Target layer l: its masks, the control's permutations, and T / T_rand at the masked rows."""
    donors = [int(m) for m in np.nonzero(c.align.kept[l])[0]]
    names = []  # (target param, donor param in layer, out iface, in iface)
    for name, role, o, i in itf.transported_weights(t_adapter):
        full, dn = f"{t_adapter.layers_attr}.{l}.{name}", c.d_role.get(role)
        # fused only when the donor has this role in every kept layer (it always does, or never)
        if full in t_sd and dn is not None and f"{c.d_prefix}.{donors[0]}.{dn}" in c.donor_sd:
            names.append((full, dn, o, i))
    outs, ins = {o for _, _, o, _ in names}, {i for _, _, _, i in names if i is not None}
    rows = {o: _top_k_rows(c.tp.magnitude["mlp_post" if o == itf.HIDDEN else o][l], c.s.top_k) for o in outs}
    perms = {k: torch.randperm(_width(c.tp, k, l), generator=c.gen).to(c.device) for k in sorted(outs | ins)}
    seeds = [perms, *({k: torch.randperm(_width(c.tp, k, l), generator=g).to(c.device) for k in sorted(outs | ins)}
                      for g in c.extra_gens)]
    f.control_perms.update({(l, k): v for k, v in perms.items()})
    for full, _, o, _ in names:
        w = t_sd[full].detach()
        f.original[full], f.rows[full] = w.clone(), rows[o].to(w.device)
        f.masks[full] = torch.zeros(w.shape[0], dtype=torch.bool, device=w.device)
        f.masks[full][f.rows[full]] = True
        f.transported[full] = torch.zeros((len(rows[o]), *w.shape[1:]), dtype=torch.float64, device=c.device)
        f.control[full] = torch.zeros_like(f.transported[full])
        for extra in f.extra_controls:
            extra[full] = torch.zeros_like(f.transported[full])
    for m in donors:
        weight = float(c.align.kept[l, m])
        plans = {k: _pair_plan(c, f, k, l, m, rows.get(k), [p[k] for p in seeds], k in ins) for k in sorted(outs | ins)}
        for full, dn, o, i in names:
            po = plans[o]
            wd = c.donor_sd[f"{c.d_prefix}.{m}.{dn}"]
            ratio = scale_ratio(t_sd[full], wd) if c.s.scale_match == "rms" else 1.0
            if c.s.scale_match == "rms":
                c.diag.setdefault("scale_match_ratio", []).append(ratio)
            left = _left(torch.cat([po.rows, *po.rows_rand]), wd.to(c.device))
            n_rows = po.rows.shape[0]
            ot_part = left[:n_rows]
            if i is not None:
                ot_part = ot_part @ plans[i].phi_in.T
            f.transported[full] += weight * ratio * ot_part
            for s, dest in enumerate([f.control, *f.extra_controls]):  # each control seed's T_rand
                rand_part = left[n_rows * (s + 1): n_rows * (s + 2)]
                if i is not None:
                    rand_part = (rand_part @ plans[i].phi_in.T)[:, seeds[s][i]]
                dest[full] += weight * ratio * rand_part
        plans = po = left = ot_part = rand_part = None  # only one layer pair's plans are ever alive


def control_generators(settings: TransportSettings) -> list[torch.Generator]:
    """The generators of control seeds 2 .. ``merge.control_seeds``: seeded ``control_seed + 1``, ``+ 2``, ... (the first
    seed's draws, from ``control_seed``, are those of every earlier run)."""
    return [torch.Generator().manual_seed(settings.control_seed + i) for i in range(1, settings.control_seeds)]


def fuse(target, donor_sd: Mapping[str, torch.Tensor], tp: Probe, dp: Probe, t_adapter: itf.Adapter, d_adapter: itf.Adapter,
         align: LayerAlignment, settings: TransportSettings, progress: bool = True) -> Fusion:
    """Fit the neuron plans layer by layer and build T (OT) and T_rand (shuffled-plan control) at the masked rows.

    From ``settings``: ``epsilon``, ``max_iter``, ``marginal_tol`` (the plans), ``top_k`` (the masks),
    ``plan_scale`` and ``control_seed`` (the control's permutations)."""
    c = _Ctx(tp, dp, settings, align, donor_sd, d_adapter.layers_attr,
             {role: name for name, role, _, _ in itf.transported_weights(d_adapter)},
             next(target.parameters()).device, torch.Generator().manual_seed(settings.control_seed),
             extra_gens=control_generators(settings))
    f = Fusion({}, {}, {}, {}, {}, {}, extra_controls=[{} for _ in range(settings.control_seeds - 1)])
    t_sd = target.state_dict()
    with bar() as pb:
        task = pb.add_task("fusion plans", total=tp.n_layers, visible=progress)
        for l in range(tp.n_layers):
            _fuse_layer(c, f, l, t_sd, t_adapter)
            pb.advance(task)
    f.diagnostics = {k: float(np.mean(v)) for k, v in c.diag.items()}
    for base in ("row_max", "row_entropy", "cost_ratio", "uniform_row_max", "uniform_entropy", "rowmax_over_uniform", "entropy_gap",
                 "cost_mean", "cost_sd",
                 "diagonal_share", "control_diagonal_share", "chance_diagonal_share"):
        vals = [v for k, vs in c.diag.items() if k.startswith(base + "_") for v in vs]
        if vals:
            f.diagnostics[base] = float(np.mean(vals))
    return f
