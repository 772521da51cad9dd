"""Mutual k-nearest-neighbour alignment (Huh et al. 2024, platonic representations)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mergescope.errors import MergescopeError
from mergescope.metrics._common import pair_f64
from mergescope.registry import metrics


def _knn_mask(x: torch.Tensor, k: int) -> torch.Tensor:
    z = torch.nn.functional.normalize(x, dim=1)
    sim = z @ z.T
    sim.fill_diagonal_(float("-inf"))
    idx = sim.topk(k, dim=1).indices
    mask = torch.zeros_like(sim, dtype=torch.bool)
    mask.scatter_(1, idx, True)
    return mask


def mutual_knn(X: Any, Y: Any, k: int = 10, device: str = "auto") -> float:
    """Mean over sentences of |kNN_X(i) & kNN_Y(i)| / k, cosine neighbours, self excluded."""
    x, y = pair_f64(X, Y, device)
    if not 1 <= k < x.shape[0]:
        raise ValueError(f"k must be in [1, n-1={x.shape[0] - 1}], got {k}")
    both = _knn_mask(x, k) & _knn_mask(y, k)
    return float(both.sum(dim=1).double().mean() / k)


def check_knn(kwargs: Mapping[str, Any], context: Mapping[str, Any]) -> None:
    n, k = context.get("n"), kwargs.get("k", 10)
    if n is not None and not 1 <= int(k) < n:
        raise MergescopeError(f"metric.k={k} must be in [1, {n - 1}]: neighbours among {n} sentences exclude the sentence "
                              "itself; lower metric.k or use more sentences")


@metrics.register("mutual_knn", check=check_knn, order=5, higher_is_better=True,
                  reference="https://arxiv.org/abs/2405.07987")
def mutual_knn_metric(X: Any, Y: Any, k: int = 10, device: str = "auto") -> dict[str, float]:
    return {"mutual_knn": mutual_knn(X, Y, k=k, device=device), "mutual_knn_chance": k / (len(X) - 1)}
