"""Model Breadcrumbs (Davari & Belilovsky, 2023): task vectors with both tails of |delta| masked out.

Per tensor of ``numel`` entries, each task vector delta_i = theta_i - base is sorted by |delta_i|; the
``gamma`` share with the largest magnitudes (outliers) and the smallest ones are dropped so that a
``density`` share is kept: k = floor(density * numel) entries kept, n_top = floor(gamma * numel) dropped
at the top, the rest (n_bot = max(0, numel - k - n_top)) at the bottom -- when k + n_top exceed numel the
top drop shrinks so that k entries are still kept. ``density`` >= 1 keeps everything (no outlier drop
either), as mergekit 0.1.5. The kept task vectors are weighted and summed, optionally sign-elected
(``consensus=sign``: the ``breadcrumbs_ties`` preset) and divided by the (kept) weights (``normalize``),
by the one combination rule of :func:`mergescope.merge.task_arithmetic.combine_task_vectors`.

This is mergekit 0.1.5's ``breadcrumbs`` / ``breadcrumbs_ties`` (``magnitude_outliers``); the two
departures, both only at ties or float noise: the counts round float noise off first (0.29 * 100 keeps
29, where ``int()`` gives 28), and entries tied in |delta| are ordered by position (a stable sort).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from mergescope.errors import MergescopeError
from mergescope.merge._common import (
    as_weights,
    check_choice,
    check_fraction,
    check_number,
    check_tensors,
    check_weights,
    keep_count_of,
    work_dtype,
)
from mergescope.merge._mergekit import MK, per_model
from mergescope.merge.trim import zero_where_not
from mergescope.merge.task_arithmetic import rescale_kept, combine_task_vectors
from mergescope.registry import merges

OP = "breadcrumbs"
CONSENSUS = ("none", "sign", "count")
RESCALE = ("none", "l1")


def _check(kwargs: Mapping, context: Mapping) -> None:
    n_models = context.get("n_models")
    check_weights(OP, kwargs.get("weights"), n_models)
    check_fraction(OP, "density", kwargs.get("density", 0.9))
    gamma = kwargs.get("gamma", 0.01)
    check_number(OP, "gamma", gamma)
    if not 0.0 <= float(gamma) < 1.0:
        raise MergescopeError(f"merge '{OP}' gamma={gamma} is outside [0, 1): set merge.gamma in [0, 1) (the share of outliers dropped)")
    check_choice(OP, "consensus", kwargs.get("consensus", "none"), CONSENSUS)
    check_choice(OP, "rescale", kwargs.get("rescale", "none"), RESCALE)
    check_number(OP, "lambda_", kwargs.get("lambda_", 1.0))


def breadcrumbs_keep_mask(delta: Tensor, density: float, gamma: float) -> Tensor:
    """Boolean mask of the entries Breadcrumbs keeps (the rule in the module doc)."""
    n = delta.numel()
    if density >= 1 or n == 0:
        return torch.ones_like(delta, dtype=torch.bool)
    k = keep_count_of(n, density)
    n_top = keep_count_of(n, gamma)
    n_bot = max(0, n - k - n_top)
    order = torch.sort(delta.abs().reshape(-1), stable=True).indices  # ascending |delta|
    keep = torch.zeros(n, dtype=torch.bool, device=delta.device)
    keep[order[n_bot:n_bot + k]] = True
    return keep.view(delta.shape)


def _mk(kw, n, has_base):
    cons = kw.get("consensus", "none")
    if cons == "count":
        return MK(None, notes=["mergekit's breadcrumbs_ties elects signs by sum only (consensus=sign)"])
    return MK("breadcrumbs_ties" if cons == "sign" else "breadcrumbs",
              {"normalize": bool(kw.get("normalize", False)), "lambda": float(kw.get("lambda_", 1.0)),
               "rescale": kw.get("rescale", "none") == "l1"},
              per_model(n, weight=kw.get("weights") or 1.0, density=kw.get("density", 0.9), gamma=kw.get("gamma", 0.01)))


@merges.register(OP, needs_base=True, check=_check, mergekit=_mk, reference="https://arxiv.org/abs/2312.06795", order=40)
def breadcrumbs(
    tensors: list[Tensor],
    base: Tensor | None,
    weights: list[float] | None = None,
    density: float = 0.9,
    gamma: float = 0.01,
    consensus: str = "none",
    rescale: str = "none",
    normalize: bool = False,
    lambda_: float = 1.0,
) -> Tensor:
    """base + lambda_ * combination of the Breadcrumbs-masked task vectors (module doc); ``rescale=l1`` scales
    each masked task vector back to its L1 norm (mergekit's ``rescale: true``)."""
    if base is None:
        raise MergescopeError(f"merge '{OP}' needs a common base model (task vectors theta - theta_base): use linear or slerp")
    check_tensors(OP, tensors, base)
    _check(dict(weights=weights, density=density, gamma=gamma, consensus=consensus, rescale=rescale, lambda_=lambda_), {"n_models": len(tensors)})
    dt = work_dtype(base)
    b = base.to(dt)
    w = as_weights(weights, len(tensors))
    deltas: list[Tensor | None] = []
    for x, wi in zip(tensors, w):
        d = torch.sub(x.to(dt), b)
        if density < 1:
            before = d.abs().sum() if rescale == "l1" else None
            zero_where_not(d, breadcrumbs_keep_mask(d, float(density), float(gamma)))
            rescale_kept(d, before, float(density), rescale)
        if wi != 1.0:
            d.mul_(wi)
        deltas.append(d)
    return combine_task_vectors(deltas, w, b, consensus, normalize, float(lambda_)).to(base.dtype)
