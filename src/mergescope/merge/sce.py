"""SCE (Wan et al., FuseChat, 2024): Select, Calculate, Erase on task vectors; no user weights.

For one tensor position with task vectors delta_i = theta_i - base (i = 1..N):

1. **Select** (``select_topk`` < 1): the entries whose task vectors vary most across the models are kept,
   the same entries in every model: the variance over models (population, /N) per entry, the top
   k = floor(select_topk * #(entries of non-zero variance)) of it; the other entries are zeroed.
2. **Calculate**: model i's weight is the mean of its (selected) squared task vector, the weights divided
   by their sum (a sum below 1e-6 -- mergekit's absolute threshold -- gives equal weights 1/N).
3. **Erase**: per entry, the elected sign is sign(sum_i delta_i) (ties +); entries of another sign (and
   zeros) are erased, i.e. leave the weighted mean.
4. result = base + sum_i w_i [kept_i] delta_i / max(sum_i w_i [kept_i], 1e-6).

This is mergekit 0.1.5's ``sce`` (``int8_mask`` is a memory option there, not a parameter here); the
departures only at ties or float noise: k rounds float noise off first (as the TIES trim), and entries tied
in variance are ranked by position (stable sort) where ``topk`` picks arbitrarily.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from mergescope.errors import MergescopeError
from mergescope.merge._common import check_fraction, check_tensors, keep_count_of, work_dtype
from mergescope.merge._mergekit import MK, per_model
from mergescope.merge.trim import zero_where_not
from mergescope.registry import merges

OP = "sce"


def _check(kwargs: Mapping, context: Mapping) -> None:
    check_fraction(OP, "select_topk", kwargs.get("select_topk", 1.0))


def sce_select_mask(deltas: Tensor, share: float) -> Tensor:
    """The entries Select keeps (step 1), boolean, shape of one task vector; ``deltas`` is (N, ...)."""
    var = deltas.var(dim=0, unbiased=False)
    if share >= 1:
        return torch.ones_like(var, dtype=torch.bool)
    k = keep_count_of(int(torch.count_nonzero(var)), share)
    keep = torch.zeros(var.numel(), dtype=torch.bool, device=var.device)
    if k > 0:
        order = torch.sort(var.reshape(-1), descending=True, stable=True).indices
        keep[order[:k]] = True
    return keep.view(var.shape)


def _mk(kw, n, has_base):
    return MK("sce", {"select_topk": float(kw.get("select_topk", 1.0))}, per_model(n))


@merges.register(OP, needs_base=True, check=_check, mergekit=_mk, reference="https://arxiv.org/abs/2408.07990", order=60)
def sce(tensors: list[Tensor], base: Tensor | None, select_topk: float = 1.0) -> Tensor:
    """base + the SCE-weighted, sign-erased mean of the selected task vectors (module doc)."""
    if base is None:
        raise MergescopeError(f"merge '{OP}' needs a common base model (task vectors theta - theta_base): use linear or slerp")
    check_tensors(OP, tensors, base)
    _check({"select_topk": select_topk}, {"n_models": len(tensors)})
    dt = work_dtype(base)
    b = base.to(dt)
    deltas = torch.stack([x.to(dt) - b for x in tensors])
    if select_topk < 1:
        zero_where_not(deltas, sce_select_mask(deltas, float(select_topk)))
    n = deltas.shape[0]
    w = deltas.square().reshape(n, -1).mean(dim=1)
    total = float(w.sum())
    w = torch.full_like(w, 1.0 / n) if abs(total) < 1e-6 else w / total
    elected = torch.where(deltas.sum(dim=0) >= 0, 1.0, -1.0).to(dt)
    kept_w = (torch.sign(deltas) == elected).to(dt) * w.view(-1, *([1] * (deltas.dim() - 1)))
    merged = (deltas * kept_w).sum(dim=0) / kept_w.sum(dim=0).clamp(min=1e-6)
    return (b + merged).to(base.dtype)
