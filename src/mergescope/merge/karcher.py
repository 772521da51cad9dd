"""Karcher mean: the weighted Riemannian (Fréchet) mean of the tensors' directions on the unit sphere.

For one tensor position, each tensor x_i is split into its norm |x_i| and direction u_i = x_i / |x_i|
(tensors of norm <= ``tol`` take no part in the direction). With weights a_i (normalised to sum 1 over
the taking part), the mean direction m minimises sum_i a_i arccos(<m, u_i>)^2; it is found by Riemannian
gradient descent with unit step from the normalised weighted mean of the u_i (the first u_i if that is
below ``tol``): the tangent g = sum_i a_i theta_i / sin(theta_i) (u_i - cos(theta_i) m), theta_i =
arccos(<m, u_i>) (terms with theta_i < ``tol`` skipped), the step m <- cos|g| m + sin|g| g/|g|, renormalised,
until |g| < ``tol`` or ``max_iter`` steps. result = (sum_i a_i |x_i|) m: the direction's mean scaled by the
weighted mean norm. Base-free (a base, when given, is ignored); one tensor is returned as it is.

This is mergekit 0.1.5's ``karcher`` (equal weights there; per-model ``weights`` here, with its
``karcher_merge_tensors`` weighted form), reference arXiv 2603.04972 as mergekit cites it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from mergescope.errors import MergescopeError
from mergescope.merge._common import as_weights, check_number, check_tensors, check_weights, work_dtype
from mergescope.merge._mergekit import MK, per_model
from mergescope.registry import merges

OP = "karcher"


def _check(kwargs: Mapping, context: Mapping) -> None:
    n_models = context.get("n_models")
    check_weights(OP, kwargs.get("weights"), n_models)
    w = kwargs.get("weights")
    if w is not None and (any(float(x) < 0 for x in w) or sum(float(x) for x in w) <= 0):
        raise MergescopeError(f"merge '{OP}' weights={list(w)} must be >= 0 with a positive sum: set merge.weights=[w1,w2,...]")
    mi = kwargs.get("max_iter", 10)
    if isinstance(mi, bool) or not isinstance(mi, int) or mi < 0:
        raise MergescopeError(f"merge '{OP}' max_iter={mi!r} is not an integer >= 0: set merge.max_iter=<int>")
    check_number(OP, "tol", kwargs.get("tol", 1e-5))


def _mk(kw, n, has_base):
    w = kw.get("weights")
    notes = [] if w is None or len({float(x) for x in w}) == 1 else ["mergekit's karcher weighs the models equally"]
    return MK("karcher", {"max_iter": int(kw.get("max_iter", 10)), "tol": float(kw.get("tol", 1e-5))}, per_model(n),
              base=None, notes=notes)


@merges.register(OP, needs_base=False, check=_check, mergekit=_mk, reference="https://arxiv.org/abs/2603.04972", order=80)
def karcher(
    tensors: list[Tensor],
    base: Tensor | None,
    weights: list[float] | None = None,
    max_iter: int = 10,
    tol: float = 1e-5,
) -> Tensor:
    """Weighted Karcher mean of the directions times the weighted mean norm (module doc)."""
    check_tensors(OP, tensors)
    _check({"weights": weights, "max_iter": max_iter, "tol": tol}, {"n_models": len(tensors)})
    if len(tensors) == 1:
        return tensors[0]
    dt = work_dtype(tensors[0])
    xs = [x.to(dt) for x in tensors]
    raw = as_weights(weights, len(xs))
    a = [wi / sum(raw) for wi in raw]
    norms = [torch.linalg.vector_norm(x) for x in xs]
    live = [i for i, nrm in enumerate(norms) if float(nrm) > tol]
    if not live:
        return torch.zeros_like(xs[0]).to(tensors[0].dtype)
    units = [(xs[i] / norms[i]).reshape(-1) for i in live]
    al = [a[i] for i in live]
    al = [x / sum(al) for x in al]
    m = torch.zeros_like(units[0])
    for ai, u in zip(al, units):
        m.add_(u, alpha=ai)
    mn = torch.linalg.vector_norm(m)
    m = units[0].clone() if float(mn) < tol else m / mn
    for _ in range(int(max_iter)):
        g = torch.zeros_like(m)
        for ai, u in zip(al, units):
            c = torch.dot(m, u).clamp(-1.0, 1.0)
            theta = torch.arccos(c)
            if float(theta) < tol:
                continue
            g.add_((u - c * m) * (ai * theta / torch.sin(theta)))
        gn = torch.linalg.vector_norm(g)
        if float(gn) < tol:
            break
        m = torch.cos(gn) * m + torch.sin(gn) * (g / gn)
        un = torch.linalg.vector_norm(m)
        if float(un) > tol:
            m = m / un
    scale = sum(ai * nrm for ai, nrm in zip(a, norms))
    return (scale * m).reshape(xs[0].shape).to(tensors[0].dtype)
