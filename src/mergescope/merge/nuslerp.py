"""NuSLERP: SLERP of two models set by their weights, whole tensor, row by row or column by column.

t = w_2 / (w_1 + w_2) (0.5 when the weights sum to ~0, |sum| < 1e-6). With ``task_vectors`` (and a base) the two task vectors
v_i = x_i - base are interpolated and the base added back; without, the tensors themselves. The vectors:
the whole tensor (``flatten``, default), else its rows (the last dimension) or, with ``row_wise``, its
columns (the first dimension) -- mergekit's naming. Per vector pair: cos = <v_1/|v_1|, v_2/|v_2|> (norms
floored at 1e-7), theta = arccos(cos), result = (sin((1-t) theta) v_1 + sin(t theta) v_2) / sin(theta) on the
unnormalised vectors; (anti)colinear pairs (1 - cos^2 <= 1e-16) are interpolated linearly.

This is mergekit 0.1.5's ``nuslerp`` (``nuslerp_flatten``, ``nuslerp_row_wise`` there; its base is used whenever
``base_model`` is set, ours only with ``task_vectors=true``). Exactly two models.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from mergescope.merge._common import (as_weights, check_n_models, check_tensors, check_weights, task_vector_base,
                                      work_dtype)
from mergescope.merge._mergekit import MK, per_model
from mergescope.registry import merges

OP = "nuslerp"


def _check(kwargs: Mapping, context: Mapping) -> None:
    n_models = context.get("n_models")
    check_n_models(OP, n_models, 2, 2, why=": use multislerp or karcher for more")
    check_weights(OP, kwargs.get("weights"), n_models if n_models is not None else 2)


def _slerp_vectors(t: float, v0: Tensor, v1: Tensor, eps: float = 1e-8) -> Tensor:
    """Row-wise SLERP of ``v0`` to ``v1`` along the last dimension (module doc)."""
    u0 = v0 / torch.linalg.vector_norm(v0, dim=-1, keepdim=True).clamp(min=1e-7)
    u1 = v1 / torch.linalg.vector_norm(v1, dim=-1, keepdim=True).clamp(min=1e-7)
    cos = (u0 * u1).sum(dim=-1, keepdim=True).clamp(-1, 1)
    colinear = (1 - cos.square()) <= eps**2
    theta = torch.acos(torch.where(colinear, torch.zeros_like(cos), cos))
    s = torch.sin(theta)
    sph = (torch.sin((1 - t) * theta) * v0 + torch.sin(t * theta) * v1) / torch.where(colinear, torch.ones_like(s), s)
    return torch.where(colinear, (1 - t) * v0 + t * v1, sph)


def _mk(kw, n, has_base):
    return MK("nuslerp", {"nuslerp_flatten": bool(kw.get("flatten", True)), "nuslerp_row_wise": bool(kw.get("row_wise", False))},
              per_model(n, weight=kw.get("weights") or 1.0), base="base" if has_base and kw.get("task_vectors") else None)


@merges.register(OP, needs_base=False, check=_check, mergekit=_mk, reference="https://github.com/arcee-ai/mergekit", order=95)
def nuslerp(
    tensors: list[Tensor],
    base: Tensor | None,
    weights: list[float] | None = None,
    flatten: bool = True,
    row_wise: bool = False,
    task_vectors: bool = False,
) -> Tensor:
    """SLERP of the two tensors (their task vectors with a base) at t = w_2 / (w_1 + w_2) (module doc)."""
    base = task_vector_base(OP, base, task_vectors)
    check_tensors(OP, tensors, base)
    _check({"weights": weights}, {"n_models": len(tensors)})
    w = as_weights(weights, 2)
    t = 0.5 if abs(sum(w)) < 1e-6 else w[1] / sum(w)
    dt = work_dtype(tensors[0])
    b = base.to(dt) if base is not None else None
    v0, v1 = (x.to(dt) - b if b is not None else x.to(dt) for x in tensors)
    shape = v0.shape
    if flatten or v0.dim() < 1:
        out = _slerp_vectors(t, v0.reshape(-1), v1.reshape(-1)).reshape(shape)
    elif row_wise:
        out = _slerp_vectors(t, v0.transpose(0, -1), v1.transpose(0, -1)).transpose(0, -1)
    else:
        out = _slerp_vectors(t, v0, v1)
    if b is not None:
        out = out + b
    return out.to(tensors[0].dtype)
