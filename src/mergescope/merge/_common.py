"""Shared helpers for merge operators (not a plug-in module: leading underscore)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mergescope.errors import MergescopeError


def work_dtype(t: Tensor) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def check_tensors(op: str, tensors: Sequence[Tensor], base: Tensor | None = None) -> None:
    if len(tensors) == 0:
        raise MergescopeError(f"merge '{op}' got no tensors: pass at least one model")
    shape = tensors[0].shape
    for t in list(tensors[1:]) + ([base] if base is not None else []):
        if t.shape != shape:
            raise MergescopeError(
                f"merge '{op}' got tensors of shapes {tuple(shape)} and {tuple(t.shape)}: merge only tensors of equal shape"
            )


def check_weights(op: str, weights: Sequence[float] | None, n_models: int | None) -> None:
    if weights is None:
        return
    if isinstance(weights, (str, bytes)) or not hasattr(weights, "__len__"):
        raise MergescopeError(f"merge '{op}' weights must be a list of numbers: set merge.weights=[w1,w2,...]")
    if n_models is not None and len(weights) != n_models:
        raise MergescopeError(
            f"merge '{op}' has {len(weights)} weights for {n_models} models: give one weight per model (or weights=null)"
        )


def resolve_weights(op: str, weights: Sequence[float] | None, n: int, dtype, device) -> Tensor:
    check_weights(op, weights, n)
    w = [1.0] * n if weights is None else [float(x) for x in weights]
    return torch.tensor(w, dtype=dtype, device=device)
