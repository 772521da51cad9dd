"""The one device rule: ``auto`` = CUDA when present; an explicit CUDA device must exist."""

from __future__ import annotations

import torch

from mergescope.errors import MergescopeError


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    if isinstance(device, torch.device):
        return device
    name = "auto" if device is None else str(device).lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise MergescopeError(f"device={device} was asked for but CUDA is not available; use device=auto or device=cpu")
    return torch.device(name)
