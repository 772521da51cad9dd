"""RegMean (Jin et al., 2023, "Dataless Knowledge Fusion by Merging Weights of Language Models"): each linear
layer's merged weight is the least-squares fit of every model's outputs on that model's own inputs.

For a linear weight W_i (out x in, y = x W_i^T) with the inner-product matrix of its inputs G_i = X_i^T X_i (in x in,
summed over model i's tokens), W* = argmin_W sum_i ||X_i W^T - X_i W_i^T||^2 = (sum_i G_i)^-1 sum_i G_i W_i^T,
transposed. ``alpha`` scales the off-diagonal of every G_i (the paper's regularisation: G_i <- alpha G_i +
(1 - alpha) diag(G_i); alpha = 1 is the exact regression, alpha = 0 a per-input-feature weighted average). Solved in
float64. A linear layer with a bias (Qwen2's q/k/v) is solved as the augmented layer y = [x, 1] [W, b]^T: G_i is then
the Gram of [X_i, 1] (its last row and column the column sums of X_i and the token count; the off-diagonal rule
applies to it as to any G_i), the tensors are [W_i, b_i], and the weight and the bias are the columns of the one
solution (``merge.merge_state_dicts``), so W* and b* minimise sum_i ||X_i W^T + 1 b^T - X_i W_i^T - 1 b_i^T||^2
together. Every other tensor that is not a linear weight with its statistics (embeddings, norms; a head tied to the
embedding) is the plain average, as in the paper. The statistics come from each model's own data
(``mergescope.native.stats``, ``merge_stats.split``), disjoint from the split the merged model is scored on.
mergekit has no equivalent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from mergescope.errors import MergescopeError
from mergescope.merge._common import check_tensors
from mergescope.registry import merges

OP = "regmean"


def _check(kwargs: Mapping, context: Mapping) -> None:
    a = kwargs.get("alpha", 0.9)
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= float(a) <= 1.0:
        raise MergescopeError(f"merge 'regmean' alpha={a!r} is outside [0, 1]: set merge.alpha (the paper: 0.9)")


def mean_of(tensors: Sequence[Tensor]) -> Tensor:
    dt = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
    return (sum(t.to(dt) for t in tensors) / len(tensors)).to(tensors[0].dtype)


@merges.register(OP, needs_base=False, check=_check, needs_stats="gram", n_positional=3,
                 reference="https://arxiv.org/abs/2212.09849", order=90)
def regmean(tensors: list[Tensor], base: Tensor | None, stats: Sequence[Tensor | None] | None, alpha: float = 0.9) -> Tensor:
    """(sum_i G~_i)^-1 sum_i G~_i W_i^T (transposed) for a linear weight with every model's input Gram ``stats``;
    the mean otherwise (module doc)."""
    check_tensors(OP, tensors)
    if stats is None or any(g is None for g in stats) or tensors[0].dim() != 2:
        return mean_of(tensors)
    n_in = tensors[0].shape[1]
    if any(tuple(g.shape) != (n_in, n_in) for g in stats):
        raise MergescopeError(f"merge 'regmean': an input Gram of shape {tuple(stats[0].shape)} does not fit a weight of "
                              f"{n_in} inputs")
    a = float(alpha)
    lhs = torch.zeros(n_in, n_in, dtype=torch.float64, device=tensors[0].device)
    rhs = torch.zeros(n_in, tensors[0].shape[0], dtype=torch.float64, device=tensors[0].device)
    for w, g in zip(tensors, stats):
        g = g.to(device=w.device, dtype=torch.float64)
        g = a * g + (1.0 - a) * torch.diag(torch.diagonal(g))
        lhs += g
        rhs += g @ w.to(torch.float64).T
    try:
        out = torch.linalg.solve(lhs, rhs)
    except RuntimeError:  # an input feature no model's data ever used (a zero row and column): least squares
        out = torch.linalg.lstsq(lhs, rhs, driver="gelsd").solution
    return out.T.contiguous().to(tensors[0].dtype)
