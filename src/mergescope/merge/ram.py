"""RAM (Reinforced Agent Merging) and RAM+ tensor-local: task vectors averaged only where they overlap.

For one tensor position with base w_0 and models w_1..w_N: the task vectors d_i = w_i - w_0, each entry counted as
changed by model i when |d_i| > ``epsilon`` (unchanged entries are zeroed), c = the number of models that changed the
entry. ``ram``: result = w_0 + (the changed d_i's entry where c = 1; the mean of the changed entries where c > 1; 0
where c = 0) -- a plain average would dilute an update only one model made by 1/N.

``ramplus_tl`` scales each model's unique entries (c = 1) by lambda_i = 1 + r clip(rho_i, 0, alpha), rho_i = (the
number of model i's changed entries that are shared, c > 1) / max(the number of its unique ones, epsilon): a model
whose updates mostly overlap the others' gets its few unique ones boosted, by at most r alpha. The shared entries are
averaged as in ``ram``. Tensor-local: rho_i is counted within each tensor.

These are mergekit 0.1.5's ``ram`` and ``ramplus_tl`` (reference https://arxiv.org/abs/2601.13572, the paper mergekit
cites for both; its RAM+ counts overlap over the whole model, mergekit's ``_tl`` variant -- this one -- per tensor).
No weights (the method weighs the models by their overlap); one or more models and a common base.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from mergescope.errors import MergescopeError
from mergescope.merge._common import check_n_models, check_number, check_tensors, work_dtype
from mergescope.merge._mergekit import MK, per_model
from mergescope.registry import merges

REF = "https://arxiv.org/abs/2601.13572"


def _check_eps(op: str, kwargs: Mapping) -> None:
    eps = kwargs.get("epsilon", 1e-5)
    check_number(op, "epsilon", eps)
    if float(eps) < 0:
        raise MergescopeError(f"merge '{op}' epsilon={eps} is negative: set merge.epsilon >= 0 (the change that counts)")


def _check_ram(kwargs: Mapping, context: Mapping) -> None:
    check_n_models("ram", context.get("n_models"), 1, why=" besides the base")
    _check_eps("ram", kwargs)


def _check_plus(kwargs: Mapping, context: Mapping) -> None:
    check_n_models("ramplus_tl", context.get("n_models"), 1, why=" besides the base")
    _check_eps("ramplus_tl", kwargs)
    for key, default in (("r", 0.1), ("alpha", 0.2)):
        v = kwargs.get(key, default)
        check_number("ramplus_tl", key, v)
        if float(v) < 0:
            raise MergescopeError(f"merge 'ramplus_tl' {key}={v} is negative: set merge.{key} >= 0")


def _mk_ram(kw, n, has_base):
    return MK("ram", {"epsilon": float(kw.get("epsilon", 1e-5))}, per_model(n))


def _mk_plus(kw, n, has_base):
    return MK("ramplus_tl", {"r": float(kw.get("r", 0.1)), "alpha": float(kw.get("alpha", 0.2)),
                             "epsilon": float(kw.get("epsilon", 1e-5))}, per_model(n))


def _changes(op: str, tensors: list[Tensor], base: Tensor | None, epsilon: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(w_0, the task vectors with unchanged entries zeroed (N x numel), which entries each model changed, c)."""
    if base is None:
        raise MergescopeError(f"merge '{op}' needs a common base model (task vectors theta - theta_base): use linear or slerp")
    check_tensors(op, tensors, base)
    dt = work_dtype(base)
    b = base.to(dt)
    d = torch.stack([x.to(dt).reshape(-1) - b.reshape(-1) for x in tensors])
    changed = d.abs() > float(epsilon)
    return b, torch.where(changed, d, torch.zeros_like(d)), changed, changed.sum(dim=0)


@merges.register("ram", needs_base=True, check=_check_ram, mergekit=_mk_ram, reference=REF, order=98)
def ram(tensors: list[Tensor], base: Tensor | None, epsilon: float = 1e-5) -> Tensor:
    """w_0 + the changed task-vector entries, averaged over the models that changed them (module doc)."""
    _check_ram({"epsilon": epsilon}, {"n_models": len(tensors)})
    b, d, _, count = _changes("ram", tensors, base, epsilon)
    merged = d.sum(dim=0) / count.clamp(min=1).to(d.dtype)
    return (b + merged.reshape(b.shape)).to(base.dtype)


@merges.register("ramplus_tl", needs_base=True, check=_check_plus, mergekit=_mk_plus, reference=REF, order=99)
def ramplus_tl(tensors: list[Tensor], base: Tensor | None, r: float = 0.1, alpha: float = 0.2, epsilon: float = 1e-5) -> Tensor:
    """``ram`` with each model's unique entries scaled by 1 + r clip(shared_i / unique_i, 0, alpha) (module doc)."""
    _check_plus({"epsilon": epsilon, "r": r, "alpha": alpha}, {"n_models": len(tensors)})
    b, d, changed, count = _changes("ramplus_tl", tensors, base, epsilon)
    unique = count == 1
    n_unique = (changed & unique).sum(dim=1).to(d.dtype)
    n_shared = (changed & (count > 1)).sum(dim=1).to(d.dtype)
    lam = 1 + float(r) * (n_shared / n_unique.clamp(min=float(epsilon))).clamp(min=0.0, max=float(alpha))
    scale = torch.where(unique, lam.unsqueeze(1), 1 / count.clamp(min=1).to(d.dtype))
    merged = (d * scale).sum(dim=0)
    return (b + merged.reshape(b.shape)).to(base.dtype)
