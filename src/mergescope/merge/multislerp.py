"""Multi-SLERP: barycentric interpolation of N tensors on the hypersphere (Goddard, 2024).

For one tensor position with tensors x_i (minus the base when one is given: then task vectors) and
weights w_i (divided by their sum when ``normalize_weights``): the directions u_i = x_i / (|x_i| + eps)
are averaged with the weights and normalised (m); each is projected onto the tangent space at m,
v_i = u_i - <u_i, m> m; their weighted sum v is mapped back by the exponential map,
cos(|v|) m + sin(|v|) v / |v| (|v| + eps in both), and scaled by the weighted mean norm sum_i w_i |x_i|
(plus the base). Two tensors whose weighted mean direction vanishes (|m| < eps: antipodal with equal
weights) fall back to the weighted sum; more are refused, unless all of them are zero (every model equals the
base at this position: the result is the base, where mergekit 0.1.5 raises). One tensor is returned as it is.

This is mergekit 0.1.5's ``multislerp``. A base is used only with ``task_vectors=true`` (mergekit: whenever
``base_model`` is set), so that the result never depends on whether the caller happened to load one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from mergescope.errors import MergescopeError
from mergescope.merge._common import as_weights, check_number, check_tensors, check_weights, task_vector_base, work_dtype
from mergescope.merge._mergekit import MK, per_model
from mergescope.registry import merges

OP = "multislerp"


def _check(kwargs: Mapping, context: Mapping) -> None:
    n_models = context.get("n_models")
    check_weights(OP, kwargs.get("weights"), n_models)
    w = kwargs.get("weights")
    if kwargs.get("normalize_weights", True) and w is not None and abs(sum(float(x) for x in w)) < 1e-12:
        raise MergescopeError(f"merge '{OP}' weights sum to 0 with normalize_weights=true: change the weights")
    check_number(OP, "eps", kwargs.get("eps", 1e-8))


def _mk(kw, n, has_base):
    return MK("multislerp", {"normalize_weights": bool(kw.get("normalize_weights", True)), "eps": float(kw.get("eps", 1e-8))},
              per_model(n, weight=kw.get("weights") or 1.0), base="base" if has_base and kw.get("task_vectors") else None)


@merges.register(OP, needs_base=False, check=_check, mergekit=_mk, reference="https://goddard.blog/posts/multislerp-wow-what-a-cool-idea",
                 order=90)
def multislerp(
    tensors: list[Tensor],
    base: Tensor | None,
    weights: list[float] | None = None,
    normalize_weights: bool = True,
    eps: float = 1e-8,
    task_vectors: bool = False,
) -> Tensor:
    """Spherical barycentre of the tensors (task vectors with a base), scaled by the weighted mean norm."""
    base = task_vector_base(OP, base, task_vectors)
    check_tensors(OP, tensors, base)
    _check({"weights": weights, "normalize_weights": normalize_weights, "eps": eps}, {"n_models": len(tensors)})
    if len(tensors) == 1:
        return tensors[0]
    dt = work_dtype(tensors[0])
    b = base.to(dt) if base is not None else None
    x = torch.stack([t.to(dt) for t in tensors])
    if b is not None:
        x.sub_(b)
    flat = x.reshape(x.shape[0], -1)
    w = torch.tensor(as_weights(weights, len(tensors)), dtype=dt, device=x.device)
    if normalize_weights:
        w = w / w.sum()
    norms = torch.linalg.vector_norm(flat, dim=-1, keepdim=True)
    units = flat / (norms + eps)
    m = (units * w.view(-1, 1)).sum(0)
    mn = torch.linalg.vector_norm(m)
    if float(mn) < eps:
        if x.shape[0] != 2 and float(norms.max()) > eps:
            raise MergescopeError(
                f"merge '{OP}': the weighted mean direction of the tensors is zero (antipodal tensors with balancing "
                "weights): change merge.weights"
            )
        out = (flat * w.view(-1, 1)).sum(0).view(x.shape[1:])
    else:
        m = m / mn
        tang = units - (units * m).sum(-1, keepdim=True) * m
        v = (tang * w.view(-1, 1)).sum(0)
        vn = torch.linalg.vector_norm(v) + eps
        out = (m * torch.cos(vn) + v * (torch.sin(vn) / vn)) * (norms.squeeze(-1) * w).sum()
        out = out.view(x.shape[1:])
    if b is not None:
        out = out + b
    return out.to(tensors[0].dtype)
