"""Model Stock (Jang et al., 2024): the fine-tuned models' average pulled toward the base by their angle.

For one tensor position with base w_0 and N >= 2 fine-tuned models w_1..w_N: the offsets d_i = w_i - w_0,
cos = the mean over the N(N-1)/2 pairs of cos(d_i, d_j) (each |d_i||d_j| floored at 1e-6, each cosine
clipped to [-1, 1]), t = N cos / (1 + (N - 1) cos), and result = t * mean_i w_i + (1 - t) w_0. Where
|1 + (N - 1) cos| < 1e-6 (no finite estimate) the base is kept (t = 0). ``filter_wise``: one t per row
(the last dimension is the vector; a 1-d tensor is one row) instead of one per tensor.

This is mergekit 0.1.5's ``model_stock`` (its ``filter_wise`` too). No per-model weights: the paper's
estimate weights the models equally (mergekit has none either).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from mergescope.errors import MergescopeError
from mergescope.merge._common import check_n_models, check_tensors, work_dtype
from mergescope.merge._mergekit import MK, per_model
from mergescope.registry import merges

OP = "model_stock"


def _check(kwargs: Mapping, context: Mapping) -> None:
    n_models = context.get("n_models")
    check_n_models(OP, n_models, 2, why=" besides the base: the angle between task vectors needs two of them")


def _mk(kw, n, has_base):
    return MK("model_stock", {"filter_wise": bool(kw.get("filter_wise", False))}, per_model(n))


@merges.register(OP, needs_base=True, check=_check, mergekit=_mk, reference="https://arxiv.org/abs/2403.19522", order=70)
def model_stock(tensors: list[Tensor], base: Tensor | None, filter_wise: bool = False) -> Tensor:
    """t * average + (1 - t) * base with t from the mean pairwise cosine of the task vectors (module doc)."""
    if base is None:
        raise MergescopeError(f"merge '{OP}' needs a common base model (task vectors theta - theta_base): use linear or slerp")
    check_tensors(OP, tensors, base)
    _check({}, {"n_models": len(tensors)})
    dt = work_dtype(base)
    b = base.to(dt)
    shape = b.shape
    if filter_wise:
        rows = (lambda x: x.reshape(1, -1)) if b.dim() < 2 else (lambda x: x)
    else:
        rows = lambda x: x.reshape(-1)  # noqa: E731
    w0 = rows(b)
    ws = [rows(x.to(dt)) for x in tensors]
    ds = [w - w0 for w in ws]
    norms = [torch.linalg.vector_norm(d, dim=-1) for d in ds]
    cos_sum, pairs = torch.zeros_like(norms[0]), 0
    for i in range(len(ds)):
        for j in range(i + 1, len(ds)):
            c = (ds[i] * ds[j]).sum(dim=-1) / (norms[i] * norms[j]).clamp(min=1e-6)
            cos_sum = cos_sum + c.clamp(-1, 1)
            pairs += 1
    cos = (cos_sum / pairs).unsqueeze(-1)
    n = len(ds)
    den = 1 + (n - 1) * cos
    singular = den.abs() < 1e-6
    t = torch.where(singular, torch.zeros_like(cos), n * cos / torch.where(singular, torch.ones_like(den), den))
    avg = torch.stack(ws).sum(dim=0) / n
    return (t * avg + (1 - t) * w0).reshape(shape).to(base.dtype)
