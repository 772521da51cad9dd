"""Shared helpers for metrics: float64 tensors on the chosen device."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mergescope.device import resolve_device
from mergescope.errors import MergescopeError


def as_f64(X: Any, device: str | torch.device | None = "auto") -> torch.Tensor:
    """A 2-D float64 tensor on ``device`` from a numpy array or tensor."""
    dev = resolve_device(device)
    if isinstance(X, torch.Tensor):
        t = X.detach().to(device=dev, dtype=torch.float64)
    else:
        t = torch.as_tensor(np.asarray(X), dtype=torch.float64, device=dev)
    if t.ndim != 2:
        raise MergescopeError(f"expected a 2-D array (sentences x features), got shape {tuple(t.shape)}")
    return t


def pair_f64(X: Any, Y: Any, device: str | torch.device | None = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    x, y = as_f64(X, device), as_f64(Y, device)
    if x.shape[0] != y.shape[0]:
        raise MergescopeError(
            f"the two sides have {x.shape[0]} and {y.shape[0]} rows; rows must be the same sentences"
        )
    if x.shape[0] < 3:
        raise MergescopeError(f"need at least 3 sentences, got {x.shape[0]}")
    return x, y


def center(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean(dim=0, keepdim=True)
