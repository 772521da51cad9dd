"""Transport-and-merge fusion (Cui et al., arXiv 2602.05495), directional: target <- donor.

1. Probe activations at the shared interfaces (``interfaces.py``), mean-pooled over each probe
   sentence's real tokens; each model reads its own language, the two sides share only the
   sentence index. The mean |activation| over all real tokens ranks the target's neurons.
2. Layer alignment: for every (target layer l, donor layer m) the entropic-OT transport cost
   <C, Q> of the MLP's pre-activation and of its post-activation neurons (on a fixed random
   subsample of at most ``layer_subsample`` neurons per side); a layer-level OT on each cost
   matrix; P_eff = the mean of the two layer plans, row-normalised, cut to the ``layer_topk``
   donor layers per target layer and renormalised.
3. Fusion, target layer by target layer (only that layer's plans exist at any time): for each
   kept donor layer m, neuron plans Q at every interface, Phi = n Q (row-stochastic; or the raw
   Q), and T = sum_m P_eff[l,m] Phi_out W_B Phi_in^T. The random-plan control builds T_rand the
   same way through plans whose rows are shuffled (seeded). Plans are fitted once; every alpha
   and the control reuse them: W(alpha) = W_A + alpha M * (T - W_A), M = the top-k target
   neurons of the weight's output interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mergescope.progress import bar
from mergescope.represent import batch_token_budget, length_batches, pad_batch, pad_id, tokenize
from mergescope.transport import interfaces as itf
from mergescope.transport import ot as tot
from mergescope.transport.settings import TransportSettings


@dataclass
class Probe:
    """One model's activations on the probe set: per interface, per layer."""
    pooled: dict[str, list[torch.Tensor]]   # (n_samples, d) float64, mean over real tokens
    magnitude: dict[str, list[torch.Tensor]]  # (d,) mean |activation| over all real tokens
    n_layers: int
    n_tokens: int


@torch.inference_mode()
def probe(model, tokenizer, sentences, adapter: itf.Adapter, qkv: bool = False, batch_tokens="auto",
          max_length: int = 512, progress: bool = True, label: str = "probe") -> Probe:
    """Activations at every interface of every layer, batched and length-sorted, via forward hooks."""
    device = next(model.parameters()).device
    ids, _ = tokenize(tokenizer, sentences, max_length)
    lengths = np.array([len(s) for s in ids])
    site_map = itf.sites(adapter, qkv)
    layer_mods = itf.layers(model, adapter)
    L, n = len(layer_mods), len(sentences)
    pooled: dict[str, list[torch.Tensor | None]] = {k: [None] * L for k in site_map}
    mag: dict[str, list[torch.Tensor | None]] = {k: [None] * L for k in site_map}
    state: dict[str, Any] = {}
    handles = []

    def hook(iface: str, li: int, side: str):
        def fn(module, inputs, output):
            x = inputs[0] if side == "in" else output
            if x.dtype not in (torch.float32, torch.float64):
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
                state["mask"] = m.unsqueeze(-1).to(torch.float32)
                state["count"] = m.sum(1, keepdim=True).to(torch.float64)
                state["rows"] = torch.as_tensor(b, device=device)
                model.base_model(input_ids=x, attention_mask=m, position_ids=p, use_cache=False)
                pb.advance(task, len(b))
    finally:
        for h in handles:
            h.remove()
    total = int(lengths.sum())
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


def align_layers(tp: Probe, dp: Probe, settings: TransportSettings, progress: bool = True) -> LayerAlignment:
    """P_eff from the neuron-OT transport costs of every (target layer, donor layer) pair (``epsilon``,
    ``layer_subsample``), the layer-level plans (``layer_epsilon``) and the ``layer_topk`` cut."""
    s = settings
    epsilon, max_iter, tol = s.epsilon, s.max_iter, s.marginal_tol
    gen = torch.Generator().manual_seed(s.control_seed)
    d_t, d_d = tp.pooled["mlp_pre"][0].shape[1], dp.pooled["mlp_pre"][0].shape[1]
    idx_t, idx_d = _subsample(d_t, s.layer_subsample, gen), _subsample(d_d, s.layer_subsample, gen)
    costs = {src: np.zeros((tp.n_layers, dp.n_layers)) for src in itf.HIDDEN_SOURCES}
    infos = []
    with bar() as pb:
        task = pb.add_task("layer costs", total=tp.n_layers * dp.n_layers, visible=progress)
        for l in range(tp.n_layers):
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
    """Transported tensors (OT and random-plan control), masks and originals for the fused parameters."""
    original: dict[str, torch.Tensor]
    transported: dict[str, torch.Tensor]
    control: dict[str, torch.Tensor]
    masks: dict[str, torch.Tensor]        # per parameter: bool over its output rows
    diagnostics: dict[str, float]
    infos: list[tot.PlanInfo]

    def weights(self, alpha: float, control: bool = False) -> dict[str, torch.Tensor]:
        src = self.control if control else self.transported
        out = {}
        for name, w in self.original.items():
            m = self.masks[name].view(-1, *([1] * (w.ndim - 1))).to(w.dtype)
            out[name] = w + alpha * m * (src[name] - w)
        return out


def _top_k_mask(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    mask = torch.zeros(magnitude.shape[0], dtype=torch.bool, device=magnitude.device)
    mask[torch.topk(magnitude, min(int(k), magnitude.shape[0])).indices] = True
    return mask


def fuse(target, donor_sd: dict[str, torch.Tensor], tp: Probe, dp: Probe, t_adapter: itf.Adapter, d_adapter: itf.Adapter,
         align: LayerAlignment, settings: TransportSettings, progress: bool = True) -> Fusion:
    """Fit the neuron plans layer by layer and build T (OT) and T_rand (shuffled-plan control).

    From ``settings``: ``epsilon``, ``max_iter``, ``marginal_tol`` (the plans), ``top_k`` (the masks),
    ``plan_scale``, ``qkv`` and ``control_seed`` (the control's row shuffles)."""
    epsilon, top_k, qkv, max_iter, tol = settings.epsilon, settings.top_k, settings.qkv, settings.max_iter, settings.marginal_tol
    device = next(target.parameters()).device
    scale = tot.row_stochastic if settings.plan_scale == "row_stochastic" else (lambda q: q)
    gen = torch.Generator().manual_seed(settings.control_seed)
    t_prefix, d_prefix = t_adapter.layers_attr, d_adapter.layers_attr
    t_sd = target.state_dict()
    d_role = {role: name for name, role, _, _ in itf.transported_weights(d_adapter, qkv)}
    original, T, T_rand, masks = {}, {}, {}, {}
    diag: dict[str, list[float]] = {}
    infos: list[tot.PlanInfo] = []
    with bar() as pb:
        task = pb.add_task("fusion plans", total=tp.n_layers, visible=progress)
        for l in range(tp.n_layers):
            donors = np.nonzero(align.kept[l])[0]
            names = []  # (target param, donor param in layer, out iface, in iface)
            for name, role, o, i in itf.transported_weights(t_adapter, qkv):
                full = f"{t_prefix}.{l}.{name}"
                dn = d_role.get(role)
                # fused only when the donor has this role in every kept layer (it always does, or never)
                if full not in t_sd or dn is None or f"{d_prefix}.{int(donors[0])}.{dn}" not in donor_sd:
                    continue
                names.append((full, dn, o, i))
                original[full] = t_sd[full].detach().to(torch.float64).clone()
                T[full] = torch.zeros_like(original[full])
                T_rand[full] = torch.zeros_like(original[full])
                masks[full] = _top_k_mask(tp.magnitude["mlp_post" if o == itf.HIDDEN else o][l], top_k)
            needed = sorted({o for _, _, o, _ in names} | {i for _, _, _, i in names if i is not None})
            for m in donors:
                w_lm = float(align.kept[l, m])
                plans, rplans = {}, {}
                for iface in needed:
                    C = _cost(tp, dp, iface, l, int(m)).to(device)
                    Q, info = tot.solve(C, epsilon, max_iter, tol, what=f"{iface} neuron plan (layer {l} <- {m})")
                    infos.append(info)
                    for k, v in tot.plan_diagnostics(Q, C).items():
                        diag.setdefault(f"{k}_{iface}", []).append(v)
                    plans[iface] = scale(Q)
                    rplans[iface] = scale(tot.shuffle_rows(Q, gen))
                for full, dn, o, i in names:
                    wb = donor_sd[f"{d_prefix}.{int(m)}.{dn}"].to(device, torch.float64)
                    for plan_set, out in ((plans, T), (rplans, T_rand)):
                        t = plan_set[o] @ wb if i is None else plan_set[o] @ wb @ plan_set[i].T
                        out[full] += w_lm * t
                plans = rplans = plan_set = t = None  # only one layer pair's plans are ever alive
            pb.advance(task)
    summary = {}
    for k, vals in diag.items():
        summary[k] = float(np.mean(vals))
    for base in ("row_max", "row_entropy", "cost_ratio", "uniform_row_max"):
        vals = [v for k, vs in diag.items() if k.startswith(base + "_") for v in vs]
        if vals:
            summary[base] = float(np.mean(vals))
    return Fusion(original, T, T_rand, masks, summary, infos)
