"""Similarity calibrated against its permutation null (Groeger et al., arXiv 2602.14486; the method of the
``calibrated-similarity`` package, reimplemented here in float64 and equal to it on the same permutations).

A raw similarity is not comparable across sample sizes and widths: pure-noise features of the real models' widths
(576-1536) give raw linear CKA 0.6-0.7 at n = 256-1024, and the shuffled control of CKA sits at 0.12-0.20 at n = 96
but 0.02-0.07 at n = 1012. Calibration puts every metric on one scale:

- the null: ``K`` permutations of the rows of Y (X fixed), drawn one after another as ``torch.randperm(n)`` from one
  ``torch.Generator`` seeded with ``seed`` (the package's draw, so the same seed gives the same permutations);
- ``tau``: the ``ceil((1 - alpha) (K + 1))``-th smallest of the K + 1 values {observed, null_1 .. null_K} (an order
  statistic, no interpolation);
- ``p = (1 + #{null_k >= s}) / (K + 1)``;
- the calibrated score ``clip((s - tau) / max(smax - tau, 1e-12), 0, 1)`` (``max(s - tau, 0)`` without ``smax``):
  0 means "not above what unrelated features of this n and width give", 1 the metric's maximum.

:func:`calibrate_layers` calibrates a best-layer search: ONE permutation per draw applied to every layer of Y, the
aggregate (max by default) of the layer-by-layer matrix taken per draw, so choosing the best layer is paid for in the
null.

A metric may give a vectorised null (``register(..., null=fn)``, ``fn(X, Y, perms, **kwargs) -> (K,)``): linear and
debiased CKA, mutual k-NN and CKNNA permute precomputed n x n matrices, SVCCA and Procrustes precomputed factors,
instead of recomputing from features.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["Calibrated", "calibrate", "calibrate_layers", "calibrated_score", "draw_permutations", "permutation_seed"]


@dataclass(frozen=True)
class Calibrated:
    """A calibrated similarity: the raw score, the calibrated one, its permutation p and the null threshold tau."""

    raw: float
    calibrated: float
    p: float
    tau: float
    permutations: int

    def metrics(self, name: str) -> dict[str, float]:
        return {f"{name}_calibrated": self.calibrated, f"{name}_cal_p": self.p, f"{name}_cal_tau": self.tau}


def permutation_seed(seed: int, label: str) -> int:
    """The generator seed of a pair's calibration: its control seed and a stable CRC of its label, so every metric of a
    pair shares its permutations and two pairs do not."""
    return int(seed) * (1 << 32) + zlib.crc32(label.encode("utf-8"))


def draw_permutations(n: int, K: int, seed: int) -> list[torch.Tensor]:
    """``K`` permutations of ``range(n)``, drawn as the package draws them."""
    g = torch.Generator().manual_seed(int(seed))
    return [torch.randperm(n, generator=g) for _ in range(int(K))]


def calibrated_score(s: float, null: Sequence[float] | np.ndarray, alpha: float = 0.05,
                     smax: float | None = 1.0) -> Calibrated:
    """The calibration of an observed score ``s`` against its ``K`` null values (module doc)."""
    null = np.asarray(null, dtype=np.float64).ravel()
    k = null.size
    if k < 1:
        raise ValueError("calibration needs at least one permutation")
    if not 0 < alpha < 1:
        raise ValueError(f"calibration alpha must lie in (0, 1), got {alpha}")
    values = np.sort(np.concatenate([[s], null]))
    r = min(max(math.ceil((1.0 - alpha) * (k + 1)), 1), k + 1)
    tau = float(values[r - 1])
    p = (1.0 + float(np.sum(null >= s))) / (k + 1)
    if smax is None:
        cal = max(s - tau, 0.0)
    else:
        cal = float(np.clip((s - tau) / max(smax - tau, 1e-12), 0.0, 1.0))
    return Calibrated(float(s), cal, p, tau, k)


def calibrate(X: Any, Y: Any, sim: Callable[[Any, Any], float], K: int = 200, alpha: float = 0.05,
              smax: float | None = 1.0, seed: int = 0,
              null: Callable[[Any, Any, list[torch.Tensor]], np.ndarray] | None = None) -> Calibrated:
    """``sim(X, Y)`` calibrated against ``sim(X, Y[perm])`` over ``K`` seeded permutations (``null``: a vectorised
    evaluation of all of them at once, equal to the loop)."""
    n = len(X)
    if len(Y) != n:
        raise ValueError(f"calibrate: X has {n} rows and Y {len(Y)}")
    s = float(sim(X, Y))
    perms = draw_permutations(n, K, seed)
    if null is not None:
        values = np.asarray(null(X, Y, perms), dtype=np.float64)
    else:
        yt = Y if isinstance(Y, torch.Tensor) else np.asarray(Y)
        values = np.array([float(sim(X, yt[p.numpy()] if isinstance(yt, np.ndarray) else yt[p])) for p in perms])
    return calibrated_score(s, values, alpha, smax)


def calibrate_layers(X_layers: Sequence[Any], Y_layers: Sequence[Any], sim: Callable[[Any, Any], float],
                     agg: str | Callable[[np.ndarray], float] = "max", K: int = 200, alpha: float = 0.05,
                     smax: float | None = 1.0, seed: int = 0) -> tuple[Calibrated, np.ndarray]:
    """The aggregate (``max``, ``mean`` or a function) of the layer-by-layer similarity matrix, calibrated with one
    permutation per draw shared by every layer of Y; returns it and the observed (LA, LB) matrix."""
    fn = {"max": np.max, "mean": np.mean}.get(agg, agg) if isinstance(agg, str) else agg
    if not callable(fn):
        raise ValueError(f"calibrate_layers: agg is 'max', 'mean' or a function, got {agg!r}")
    n = len(X_layers[0])

    def matrix(perm: torch.Tensor | None) -> np.ndarray:
        out = np.empty((len(X_layers), len(Y_layers)))
        for j, y in enumerate(Y_layers):
            yp = y if perm is None else (y[perm] if isinstance(y, torch.Tensor) else np.asarray(y)[perm.numpy()])
            for i, x in enumerate(X_layers):
                out[i, j] = float(sim(x, yp))
        return out

    observed = matrix(None)
    null = [float(fn(matrix(p))) for p in draw_permutations(n, K, seed)]
    return calibrated_score(float(fn(observed)), null, alpha, smax), observed
