"""merge=transport_released: Transport-and-Merge as its authors released it, rebuilt from its definitions.

The released code (chenhangcuisg-code/Cross-Architecture-Merging-for-Large-Language-Models: ``run_activs_and_hot.py``,
``core/hot_transport_chunk.py``, ``core/generate_hot_residual.py``) was read, not copied; what it does, step by step:

1. **Samples.** Every probe sentence is mean-pooled over its real tokens (a leading BOS included: a masked mean over the
   attention mask), at the input and the output of every q/k/v/o projection. The cost works on these pooled sentences,
   not on tokens.
2. **Neuron plans**, per module and side (its input: ``pre``; its output: ``post``) and per layer pair: the cost is the
   correlation distance 1 - Pearson (a constant neuron: cost 1 to everything); the plan is log-domain Sinkhorn with
   uniform marginals at ``reg_inner`` 0.1, at most 200 iterations, stopping when the row marginals' L1 error is below
   1e-6 or changes by less than 1e-7 (checked every 10th iteration and at the last), then stored in bfloat16 and divided
   by its (bfloat16) sum. :func:`released_sinkhorn`.
3. **Layer pairs are zipped**: target layer i is paired with donor layers 0..n-1 only, n = the smaller depth, so the
   deeper model is cut to the other's depth (a 30-layer target keeps its layers 24-29 out of the plan: they are only
   shrunk; a deeper donor's layers past n are never read).
4. **Layer plans**: the layer cost C[l, m] = <C_lm, Q_lm> per module and side; shifted by its minimum, divided by its
   (lower) median, log-domain Sinkhorn at ``reg_outer`` 0.1 (at most 1000 iterations, stopping when the row potential
   changes by less than 1e-7: the plan is then the previous iterate's), normalised to mass 1 and row/column-rebalanced
   three times. :func:`released_layer_plan`.
5. **P_eff** = sqrt(P_post) * sqrt(P_pre) per module, times L_eff = the number of paired target layers.
   ``sparsify_P_topk`` (``--p_topk 3``) is defined and accepted but never called; so is ``sparsify_Q_topr``.
6. **Plans are never rescaled**: ``run_activs_and_hot.py`` computes sigma_A / sigma_B and its notes say the plans are
   mapped to raw activation space, but it keeps ``q_raw = q``; the fusion multiplies the plans as solved (total mass 1),
   so the transported term is ~1/(n_out n_in) of the donor weight: the fusion is a shrinkage of the masked entries.
7. **Fusion** of q/k/v/o only (the MLP's activations are collected, never transported), on the target's 128 most active
   neurons per module and layer (mean over sentences of |pooled output|): rows of q/k/v, and *columns* of o_proj chosen
   by o_proj's *output* magnitudes. T = sum_m L_eff P_eff[l, m] Q_out W_B[m] Q_in^T (biases: Q_out b_B; a target bias
   without a donor bias is pulled to zero on the masked rows). W = (1 - alpha) W + alpha T on the mask, every other
   entry unchanged.
8. **Alpha**: the command line always selects residual mode (``--use_hot_residual`` defaults to True and takes a string),
   where the fusion-time ``--alpha`` is stored and never read: the fused model is (1 - alpha) W + alpha W_res at the
   *training* alpha of ``train_hot_residual_sft.py``. Here alpha is that alpha, W + alpha M (T - W): the same formula.

``merge.follow=paper`` takes what the paper and the code's own notes describe where the code differs: every layer pair
(L_A x L_B), P_eff cut to each target layer's top 3 donor layers with the row mass kept, each plan's top 128 entries per
row then per column kept, plans mapped by sigma_target / sigma_donor, float64 plans, q/k/v/o *and* the MLP fused, o_proj /
down_proj columns chosen by their own input magnitudes. Each difference is its own ``merge.released.*`` switch, and the
seed's deviations are switches too (``plan_scale``, ``epsilon``, ``sublayers=mlp_attn_out``, ``layer_pairs=pruned``,
``scale_match``): see docs/transport.md.

The random-plan control permutes every plan's target side (one permutation per target layer and activation view,
shared by every donor layer and every module reading that view): T_rand = Pi_out T Pi_in^T, the same norm. The
shrink-only control (transported term zero) is :meth:`Fusion.weights` with ``shrink=True``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from mergescope.errors import MergescopeError
from mergescope.progress import bar
from mergescope.transport import fusion as fus
from mergescope.transport import interfaces as itf
from mergescope.transport import ot as tot
from mergescope.transport.settings import TransportSettings

SUBLAYER_ROLES = {"qkvo": ("q", "k", "v", "o"), "qkvo_mlp": ("q", "k", "v", "o", "gate", "up", "down"),
                  "mlp_attn_out": ("gate", "up", "down", "o")}


# ----------------------------------------------------------------------------- where the modules are


@dataclass(frozen=True)
class Module:
    """One fused linear map: its weight (and bias) in the layer, the parameter rows it owns (NeoX's q, k and v are row
    blocks of query_key_value; None = all), the activation views at its input and output, and its mask's axis."""
    role: str                      # q | k | v | o | gate (the projection that feeds the nonlinearity) | up | down
    weight: str
    bias: str | None
    rows: tuple[int, ...] | None
    pre: str
    post: str
    by_column: bool                # o and down: masked by input column, as the released code masks o_proj


@dataclass(frozen=True)
class Layout:
    family: str
    layers_attr: str
    sites: dict[str, tuple[str, str]]                   # site -> (module path in the layer, "in" | "out")
    views: dict[str, tuple[str, tuple[int, ...] | None]]  # view -> (site, its columns; None = all)
    modules: dict[str, Module]                           # role -> module

    def adapter(self, roles) -> itf.Adapter:
        """An adapter that probes only the sites the given roles read."""
        need = {self.views[v][0] for r in roles if r in self.modules for v in (self.modules[r].pre, self.modules[r].post)}
        return itf.Adapter(self.family, self.layers_attr, {k: v for k, v in self.sites.items() if k in need}, ())


def _has(obj, path: str) -> bool:
    try:
        itf.get_path(obj, path)
        return True
    except AttributeError:
        return False


def layout(model, model_type: str) -> Layout:
    """The q/k/v/o and MLP projections of a decoder layer: by module name (q_proj ... / NeoX's query_key_value, whose
    output is per head [q | k | v], head_size each)."""
    ad = itf.adapter_for(model_type)
    layer = itf.layers(model, ad)[0]

    def bias(path: str) -> str | None:
        return f"{path}.bias" if getattr(itf.get_path(layer, path), "bias", None) is not None else None

    def lin(role, path, rows, pre, post, by_column=False):
        return Module(role, f"{path}.weight", bias(path), rows, pre, post, by_column)

    if _has(layer, "self_attn.q_proj"):
        sa, mlp = "self_attn", "mlp"
        sites = {"attn_in": (f"{sa}.q_proj", "in"), "q_out": (f"{sa}.q_proj", "out"), "k_out": (f"{sa}.k_proj", "out"),
                 "v_out": (f"{sa}.v_proj", "out"), "o_in": (f"{sa}.o_proj", "in"), "o_out": (f"{sa}.o_proj", "out"),
                 "down_in": (f"{mlp}.down_proj", "in"), "down_out": (f"{mlp}.down_proj", "out")}
        mods = [lin("q", f"{sa}.q_proj", None, "attn_in", "q_out"), lin("k", f"{sa}.k_proj", None, "attn_in", "k_out"),
                lin("v", f"{sa}.v_proj", None, "attn_in", "v_out"), lin("o", f"{sa}.o_proj", None, "o_in", "o_out", True),
                lin("down", f"{mlp}.down_proj", None, "down_in", "down_out", True)]
        first = f"{mlp}.gate_proj" if _has(layer, f"{mlp}.gate_proj") else f"{mlp}.up_proj"
        sites["mlp_in"] = (first, "in")
        for role in ("gate", "up"):
            if _has(layer, f"{mlp}.{role}_proj"):
                sites[f"{role}_out"] = (f"{mlp}.{role}_proj", "out")
                mods.append(lin(role, f"{mlp}.{role}_proj", None, "mlp_in", f"{role}_out"))
        views = {k: (k, None) for k in sites}
    elif _has(layer, "attention.query_key_value"):
        cfg = model.config
        heads, hs = int(cfg.num_attention_heads), int(cfg.hidden_size) // int(cfg.num_attention_heads)
        block = {r: tuple(h * 3 * hs + o * hs + j for h in range(heads) for j in range(hs)) for o, r in enumerate("qkv")}
        qkv = "attention.query_key_value"
        sites = {"attn_in": (qkv, "in"), "qkv_out": (qkv, "out"), "o_in": ("attention.dense", "in"),
                 "o_out": ("attention.dense", "out"), "mlp_in": ("mlp.dense_h_to_4h", "in"),
                 "gate_out": ("mlp.dense_h_to_4h", "out"), "down_in": ("mlp.dense_4h_to_h", "in"),
                 "down_out": ("mlp.dense_4h_to_h", "out")}
        views = {k: (k, None) for k in sites if k != "qkv_out"}
        views.update({f"{r}_out": ("qkv_out", block[r]) for r in "qkv"})
        mods = [lin(r, qkv, block[r], "attn_in", f"{r}_out") for r in "qkv"]
        mods += [lin("o", "attention.dense", None, "o_in", "o_out", True), lin("gate", "mlp.dense_h_to_4h", None, "mlp_in", "gate_out"),
                 lin("down", "mlp.dense_4h_to_h", None, "down_in", "down_out", True)]
    else:
        raise MergescopeError(f"merge=transport_released finds no q/k/v/o projections in a {model_type} layer "
                              "(self_attn.q_proj ... or attention.query_key_value); add its layout in transport/released.py")
    return Layout(model_type, ad.layers_attr, sites, views, {m.role: m for m in mods})


def view(p: fus.Probe, lay: Layout, name: str, layer: int) -> torch.Tensor:
    """(n_samples, width) pooled activations of one view."""
    site, cols = lay.views[name]
    x = p.pooled[site][layer]
    return x if cols is None else x[:, torch.as_tensor(cols, device=x.device)]


def magnitude(p: fus.Probe, lay: Layout, name: str, layer: int) -> torch.Tensor:
    """The released ranking: mean over sentences of |sentence-pooled activation| (not of |token activation|)."""
    return view(p, lay, name, layer).abs().mean(0)


# ----------------------------------------------------------------------------- its solvers


def released_sinkhorn(C: torch.Tensor, epsilon: float, n_iters: int = 200, tol: float = 1e-6,
                      out: torch.Tensor | None = None, potentials: list | None = None) -> tuple[torch.Tensor, list[int]]:
    """The released neuron Sinkhorn on a stack of problems ``C`` (B, n, m), each stopping on its own: log-domain,
    uniform marginals, log u = log a - LSE_j(-C/eps + log v), then log v = log b - LSE_i(-C/eps + log u), from zero
    potentials; every 10th iteration (and the last) the row marginals' L1 error err, stopping when err < tol or
    |err - previous err| < tol / 10 (the previous err starts at 1e9). Returns the plans exp(-C/eps + log u + log v)
    (float64, before the released storage rounding: :func:`stored`) and the iteration each stopped at.

    The same iterates are computed in the scaling domain when they fit float64 (:func:`_scaling_sinkhorn`: two
    batched mat-vecs an iteration instead of two log-sum-exps over the whole matrix, ~10x faster on a CPU); the
    log domain otherwise. ``out``: a float64 buffer of C's shape the scaling domain works and returns its plans in.
    ``potentials``: a list each problem's final potentials are appended to, from which :func:`rebuild` gives its plan
    again, to the bit, from the same cost without iterating."""
    C = C.to(torch.float64)
    B, n, m = C.shape
    lo, span = C.new_zeros(B), 0.0
    if C.numel():
        lo = C.amin(dim=(1, 2))
        span = float((C.amax(dim=(1, 2)) - lo).max()) / float(epsilon)
    if span <= SCALING_SPAN:
        Q, iters, u, v = _scaling_sinkhorn(C, lo, epsilon, n_iters, tol, out)
        if potentials is not None:
            potentials.extend(Potentials(True, lo[i:i + 1].clone(), u[i:i + 1].clone(), v[i:i + 1].clone()) for i in range(B))
        return Q, iters
    K = -C / float(epsilon)
    loga, logb = -math.log(n), -math.log(m)

    def update(logv):
        nu = loga - torch.logsumexp(K + logv[:, None, :], dim=2)
        return nu, logb - torch.logsumexp(K + nu[:, :, None], dim=1)

    def row_error(logu, logv):
        return (torch.exp(logu + torch.logsumexp(K + logv[:, None, :], dim=2)) - 1.0 / n).abs().sum(1)

    zeros = C.new_zeros
    logu, logv, iters = _released_loop(update, row_error, zeros(B, n), zeros(B, m), n_iters, tol)
    if potentials is not None:
        potentials.extend(Potentials(False, None, logu[i:i + 1].clone(), logv[i:i + 1].clone()) for i in range(B))
    return torch.exp(K + logu[:, :, None] + logv[:, None, :]), iters


@dataclass(frozen=True)
class Potentials:
    """One problem's final potentials from :func:`released_sinkhorn`: the scaling domain's min cost and scalings u, v
    (``scaling``), or the log domain's log u, log v; each (1, width)."""
    scaling: bool
    lo: torch.Tensor | None
    u: torch.Tensor
    v: torch.Tensor


def rebuild(C: torch.Tensor, epsilon: float, pot: Potentials, out: torch.Tensor | None = None) -> torch.Tensor:
    """The plan :func:`released_sinkhorn` returned for the cost ``C`` (1, n, m) with final potentials ``pot``, by the
    same operations in the same order (the same bits, without its iterations); in ``out`` when given."""
    C = C.to(torch.float64)
    if pot.scaling:
        E = torch.sub(pot.lo[:, None, None], C, out=out) if out is not None else pot.lo[:, None, None] - C
        return E.div_(float(epsilon)).exp_().mul_(pot.u[:, :, None]).mul_(pot.v[:, None, :])
    return torch.exp(-C / float(epsilon) + pot.u[:, :, None] + pot.v[:, None, :])


# The scaling domain holds the log-domain iterates when every problem's cost spans at most this many epsilons: the
# kernel exp(-(C - min C) / eps) then lies in [e^-300, 1] and the scalings within ~e^+-330, far inside float64's e^+-708
# (the correlation cost spans at most 2, so every epsilon >= 2 / 300 = 0.0067 takes it).
SCALING_SPAN = 300.0
# The scaling domain reads E in blocks of rows of at most this many bytes (the stack's problems together): each block is
# read twice an iteration, the second time from cache.
SCALING_BLOCK_BYTES = 1 << 22


def _scaling_sinkhorn(C: torch.Tensor, lo: torch.Tensor, epsilon: float, n_iters: int, tol: float,
                      out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
    """:func:`released_sinkhorn`'s iterates in the scaling domain: with s = min C per problem, E = exp(-(C - s)/eps),
    u = exp(log u - s/eps) and v = exp(log v), the log-domain updates are u = a / (E v) and v = b / (E^T u) exactly, the
    row marginal u * (E v) and the plan u E v; the same stopping rule on the same err.

    One pass over E an iteration (E is memory-bound: the pass is the cost): E is read in blocks of rows small enough to
    stay in cache, each block giving its rows' E v (hence their new u) and then, read again from cache, its share of
    E^T u. The err checked after iteration t needs E v_t, which is the first half of iteration t + 1's pass: the check
    is read off that pass and a problem that stops there keeps its iteration-t potentials (the iteration-(t + 1) ones
    are dropped). A check at the last iteration changes neither the potentials nor the iteration reported, so it is not
    made. ``lo``: each problem's min C; E (then the plan) is built in ``out`` when given. Returns the plans, the
    iterations and the final scalings u, v."""
    B, n, m = C.shape
    E = torch.sub(lo[:, None, None], C, out=out) if out is not None else lo[:, None, None] - C  # s - C is -(C - s) to the bit
    E.div_(float(epsilon)).exp_()  # -(C - s) / eps: the log domain's K - s / eps
    a, b = 1.0 / n, 1.0 / m
    rows = max(1, min(n, int(SCALING_BLOCK_BYTES // max(1, B * m * E.element_size()))))
    u, v = C.new_ones(B, n), C.new_ones(B, m)
    s, col = C.new_empty(B, n), C.new_empty(B, m)
    prev = C.new_full((B,), 1e9)
    done = torch.zeros(B, dtype=torch.bool, device=C.device)
    iters = [n_iters - 1] * B
    check = False  # whether the iteration before this one is a check whose err this pass gives
    for t in range(n_iters):
        col.zero_()
        for i0 in range(0, n, rows):
            blk = E[:, i0:i0 + rows]
            sb = torch.bmm(blk, v[:, :, None])[:, :, 0]
            s[:, i0:i0 + rows] = sb
            col.add_(torch.bmm((a / sb)[:, None, :], blk)[:, 0])
        if check:
            prev, done = _stop(iters, t - 1, (u * s - a).abs().sum(1), prev, done, tol)
            if bool(done.all()):
                break
        u = torch.where(done[:, None], u, a / s)
        v = torch.where(done[:, None], v, b / col)
        check = t % 10 == 0 and t < n_iters - 1
    return E.mul_(u[:, :, None]).mul_(v[:, None, :]), iters, u, v


def _stop(iters: list[int], t: int, err: torch.Tensor, prev: torch.Tensor, done: torch.Tensor,
          tol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The released stopping rule at a check after iteration t: a problem not yet done stops when its row-marginal L1
    error err < tol or |err - previous err| < tol / 10 (its iteration t written into ``iters``). Returns the previous
    errs and the done flags after the check."""
    stop = ~done & ((err < tol) | ((err - prev).abs() < tol * 0.1))
    for i in stop.nonzero().flatten().tolist():
        iters[i] = t
    return torch.where(done, prev, err), done | stop


def _released_loop(update, row_error, p: torch.Tensor, q: torch.Tensor, n_iters: int, tol: float):
    """The released iteration and stopping rule (:func:`_stop`) on a stack, in the log domain: ``update(q)`` gives the new row then
    column potentials; every 10th iteration (and the last) ``row_error(p, q)`` is each problem's row-marginal L1 error
    err, and a problem stops (its potentials kept from then on) when err < tol or |err - previous err| < tol / 10 (the
    previous err starts at 1e9). Returns the potentials and the iteration each problem stopped at."""
    B = p.shape[0]
    prev = p.new_full((B,), 1e9)
    done = torch.zeros(B, dtype=torch.bool, device=p.device)
    iters = [n_iters - 1] * B
    for t in range(n_iters):
        np_, nq = update(q)
        p = torch.where(done[:, None], p, np_)
        q = torch.where(done[:, None], q, nq)
        if t % 10 == 0 or t == n_iters - 1:
            prev, done = _stop(iters, t, row_error(p, q), prev, done, tol)
            if bool(done.all()):
                break
    return p, q, iters


def stored(Q: torch.Tensor, dtype: str, inplace: bool = False) -> torch.Tensor:
    """A plan as the released code keeps it: cast to ``dtype``, divided by its own sum in that dtype (bfloat16: the
    sum rounded to bfloat16 and the quotient too), back in float64. float64: Q / sum(Q). ``inplace``: written over Q
    (float64), the same numbers."""
    if dtype == "float64":
        return Q.div_(Q.sum()) if inplace else Q / Q.sum()
    q = Q.to(torch.bfloat16)
    q = q.div_(q.sum())
    return Q.copy_(q) if inplace else q.to(torch.float64)


def released_layer_plan(C: torch.Tensor, epsilon: float, max_iter: int = 1000, tol: float = 1e-7) -> torch.Tensor:
    """The released layer-level plan (``compute_P_stable``) on the (L, M) layer cost, held in float32: non-finite
    entries +inf; shifted by its finite minimum and divided by the lower median of the shifted finite entries (float64,
    back to float32); log-domain Sinkhorn in float64 from zero potentials at ``epsilon``, stopping when the row potential
    changes by less than ``tol`` (the plan then uses the potentials from before that last step); a non-finite plan is
    retried at twice the epsilon (six times at most, then all zero); the plan in float32, divided by its sum, then
    rows set to 1/L and columns to 1/M, three times."""
    C = C.to(torch.float32).clone()
    C[~torch.isfinite(C)] = float("inf")
    C64 = C.to(torch.float64)
    fin = torch.isfinite(C64)
    shift = C64 - (C64[fin].min() if fin.any() else 0.0)
    med = torch.median(shift[torch.isfinite(shift)]).clamp(min=1e-12) if fin.any() else torch.tensor(1.0, dtype=torch.float64)
    Cn = (shift / med).to(torch.float32)
    L, M = Cn.shape
    logr = torch.full((L,), 1.0 / L, dtype=torch.float64).log()
    logc = torch.full((M,), 1.0 / M, dtype=torch.float64).log()
    eps = max(float(epsilon), 1e-12)
    for _ in range(7):
        logK = -Cn.to(torch.float64) / max(eps, 1e-12)
        logu, logv = torch.zeros_like(logr), torch.zeros_like(logc)
        for _it in range(max_iter):
            nu = logr - torch.logsumexp(logK + logv[None, :], dim=1)
            nv = logc - torch.logsumexp(logK.T + nu[None, :], dim=1)
            if float((nu - logu).abs().max()) < tol:
                break
            logu, logv = nu, nv
        P = torch.exp(logK + logu[:, None] + logv[None, :])
        if bool(torch.isfinite(P).all()):
            P = P.to(torch.float32)
            P = P / P.sum()
            for _r in range(3):
                P = P * (1.0 / L) / (P.sum(1, keepdim=True) + 1e-30)
                P = P * (1.0 / M) / (P.sum(0, keepdim=True) + 1e-30)
            return P.to(torch.float64)
        eps *= 2.0
    return torch.zeros((L, M), dtype=torch.float64)


def sparsify_topk_keep_mass(P: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's top-k entries kept, rescaled to the row's old sum (``sparsify_P_topk`` with keep_row_mass)."""
    if k <= 0:
        return P
    old = P.sum(1, keepdim=True)
    top = torch.topk(P, min(k, P.shape[1]), dim=1).indices
    out = torch.zeros_like(P).scatter(1, top, P.gather(1, top))
    return out * (old.clamp_min(1e-12) / out.sum(1, keepdim=True).clamp_min(1e-12))


def sparsify_topr(Q: torch.Tensor, r: int) -> torch.Tensor:
    """``sparsify_Q_topr`` as its fusion arguments would call it (no marginal targets): negatives to zero, each row's
    top r entries kept (when r < its width), then each column's top r among those (when r < its height); an all-zero
    result returns the plan unchanged."""
    if r <= 0:
        return Q
    q = Q.clamp_min(0)
    n, m = q.shape
    if r < m:
        top = torch.topk(q, r, dim=1).indices
        q = torch.zeros_like(q).scatter(1, top, q.gather(1, top))
    if r < n:
        top = torch.topk(q.T, r, dim=1).indices
        q = torch.zeros_like(q.T).scatter(1, top, q.T.gather(1, top)).T
    return Q if float(q.sum()) == 0 else q


def sigma(x: torch.Tensor) -> torch.Tensor:
    """Per neuron: the sample standard deviation (n - 1) of its pooled activations plus 1e-6 (the released notes')."""
    return x.std(0) + 1e-6


# ----------------------------------------------------------------------------- the fit


@dataclass
class ReleasedFit:
    fusion: fus.Fusion
    weights: dict[str, np.ndarray]          # role -> (L_A, L_B) donor-layer weights used by the fusion
    layer_costs: dict[str, np.ndarray]      # "target view|donor view" -> the layer cost over the paired layers
    infos: list[tot.PlanInfo] = field(default_factory=list)


@dataclass
class _State:
    tp: fus.Probe
    dp: fus.Probe
    tl: Layout
    dl: Layout
    s: TransportSettings
    device: torch.device
    infos: list[tot.PlanInfo] = field(default_factory=list)
    diag: dict[str, list[float]] = field(default_factory=dict)
    buffers: dict[tuple, torch.Tensor] = field(default_factory=dict)
    # (target view, donor view, target layer, donor layer) -> the layer-cost pass's final potentials of that plan, kept
    # for the fusion when it solves the same plan on the same cost (:func:`_reuses`): rebuilt, not solved again
    potentials: dict[tuple[str, str, int, int], tuple[Potentials, int]] = field(default_factory=dict)  # and its iterations

    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A float64 work array kept across plans of one shape (the fit solves thousands of plans of a few shapes: a
        fresh array of a real MLP plan's size took 12-14 ms to fault in, about three Sinkhorn iterations over it)."""
        key = (name, tuple(shape))
        if key not in self.buffers:
            self.buffers[key] = torch.empty(shape, dtype=torch.float64, device=self.device)
        return self.buffers[key]


def _reuses(st: _State) -> bool:
    """Whether the fusion's plans are the layer-cost pass's: the released solver on the same full-width costs (every
    layer pair but ``pruned``'s subsampled ones)."""
    return st.s.released.solver == "released" and st.s.released.layer_pairs != "pruned"


def _solve_stack(st: _State, C: torch.Tensor, what: str, keep: bool = True,
                 potentials: list | None = None) -> list[torch.Tensor]:
    """Plans for a stack of costs, as stored (``plan_dtype``), by the configured solver. ``keep=False``: the plans are
    views of a work array, valid until the next stack of the same shape is solved. ``potentials``: the released
    solver's final potentials are appended to it (:func:`released_sinkhorn`)."""
    s, r = st.s, st.s.released
    if r.solver == "released":
        Q, iters = released_sinkhorn(C, s.epsilon, s.max_iter, s.marginal_tol, out=st.buffer("plan", C.shape),
                                     potentials=potentials)
        return [_stored_plan(st, Qi, it, keep) for Qi, it in zip(Q, iters)]
    out = []
    for Ci in C:
        Q, info = tot.solve(Ci, s.epsilon, s.max_iter, s.marginal_tol, what=what)
        st.infos.append(info)
        out.append(stored(Q, r.plan_dtype))
    return out


def _stored_plan(st: _State, Q: torch.Tensor, it: int, keep: bool) -> torch.Tensor:
    """A released plan's record (its marginals' L1 error, its iterations) and the plan as stored."""
    n, m = Q.shape
    err = float((Q.sum(1) - 1.0 / n).abs().sum())
    st.infos.append(tot.PlanInfo("released_sinkhorn", max(err, float((Q.sum(0) - 1.0 / m).abs().sum())), int(it)))
    return stored(Q, st.s.released.plan_dtype, inplace=not keep)


def _paired(st: _State) -> tuple[list[int], list[int]]:
    """(target layers, donor layers) in the plan: zipped = the first min(L_A, L_B) of each; otherwise all."""
    if st.s.released.layer_pairs == "zipped":
        n = min(st.tp.n_layers, st.dp.n_layers)
        return list(range(n)), list(range(n))
    return list(range(st.tp.n_layers)), list(range(st.dp.n_layers))


def _layer_cost(st: _State, tv: str, dv: str, budget_bytes: int = 1 << 28) -> np.ndarray:
    """C[l, m] = <C_lm, Q_lm> over the paired layers for one (target view, donor view); ``layer_pairs=pruned`` on a
    fixed random subsample of ``layer_subsample`` neurons per side."""
    lt, ld = _paired(st)
    out = np.zeros((len(lt), len(ld)))
    sub = {}
    if st.s.released.layer_pairs == "pruned":
        gen = torch.Generator().manual_seed(st.s.control_seed)
        sub["t"] = fus._subsample(view(st.tp, st.tl, tv, 0).shape[1], st.s.layer_subsample, gen)
        sub["d"] = fus._subsample(view(st.dp, st.dl, dv, 0).shape[1], st.s.layer_subsample, gen)
    def cols(x: torch.Tensor, side: str) -> torch.Tensor:
        return x if sub.get(side) is None else x[:, sub[side].to(x.device)]

    for a, l in enumerate(lt):
        xt = cols(view(st.tp, st.tl, tv, l), "t").to(st.device)
        c0, per = 0, None
        while c0 < len(ld):  # as many donor layers at a time as fit the budget (four float64 n x m arrays each)
            xd = cols(view(st.dp, st.dl, dv, ld[c0]), "d").to(st.device)
            per = per or max(1, int(budget_bytes // (xt.shape[1] * xd.shape[1] * 8 * 4)))
            ms = ld[c0:c0 + per]
            C = st.buffer("cost", (len(ms), xt.shape[1], xd.shape[1]))
            for b, m in enumerate(ms):
                tot.pearson_cost(xt, cols(view(st.dp, st.dl, dv, m), "d").to(st.device), out=C[b])
            pots: list[Potentials] | None = [] if _reuses(st) else None
            for b, Q in enumerate(_solve_stack(st, C, f"{tv}|{dv} neuron plan (layer cost {l})", keep=False, potentials=pots)):
                out[a, c0 + b] = float(Q.mul_(C[b]).sum())  # <C, Q>, Q's array reused for the products
            if pots is not None:
                st.potentials.update(((tv, dv, l, m), (pot, int(info.n_iter)))
                                     for m, pot, info in zip(ms, pots, st.infos[-len(ms):]))
            c0 += len(ms)
    return out


def _layer_weights(st: _State, P_post: torch.Tensor, P_pre: torch.Tensor) -> np.ndarray:
    """The donor-layer weights of one module over the full (L_A, L_B) grid: L_eff sqrt(P_post) sqrt(P_pre) (top-k with
    the row mass kept when ``p_topk``); ``pruned``: the top ``layer_topk`` per row, renormalised to 1 (mergescope's)."""
    r = st.s.released
    P = torch.sqrt(P_post.clamp_min(0)) * torch.sqrt(P_pre.clamp_min(0))
    if r.layer_pairs == "pruned":
        k = max(1, min(st.s.layer_topk, P.shape[1]))
        P = sparsify_topk_keep_mass(P, k)
        P = P / P.sum(1, keepdim=True).clamp_min(1e-300)
    else:
        P = sparsify_topk_keep_mass(P, r.p_topk) * P.shape[0]  # L_eff = round(sqrt(L_post L_pre)) = the paired target layers
    lt, ld = _paired(st)
    full = np.zeros((st.tp.n_layers, st.dp.n_layers))
    full[np.ix_(lt, ld)] = P.cpu().numpy()
    return full


def _plan(st: _State, tv: str, dv: str, l: int, m: int, diag: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One (target layer, donor layer) plan between two views, ready to multiply: (Phi as the output side, Phi as the
    input side): sigma-rescaled, top-r cut, then row- / column-stochastic when ``plan_scale=row_stochastic``."""
    r = st.s.released
    xt, xd = view(st.tp, st.tl, tv, l).to(st.device), view(st.dp, st.dl, dv, m).to(st.device)
    C = tot.pearson_cost(xt, xd, out=st.buffer("cost", (1, xt.shape[1], xd.shape[1]))[0])
    kept = st.potentials.pop((tv, dv, l, m), None)
    if kept is not None:  # solved in the layer-cost pass on this cost: the same plan, rebuilt from its potentials
        Q = _stored_plan(st, rebuild(C[None], st.s.epsilon, kept[0], out=st.buffer("plan", (1, *C.shape)))[0], kept[1], True)
    else:
        Q = _solve_stack(st, C[None], f"{tv}|{dv} neuron plan (layer {l} <- {m})")[0]
    if diag:
        for k, v in tot.plan_diagnostics(Q, C, epsilon=st.s.epsilon, seed=st.s.control_seed).items():
            st.diag.setdefault(f"{k}_{tv}", []).append(v)
    if r.sigma_rescale:
        Q = Q * sigma(xt).to(Q.device)[:, None] / (sigma(xd).to(Q.device)[None, :] + 1e-6)
    Q = sparsify_topr(Q, r.q_topr)
    if st.s.plan_scale == "row_stochastic":
        return tot.row_stochastic(Q), tot.column_stochastic(Q)
    return Q, Q


def _top(mag: torch.Tensor, k: int, limit: int | None = None) -> torch.Tensor:
    """The k largest (torch.topk), sorted; indices at or past ``limit`` dropped (the released o_proj columns)."""
    idx = torch.sort(torch.topk(mag, min(int(k), mag.shape[0])).indices).values
    return idx if limit is None else idx[idx < limit]


def fit(target, donor_sd: Mapping[str, torch.Tensor], tp: fus.Probe, dp: fus.Probe, tl: Layout, dl: Layout,
        settings: TransportSettings, progress: bool = True) -> ReleasedFit:
    """Layer costs and plans, the donor-layer weights per module, then T, T_rand at every target layer's mask. Where
    the fusion's plan is one the layer-cost pass solved on the same cost (:func:`_reuses`) it is rebuilt from that
    solve's potentials (:func:`rebuild`): the plan the layer cost read, without a second solve."""
    s, r = settings, settings.released
    device = next(target.parameters()).device
    st = _State(tp, dp, tl, dl, s, device)
    roles = [x for x in SUBLAYER_ROLES[r.sublayers] if x in tl.modules and x in dl.modules]
    if not roles:
        raise MergescopeError(f"merge.released.sublayers={r.sublayers}: the target ({tl.family}) and the donor ({dl.family}) "
                              "share none of its modules")
    pairs = sorted({(tl.modules[x].pre, dl.modules[x].pre) for x in roles} | {(tl.modules[x].post, dl.modules[x].post) for x in roles})
    costs, plans = {}, {}
    with bar() as pb:
        task = pb.add_task("layer costs", total=len(pairs), visible=progress)
        for tv, dv in pairs:
            costs[f"{tv}|{dv}"] = _layer_cost(st, tv, dv)
            C = torch.from_numpy(costs[f"{tv}|{dv}"])
            if r.solver == "released":
                plans[(tv, dv)] = released_layer_plan(C, s.layer_epsilon, r.layer_max_iter, r.layer_tol)
            else:
                P, info = tot.solve(C, s.layer_epsilon, s.max_iter, s.marginal_tol, what=f"{tv}|{dv} layer plan")
                st.infos.append(info)
                plans[(tv, dv)] = P
            pb.advance(task)
    weights = {x: _layer_weights(st, plans[(tl.modules[x].post, dl.modules[x].post)], plans[(tl.modules[x].pre, dl.modules[x].pre)])
               for x in roles}
    f = fus.Fusion({}, {}, {}, {}, {}, {}, extra_controls=[{} for _ in range(s.control_seeds - 1)])
    t_sd = target.state_dict()
    gens = [torch.Generator().manual_seed(s.control_seed), *fus.control_generators(s)]
    with bar() as pb:
        task = pb.add_task("fusion plans", total=tp.n_layers, visible=progress)
        for l in range(tp.n_layers):
            _fuse_layer(st, f, l, roles, weights, t_sd, donor_sd, gens)
            pb.advance(task)
    f.infos = st.infos
    f.diagnostics = {k: float(np.mean(v)) for k, v in st.diag.items()}
    for base in ("row_max", "row_entropy", "cost_ratio", "uniform_row_max", "uniform_entropy", "rowmax_over_uniform",
                 "entropy_gap", "cost_mean", "cost_sd"):
        vals = [v for k, vs in st.diag.items() if k.startswith(base + "_") for v in vs]
        if vals:
            f.diagnostics[base] = float(np.mean(vals))
    return ReleasedFit(f, weights, costs, st.infos)


def _fuse_layer(st: _State, f: fus.Fusion, l: int, roles: list[str], weights: dict[str, np.ndarray],
                t_sd: Mapping[str, torch.Tensor], donor_sd: Mapping[str, torch.Tensor], gens: list[torch.Generator]) -> None:
    """Target layer l: T, and each control seed's T_rand (one generator per seed; R, R1, R2, ... in the accumulators)."""
    s, r, tl, dl = st.s, st.s.released, st.tl, st.dl
    tprefix, dprefix = f"{tl.layers_attr}.{l}", dl.layers_attr
    tviews = sorted({v for x in roles for v in (tl.modules[x].pre, tl.modules[x].post)})
    seeds = [{v: torch.randperm(view(st.tp, tl, v, l).shape[1], generator=g).to(st.device) for v in tviews} for g in gens]
    perms = seeds[0]
    f.control_perms.update({(l, v): p for v, p in perms.items()})
    rk = ["R", *(f"R{i}" for i in range(1, len(seeds)))]  # each seed's accumulator (its bias: "b" + the key)
    mask, acc = {}, {}
    for x in roles:
        mod = tl.modules[x]
        if mod.by_column:
            src = mod.post if r.column_mask == "output" else mod.pre
            mask[x] = _top(magnitude(st.tp, tl, src, l), s.top_k, view(st.tp, tl, mod.pre, l).shape[1]).to(st.device)
        else:
            mask[x] = _top(magnitude(st.tp, tl, mod.post, l), s.top_k).to(st.device)
        n_out, n_in = view(st.tp, tl, mod.post, l).shape[1], view(st.tp, tl, mod.pre, l).shape[1]
        k = len(mask[x])
        shape = (n_out, k) if mod.by_column else (k, n_in)
        acc[x] = {key: torch.zeros(shape, dtype=torch.float64, device=st.device) for key in ("T", *rk)}
        if mod.bias is not None and not mod.by_column:
            acc[x].update({f"b{key}": torch.zeros(k, dtype=torch.float64, device=st.device) for key in ("T", *rk)})
    donors = sorted({int(m) for x in roles for m in np.nonzero(weights[x][l])[0]})
    for m in donors:
        top = {x: float(weights[x][l, m]) == float(weights[x][l].max()) for x in roles}
        cache: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}

        def phi(tv: str, dv: str, diag: bool):
            if (tv, dv) not in cache:
                cache[(tv, dv)] = _plan(st, tv, dv, l, m, diag)
            return cache[(tv, dv)]

        for x in roles:
            w = float(weights[x][l, m])
            if w == 0.0:
                continue
            tm, dm = tl.modules[x], dl.modules[x]
            out_phi, _ = phi(tm.post, dm.post, top[x])
            _, in_phi = phi(tm.pre, dm.pre, top[x])
            wd = _rows(donor_sd[f"{dprefix}.{m}.{dm.weight}"], dm.rows)
            ratio = 1.0
            if s.scale_match == "rms":
                ratio = fus.scale_ratio(_rows(t_sd[f"{tprefix}.{tm.weight}"], tm.rows), wd)
                st.diag.setdefault("scale_match_ratio", []).append(ratio)
            rows = mask[x]
            if tm.by_column:
                mid = fus._left(out_phi, wd.to(st.device))              # Phi_out W_B (all target output rows)
                acc[x]["T"] += w * ratio * (mid @ in_phi[rows].T)
                for key, p in zip(rk, seeds):
                    acc[x][key] += w * ratio * (mid @ in_phi[p[tm.pre][rows]].T)[p[tm.post]]
            else:
                left = fus._left(torch.cat([out_phi[rows], *(out_phi[p[tm.post][rows]] for p in seeds)]), wd.to(st.device))
                k = len(rows)
                acc[x]["T"] += w * ratio * (left[:k] @ in_phi.T)
                for i, (key, p) in enumerate(zip(rk, seeds), 1):
                    acc[x][key] += w * ratio * (left[k * i:k * (i + 1)] @ in_phi.T)[:, p[tm.pre]]
                if "bT" in acc[x] and dm.bias is not None:
                    bd = _rows(donor_sd[f"{dprefix}.{m}.{dm.bias}"], dm.rows).to(st.device, torch.float64)
                    acc[x]["bT"] += w * ratio * (out_phi[rows] @ bd)
                    for key, p in zip(rk, seeds):
                        acc[x][f"b{key}"] += w * ratio * (out_phi[p[tm.post][rows]] @ bd)
        cache.clear()
    _store(f, l, roles, mask, acc, t_sd, tl, tprefix)


def _rows(w: torch.Tensor, rows: tuple[int, ...] | None) -> torch.Tensor:
    return w if rows is None else w[torch.as_tensor(rows, device=w.device)]


def _store(f: fus.Fusion, l: int, roles, mask, acc, t_sd, tl: Layout, tprefix: str) -> None:
    """Into the Fusion, per parameter: its masked rows (parameter rows; NeoX's q/k/v blocks share one parameter) or
    columns, with T and every control seed's T_rand there, sorted."""
    rk = ["R", *(f"R{i}" for i in range(1, f.n_controls))]
    parts: dict[str, list] = {}
    for x in roles:
        mod = tl.modules[x]
        name = f"{tprefix}.{mod.weight}"
        if mod.by_column:
            parts.setdefault(name, []).append((mask[x], acc[x]["T"].T, [acc[x][key].T for key in rk], True))
            continue
        prow = mask[x] if mod.rows is None else torch.as_tensor(mod.rows, device=mask[x].device)[mask[x]]
        parts.setdefault(name, []).append((prow, acc[x]["T"], [acc[x][key] for key in rk], False))
        if "bT" in acc[x]:
            parts.setdefault(f"{tprefix}.{mod.bias}", []).append((prow, acc[x]["bT"], [acc[x][f"b{key}"] for key in rk], False))
    for name, ps in parts.items():
        w = t_sd[name].detach()
        idx = torch.cat([p[0] for p in ps])
        order = torch.argsort(idx)
        f.original[name] = w.clone()
        f.rows[name] = idx[order].to(w.device)
        f.transported[name] = torch.cat([p[1] for p in ps])[order.to(ps[0][1].device)]
        for s, dest in enumerate([f.control, *f.extra_controls]):
            dest[name] = torch.cat([p[2][s] for p in ps])[order.to(ps[0][2][s].device)]
        if ps[0][3]:
            f.by_column.add(name)
        n = w.shape[1] if ps[0][3] else w.shape[0]
        f.masks[name] = torch.zeros(n, dtype=torch.bool, device=w.device)
        f.masks[name][f.rows[name]] = True
