"""Entropic optimal transport between neurons (and between layers), with every plan checked.

Cost between a target neuron i and a donor neuron j is ``1 - pearson(a_i, b_j)`` over probe
samples; a neuron that is constant on the probe set has no defined correlation and is given
correlation 0 (cost 1) to everything. Plans have uniform marginals, 1/n_target per row and
1/n_donor per column, so they are rectangular by construction: nothing is padded.

``solve`` runs POT's Sinkhorn (``method="sinkhorn"``) and accepts the plan only if it is finite,
non-negative and meets both marginals to ``tol`` (L1, out of a total mass of 1). Plain Sinkhorn
at a small epsilon can underflow and hand back a garbage plan without raising; then the same problem is
solved on the reduced cost (row and column minima subtracted: the same plan, and no all-zero kernel row),
by plain Sinkhorn, then POT's log-stabilised solver (``sinkhorn_stabilized``: large potentials absorbed into the log domain) is tried,
then the full log-domain solver (``sinkhorn_log``, on torch tensors: POT's numpy log-sum-exp is ~4x
slower), and the fallback is reported in the plan's info. Measured on a 256 x 192 plan at epsilon 0.001:
stabilised 4.5 s, log-domain 45 s (torch) / 190 s (numpy), to the same plan.
If that fails too, the fusion stops with an error: no fusion ever runs through a bad plan.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from mergescope.errors import MergescopeError, NotConverged


@dataclass
class PlanInfo:
    solver: str                     # sinkhorn | sinkhorn_log
    marginal_error: float           # max over the two marginals of the L1 violation
    n_iter: int
    fallback_reason: str | None = None
    extra: dict = field(default_factory=dict)


def pearson_cost(X: torch.Tensor, Y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(n_x, n_y) cost 1 - Pearson correlation between columns of X (s, n_x) and Y (s, n_y), float64; written into
    ``out`` (a contiguous float64 (n_x, n_y) tensor) when given, with no other array of that size allocated: at a
    real model's MLP width (1536 x 4864) a fresh array costs twice the in-place clamp and complement together."""
    X = X.to(torch.float64)
    Y = Y.to(Y.device if X.device == Y.device else X.device, torch.float64)
    if X.shape[0] != Y.shape[0]:
        raise MergescopeError(f"the two sides have {X.shape[0]} and {Y.shape[0]} probe samples; they must share the sample index")
    Xc = X - X.mean(0, keepdim=True)
    Yc = Y - Y.mean(0, keepdim=True)
    nx, ny = Xc.norm(dim=0), Yc.norm(dim=0)
    # constant neurons: no correlation is defined; treat as uncorrelated with everything
    tiny = torch.finfo(torch.float64).tiny ** 0.5
    Xn = torch.where(nx > tiny, Xc / nx.clamp_min(tiny), torch.zeros_like(Xc))
    Yn = torch.where(ny > tiny, Yc / ny.clamp_min(tiny), torch.zeros_like(Yc))
    rho = Xn.T @ Yn if out is None else torch.matmul(Xn.T, Yn, out=out)
    return rho.clamp_(-1.0, 1.0).neg_().add_(1.0)  # (-rho) + 1 is 1 - rho to the bit


def marginal_error(Q: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    return float(max((Q.sum(1) - a).abs().sum(), (Q.sum(0) - b).abs().sum()))


def plan_checks(Q: torch.Tensor | None, a, b, tol: float) -> tuple[bool, float]:
    """(accepted, marginal error): finite, non-negative, both marginals within ``tol`` (L1)."""
    if Q is None or not bool(torch.isfinite(Q).all()) or bool((Q < 0).any()):
        return False, math.inf
    err = marginal_error(Q, a, b)
    return err <= tol, err


def reduced_cost(C: torch.Tensor) -> torch.Tensor:
    """C minus its row minima, then minus the result's column minima: under fixed marginals a constant per row or
    column adds a constant to the (entropic) objective, so the plan is the same; but every row and column now has
    a zero cost, so exp(-C/epsilon) cannot underflow to an all-zero row or column at a small epsilon."""
    r = C - C.min(1, keepdim=True).values
    return r - r.min(0, keepdim=True).values


def sinkhorn_knopp(a: np.ndarray, b: np.ndarray, M: np.ndarray, reg: float, max_iter: int,
                   stop: float) -> tuple[np.ndarray, int]:
    """POT's plain Sinkhorn (``ot.sinkhorn(method="sinkhorn")``, ``sinkhorn_knopp``) on numpy arrays, step for step:
    the same start, the same products in the same order, the same stop on a numerical error (back to the previous
    iterate) and the same marginal check every 10th iteration against ``stop``; so the same plan to the bit and the
    same iteration count (``tests/test_transport.py``). Without the backend's dispatch, with one non-finite test per
    iteration on a sum (POT's five scans only when it fails) and the products written into kept buffers, 256 x 256
    plans take 0.63x POT's time (``benchmarks/bench_plain_sinkhorn.py``): the layer-cost pass solves 1080 of them per
    transport direction (SmolLM2 <- Gemma: 67.6 s, 102 s with POT's). Returns (plan, the last iteration's index)."""
    n, m = M.shape
    u = np.ones(n, dtype=M.dtype) / n
    v = np.ones(m, dtype=M.dtype) / m
    K = np.exp(M / (-reg))
    KT = K.T
    Kp = (1 / a).reshape(-1, 1) * K
    u2, v2, ktu, kv = np.empty_like(u), np.empty_like(v), np.empty_like(v), np.empty_like(u)
    ii = 0
    for ii in range(max_iter):
        np.dot(KT, u, out=ktu)
        np.divide(b, ktu, out=v2)
        np.dot(Kp, v2, out=kv)
        np.divide(1.0, kv, out=u2)
        # a finite sum means every entry is finite (and no ktu is 0: b / 0 is not finite); otherwise POT's own scans
        if not np.isfinite(u2.sum() + v2.sum()) and (
                (ktu == 0).any() or not (np.isfinite(u2).all() and np.isfinite(v2).all())):
            break  # machine precision reached: the previous iterate (u, v), and stop
        u, u2, v, v2 = u2, u, v2, v
        if ii % 10 == 0 and np.linalg.norm(np.einsum("i,ij,j->j", u, K, v) - b) < stop:
            break
    return u.reshape((-1, 1)) * K * v.reshape((1, -1)), ii


def _attempt(method: str, C: torch.Tensor, a: torch.Tensor, b: torch.Tensor, epsilon: float, max_iter: int,
             tol: float) -> tuple[torch.Tensor | None, dict, float]:
    """One POT solve: (plan or None, log, marginal error or inf). On CPU POT's numpy backend is ~2.5x faster per
    iteration than its torch backend, except for the log-domain solver, whose numpy log-sum-exp is ~4x slower; plain
    Sinkhorn on the CPU runs :func:`sinkhorn_knopp` (POT's steps without its dispatch)."""
    import ot

    n, m = C.shape
    use_numpy = C.device.type == "cpu" and method != "sinkhorn_log"
    args = (a.numpy(), b.numpy(), C.numpy()) if use_numpy else (a, b, C)
    stop = tol / math.sqrt(max(n, m))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if use_numpy and method == "sinkhorn" and PLAIN_SOLVER["numpy"] is not None:
                Q, it = PLAIN_SOLVER["numpy"](*args, epsilon, max_iter, stop)
                log = {"niter": it}
            else:
                Q, log = ot.sinkhorn(*args, epsilon, method=method, numItermax=max_iter, stopThr=stop, log=True, warn=False)
        except (FloatingPointError, ValueError, RuntimeError) as exc:  # solver blew up outright
            return None, {"niter": -1, "error": type(exc).__name__}, math.inf
    Q = torch.from_numpy(np.asarray(Q)) if use_numpy else Q
    log = {"niter": log.get("niter") if log.get("niter") is not None else log.get("n_iter", -1)}
    return Q, log, plan_checks(Q, a, b, tol)[1]


PLAIN_SOLVER: dict = {"numpy": sinkhorn_knopp}
"""The plain-Sinkhorn solver for numpy problems (None: POT's ``ot.sinkhorn``, the same plan; a test swaps in a broken
one to check the fallback chain)."""


def solve(C: torch.Tensor, epsilon: float, max_iter: int = 20000, tol: float = 1e-5,
          what: str = "neuron plan") -> tuple[torch.Tensor, PlanInfo]:
    """Entropic OT plan for cost ``C`` (n, m) with uniform marginals; float64 on C's device. Plain Sinkhorn on C
    first (the plan every earlier run used); when its plan fails the checks, the same problem on the reduced cost
    (``reduced_cost``) by plain, log-stabilised and log-domain Sinkhorn in turn. ``PlanInfo.solver`` names the
    solver that gave the plan (``+reduced`` when on the reduced cost) and ``fallback_reason`` every failure."""
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise MergescopeError(f"epsilon must be a positive number, got {epsilon!r}")
    C = C.to(torch.float64)
    n, m = C.shape
    a = torch.full((n,), 1.0 / n, dtype=torch.float64, device=C.device)
    b = torch.full((m,), 1.0 / m, dtype=torch.float64, device=C.device)
    attempts = [("sinkhorn", C)]
    shifted = reduced_cost(C)
    attempts += [(m_, shifted) for m_ in ("sinkhorn", "sinkhorn_stabilized", "sinkhorn_log")]
    reasons = []
    for k, (method, cost) in enumerate(attempts):
        Q, log, err = _attempt(method, cost, a, b, float(epsilon), int(max_iter), tol)
        name = method if k == 0 else f"{method} (reduced cost)"
        if Q is not None and err <= tol:
            return Q, PlanInfo(method if k == 0 else method + "+reduced", err, int(log.get("niter", -1)),
                               fallback_reason="; ".join(reasons) or None)
        if Q is None:
            reasons.append(f"{name} raised {log['error']}")
        else:
            reasons.append(f"{name}: marginal error {err:.2e} after {log.get('niter', max_iter)} iterations"
                           if math.isfinite(err) else f"{name}: non-finite plan")
    raise NotConverged(
        f"entropic OT did not converge for a {n}x{m} {what} at epsilon={epsilon} ({'; '.join(reasons)}); "
        f"raise merge.epsilon or merge.max_iter — fusing through this plan would be meaningless"
    )


def row_stochastic(Q: torch.Tensor) -> torch.Tensor:
    """Phi = n * Q (rows sum to 1 under uniform marginals); exact row normalisation guards the last ulp."""
    return Q / Q.sum(1, keepdim=True).clamp_min(torch.finfo(Q.dtype).tiny)


def column_stochastic(Q: torch.Tensor) -> torch.Tensor:
    """Phi = m * Q for an (n, m) plan (columns sum to 1 under uniform marginals): the input-side scale.
    Each donor input neuron then reads a convex combination of target neurons, so a donor neuron split
    in two keeps its full input (``fusion.py``)."""
    return Q / Q.sum(0, keepdim=True).clamp_min(torch.finfo(Q.dtype).tiny)


def plan_diagnostics(Q: torch.Tensor, C: torch.Tensor, exact_max: int = 2048, epsilon: float | None = None,
                     seed: int = 0, subsample: int = 1024) -> dict[str, float]:
    """Row max of Phi = n Q (1 = a hard assignment, 1/m = the uniform coupling) and its ratio to the uniform 1/m
    (``rowmax_over_uniform``: m for a hard assignment, 1 for the uniform coupling), mean row entropy of Phi in nats
    (0 = hard, log m = uniform) and its gap below the uniform log m (``entropy_gap``: log m for a permutation, 0 for the
    uniform coupling), the cost matrix's mean and sd (``cost_mean``, ``cost_sd``: the neuron costs 1 - rho, whatever the
    plan), and the plan's transport cost over the unregularised optimum (``cost_ratio``, exact network-simplex OT,
    ``ot.emd2`` on the same cost). Where a side is wider than ``exact_max`` the ratio is taken on a fixed random
    subsample of ``subsample`` rows and columns (``seed``), the entropic plan refitted there at ``epsilon`` by
    :func:`solve` (``subsampled_cost_ratio`` = 1); without ``epsilon`` it is left out."""
    import ot

    n, m = Q.shape
    phi = row_stochastic(Q)
    ent = -(phi * torch.log(phi.clamp_min(1e-300))).sum(1)
    row_max = float(phi.max(1).values.mean())
    out = {"row_max": row_max, "row_entropy": float(ent.mean()),
           "uniform_row_max": 1.0 / m, "uniform_entropy": math.log(m), "rowmax_over_uniform": row_max * m,
           "entropy_gap": math.log(m) - float(ent.mean()), "cost": float((Q * C).sum()),
           "cost_mean": float(C.mean()), "cost_sd": float(C.std()) if C.numel() > 1 else 0.0}  # 1 - rho over all neuron pairs
    if max(n, m) <= exact_max:
        Cn = C.detach().cpu().to(torch.float64).numpy()
        opt = float(ot.emd2(np.full(n, 1.0 / n), np.full(m, 1.0 / m), Cn, numItermax=10_000_000))
        out["cost_opt"] = opt
        out["cost_ratio"] = out["cost"] / opt if opt > 0 else math.nan
    elif epsilon is not None:
        g = torch.Generator().manual_seed(int(seed))
        ri = torch.randperm(n, generator=g)[:min(n, subsample)].to(C.device)
        ci = torch.randperm(m, generator=g)[:min(m, subsample)].to(C.device)
        Cs = C[ri][:, ci].to(torch.float64)
        Qs, _ = solve(Cs, epsilon, what="subsampled plan (cost ratio)")
        k, j = Cs.shape
        opt = float(ot.emd2(np.full(k, 1.0 / k), np.full(j, 1.0 / j), Cs.cpu().numpy(), numItermax=10_000_000))
        out["cost_opt"] = opt
        out["cost_ratio"] = float((Qs * Cs).sum()) / opt if opt > 0 else math.nan
        out["subsampled_cost_ratio"] = 1.0
    return out


def sinkhorn_batched(C: torch.Tensor, epsilon: float, max_iter: int = 20000, tol: float = 1e-5,
                     budget_bytes: int = 1 << 28) -> tuple[list[torch.Tensor | None], list[int]]:
    """Plain Sinkhorn on a stack of equal-shape problems ``C`` (B, n, m) with uniform marginals, in batched matrix
    products on C's device: POT's ``sinkhorn_knopp`` step for step (the same start, updates, numerical-error stop
    and marginal check every 10th iteration at ``tol / sqrt(max(n, m))``), each problem stopping on its own.
    Returns per problem its plan, or None where the step stopped on a numerical error (the caller then solves it
    by :func:`solve`'s chain), and its iteration count. Problems are taken ``budget_bytes`` of kernels at a time
    (two float64 n x m kernels each). Accepting a plan is the caller's check (:func:`solve`'s)."""
    B, n, m = C.shape
    per = max(1, int(budget_bytes // (2 * 8 * n * m)))
    plans: list[torch.Tensor | None] = []
    iters: list[int] = []
    for s in range(0, B, per):
        p, it = _sinkhorn_chunk(C[s:s + per].to(torch.float64), float(epsilon), int(max_iter), tol)
        plans += p
        iters += it
    return plans, iters


def sinkhorn_batched_pot(C: torch.Tensor, epsilon: float, max_iter: int = 20000,
                         tol: float = 1e-5) -> tuple[list[torch.Tensor | None], list[int]]:
    """The same stack solved by POT's maintained batched solver (``ot.batch.solve_batch``, method ``sinkhorn``, POT >=
    0.9.6), stopping at the L2 row-marginal error ``tol / sqrt(max(n, m))`` that :func:`sinkhorn_batched` uses. It
    updates the row scaling first and stops when the *worst* problem of the batch meets the tolerance, so every
    problem gets the batch's iteration count and its plan is a different iterate from :func:`sinkhorn_batched`'s and
    from POT's per-problem ``ot.sinkhorn`` (2.7e-7 apart at tol 1e-5, epsilon 0.01; 2e-14 at tol 1e-12):
    ``benchmarks/bench_batch_sinkhorn.py``. Not the default (``align_layers(batched_solver=...)``): it agrees with the
    home-made solver to 1e-10 only at tolerances where the home-made one measured faster. Non-finite plans are None."""
    import warnings

    from ot.batch import solve_batch

    B, n, m = C.shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = solve_batch(C.to(torch.float64), reg=float(epsilon), max_iter=int(max_iter), tol=tol / math.sqrt(max(n, m)),
                          method="sinkhorn", grad="detach")
    it = int(res.log.get("n_iter", max_iter - 1)) if getattr(res, "log", None) else max_iter - 1
    plans = [p if bool(torch.isfinite(p).all()) else None for p in res.plan]
    return plans, [it] * B


def _sinkhorn_chunk(C: torch.Tensor, epsilon: float, max_iter: int, tol: float) -> tuple[list, list[int]]:
    B, n, m = C.shape
    a, b = 1.0 / n, 1.0 / m
    stop = tol / math.sqrt(max(n, m))
    K = torch.exp(C / -epsilon)
    Kp = (1.0 / torch.full((n, 1), a, dtype=C.dtype, device=C.device)) * K  # as POT: (1 / a).reshape(-1, 1) * K
    u = torch.ones(B, n, dtype=C.dtype, device=C.device) / n
    v = torch.ones(B, m, dtype=C.dtype, device=C.device) / m
    bvec = torch.full((m,), b, dtype=C.dtype, device=C.device)
    live = torch.arange(B, device=C.device)      # problems still iterating, in order
    out_u, out_v = u.clone(), v.clone()
    niter = [max_iter - 1] * B
    broken = [False] * B
    Kl, Kpl, ul, vl = K, Kp, u, v
    for ii in range(max_iter):
        ktu = torch.bmm(Kl.transpose(1, 2), ul.unsqueeze(2)).squeeze(2)
        vn = bvec / ktu
        un = 1.0 / torch.bmm(Kpl, vn.unsqueeze(2)).squeeze(2)
        bad = (ktu == 0).any(1) | ~torch.isfinite(un).all(1) | ~torch.isfinite(vn).all(1)
        done = bad.clone()
        ul = torch.where(bad.unsqueeze(1), ul, un)  # a numerical error: back to the previous iterate, and stop
        vl = torch.where(bad.unsqueeze(1), vl, vn)
        if ii % 10 == 0:
            marg = torch.einsum("bi,bij,bj->bj", ul, Kl, vl)
            err = torch.linalg.vector_norm(marg - bvec, dim=1)
            done |= err < stop
        if bool(done.any()):
            for j in done.nonzero().flatten().tolist():
                g = int(live[j])
                out_u[g], out_v[g], niter[g], broken[g] = ul[j], vl[j], ii, bool(bad[j])
            keep = ~done
            live, Kl, Kpl, ul, vl = live[keep], Kl[keep], Kpl[keep], ul[keep], vl[keep]
            if live.numel() == 0:
                break
    for j, g in enumerate(live.tolist()):  # ran out of iterations: the last iterate (the caller's check refuses it)
        out_u[g], out_v[g] = ul[j], vl[j]
    plans = [None if broken[g] else out_u[g].reshape(-1, 1) * K[g] * out_v[g].reshape(1, -1) for g in range(B)]
    return plans, niter
