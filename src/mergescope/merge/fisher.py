"""Fisher merging (Matena & Raffel, 2022, "Merging Models with Fisher-Weighted Averaging"): every parameter the
average of the models' values weighted by each model's diagonal Fisher information there.

theta* = sum_i w_i F_i theta_i / sum_i w_i F_i, elementwise, with F_i the diagonal empirical Fisher of model i on its
own data: the mean over sentences of the squared gradient of the sentence's log-likelihood
(``mergescope.native.stats``, ``merge_stats.split``, disjoint from the split the merged model is scored on).
``floor`` is added to every F_i (the paper's and FusionBench's guard against a parameter no example moves: there the
result falls back to the weighted average). ``weights`` (one per model, default equal) are the paper's lambda_i. A
tensor without statistics is the weighted average. mergekit has no equivalent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from mergescope.errors import MergescopeError
from mergescope.merge._common import check_tensors, check_weights, resolve_weights
from mergescope.registry import merges

OP = "fisher"


def _check(kwargs: Mapping, context: Mapping) -> None:
    check_weights(OP, kwargs.get("weights"), context.get("n_models"))
    f = kwargs.get("floor", 1e-6)
    if isinstance(f, bool) or not isinstance(f, (int, float)) or float(f) <= 0:
        raise MergescopeError(f"merge 'fisher' floor={f!r} must be a positive number: set merge.floor (e.g. 1e-6)")


@merges.register(OP, needs_base=False, check=_check, needs_stats="fisher", n_positional=3,
                 reference="https://arxiv.org/abs/2111.09832", order=91)
def fisher(tensors: list[Tensor], base: Tensor | None, stats: Sequence[Tensor | None] | None,
           weights: list[float] | None = None, floor: float = 1e-6) -> Tensor:
    """sum_i w_i (F_i + floor) theta_i / sum_i w_i (F_i + floor) with ``stats`` the models' diagonal Fishers; the
    weighted average where a model has none (module doc)."""
    check_tensors(OP, tensors)
    w = resolve_weights(OP, weights, len(tensors), torch.float64, "cpu").tolist()
    have = stats is not None and all(f is not None for f in stats)
    num = torch.zeros(tensors[0].shape, dtype=torch.float64, device=tensors[0].device)
    den = torch.zeros_like(num)
    for i, t in enumerate(tensors):
        f = stats[i].to(device=t.device, dtype=torch.float64) + float(floor) if have else torch.ones_like(num)
        if f.shape != t.shape:
            raise MergescopeError(f"merge 'fisher': a Fisher of shape {tuple(f.shape)} for a tensor of {tuple(t.shape)}")
        num += w[i] * f * t.to(torch.float64)
        den += w[i] * f
    return (num / den).to(tensors[0].dtype)
