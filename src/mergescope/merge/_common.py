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


def check_choice(op: str, key: str, value, choices) -> None:
    if value not in choices:
        raise MergescopeError(f"merge '{op}' {key}={value!r} is not one of {', '.join(choices)}: set merge.{key}=<one of them>")


def check_number(op: str, key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MergescopeError(f"merge '{op}' {key}={value!r} is not a number: set merge.{key}=<number>")


def check_seed(op: str, seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise MergescopeError(f"merge '{op}' seed={seed!r} is not an integer: set merge.seed=<int>")


def check_fraction(op: str, key: str, value, low_open: bool = True) -> None:
    """``value`` is a number in (0, 1] (``low_open``) or [0, 1]."""
    check_number(op, key, value)
    v = float(value)
    if not ((0.0 < v if low_open else 0.0 <= v) and v <= 1.0):
        span = "(0, 1]" if low_open else "[0, 1]"
        raise MergescopeError(f"merge '{op}' {key}={value} is outside {span}: set merge.{key} in {span}")


def check_n_models(op: str, n_models: int | None, low: int, high: int | None = None, why: str = "") -> None:
    if n_models is None:
        return
    if n_models < low or (high is not None and n_models > high):
        want = f"exactly {low}" if high == low else (f"at least {low}" if high is None else f"{low} to {high}")
        raise MergescopeError(f"merge '{op}' merges {want} models, got {n_models}{why}")


def as_weights(weights: Sequence[float] | None, n: int) -> list[float]:
    return [1.0] * n if weights is None else [float(x) for x in weights]


def bernoulli_mask(probs: Tensor, gen: torch.Generator) -> Tensor:
    """A boolean keep-mask with P(keep) = ``probs``, drawn on CPU in float32 from ``gen`` (the same draws as
    mergekit's ``torch.bernoulli(probs)`` under ``torch.manual_seed``, whatever the device), on probs' device."""
    draw = torch.bernoulli(probs.detach().to(device="cpu", dtype=torch.float32), generator=gen)
    return draw.to(device=probs.device, dtype=torch.bool)


def keep_count_of(numel: int, share: float) -> int:
    """floor(share * numel) with float noise rounded off first (0.29 * 100 is 29), as the TIES trim counts."""
    import math

    return max(0, min(int(numel), math.floor(round(float(share) * int(numel), 6))))


def task_vector_base(op: str, base, task_vectors: bool):
    """The base a spherical operator works around: the given base with ``task_vectors=true`` (refused without one), else
    none (the operator then interpolates the weights themselves, whether or not the caller loaded a base)."""
    if task_vectors and base is None:
        raise MergescopeError(f"merge '{op}' task_vectors=true needs a common base model: set native.base (or task_vectors=false)")
    return base if task_vectors else None
