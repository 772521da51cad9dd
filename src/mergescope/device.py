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


def set_threads(n: int) -> None:
    """``n`` CPU threads for torch and for numpy/scipy's BLAS (OpenBLAS, through threadpoolctl): the configured
    ``num_threads``. The BLAS pool too: with torch at one thread numpy's OpenBLAS still started one per core, and on
    this 2-core box the shared-space PCAs (a Gram product and an eigendecomposition) measured 0.95 s on one BLAS
    thread against 1.27 s on two (benchmarks/bench_gpa.py)."""
    import threadpoolctl

    torch.set_num_threads(int(n))
    threadpoolctl.threadpool_limits(int(n), user_api="blas")
