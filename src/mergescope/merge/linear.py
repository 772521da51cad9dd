"""Linear merge (weighted average) and SLERP: base-free operators."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from mergescope.errors import MergescopeError
from mergescope.merge._mergekit import MK, per_model
from mergescope.merge._common import check_tensors, check_weights, resolve_weights, work_dtype
from mergescope.registry import merges


def _check_linear(kwargs: Mapping, context: Mapping) -> None:
    n_models = context.get("n_models")
    check_weights("linear", kwargs.get("weights"), n_models)
    if kwargs.get("normalize", True) and kwargs.get("weights") is not None:
        if abs(sum(float(x) for x in kwargs["weights"])) < 1e-12:
            raise MergescopeError("merge 'linear' weights sum to 0 with normalize=true: change the weights or set normalize=false")


def _mk_linear(kw, n, has_base):
    return MK("linear", {"normalize": bool(kw.get("normalize", True))}, per_model(n, weight=kw.get("weights") or 1.0), base=None)


def _mk_slerp(kw, n, has_base):
    return MK("slerp", {"t": float(kw.get("t", 0.5))}, per_model(n), base="first",
              notes=[] if float(kw.get("dot_threshold", 0.9995)) == 0.9995 and float(kw.get("eps", 1e-8)) == 1e-8
              else ["mergekit's slerp has fixed dot_threshold 0.9995 and eps 1e-8"])


@merges.register("linear", needs_base=False, check=_check_linear, mergekit=_mk_linear, reference="https://arxiv.org/abs/2203.05482", order=10)
def linear(
    tensors: list[Tensor],
    base: Tensor | None,
    weights: list[float] | None = None,
    normalize: bool = True,
) -> Tensor:
    """sum_i w_i theta_i (divided by sum_i w_i when ``normalize``); equal weights by default.

    Same definition as mergekit's ``linear``. ``base`` is ignored.
    """
    check_tensors("linear", tensors)
    _check_linear({"weights": weights, "normalize": normalize}, {"n_models": len(tensors)})
    dt = work_dtype(tensors[0])
    w = resolve_weights("linear", weights, len(tensors), dt, "cpu").tolist()
    out = torch.zeros(tensors[0].shape, dtype=dt, device=tensors[0].device)
    for t, wi in zip(tensors, w):
        out.add_(t.to(dt), alpha=wi)
    if normalize:
        out.div_(sum(w))
    return out.to(tensors[0].dtype)


def _check_slerp(kwargs: Mapping, context: Mapping) -> None:
    n_models = context.get("n_models")
    t = kwargs.get("t", 0.5)
    if not isinstance(t, (int, float)) or not 0.0 <= float(t) <= 1.0:
        raise MergescopeError(f"merge 'slerp' t={t!r} is outside [0, 1]: set merge.t to a number in [0, 1]")
    if n_models is not None and n_models != 2:
        raise MergescopeError(f"merge 'slerp' interpolates exactly 2 models, got {n_models}: use linear for more models")
    if not 0.0 < float(kwargs.get("dot_threshold", 0.9995)) <= 1.0:
        raise MergescopeError("merge 'slerp' dot_threshold must be in (0, 1]: e.g. merge.dot_threshold=0.9995")


@merges.register("slerp", needs_base=False, check=_check_slerp, mergekit=_mk_slerp, reference="https://en.wikipedia.org/wiki/Slerp", order=11)
def slerp(
    tensors: list[Tensor],
    base: Tensor | None,
    t: float = 0.5,
    dot_threshold: float = 0.9995,
    eps: float = 1e-8,
) -> Tensor:
    """Spherical interpolation from ``tensors[0]`` (t=0) to ``tensors[1]`` (t=1), whole tensor at once.

    theta = arccos(<a/|a|, b/|b|>); result = sin((1-t)theta)/sin(theta) a + sin(t theta)/sin(theta) b
    on the unnormalised tensors. When |cos theta| > ``dot_threshold`` (parallel or antiparallel)
    it falls back to linear (1-t) a + t b. Norms below ``eps`` count as 1. This is mergekit's
    ``slerp`` (0.1.5) with ``tensors[0]`` in the role of its base model.
    """
    check_tensors("slerp", tensors)
    _check_slerp({"t": t, "dot_threshold": dot_threshold}, {"n_models": len(tensors)})
    dt = work_dtype(tensors[0])
    a, b = tensors[0].to(dt), tensors[1].to(dt)
    t = float(t)
    na = torch.linalg.vector_norm(a)
    nb = torch.linalg.vector_norm(b)
    na = na if na > eps else torch.ones_like(na)
    nb = nb if nb > eps else torch.ones_like(nb)
    dot = float((torch.dot(a.reshape(-1), b.reshape(-1)) / (na * nb)).clamp(-1, 1)) if a.numel() else 1.0
    if abs(dot) > dot_threshold:
        ca, cb = 1.0 - t, t
    else:
        theta = math.acos(dot)
        s = math.sin(theta)
        ca, cb = math.sin((1 - t) * theta) / s, math.sin(t * theta) / s
    out = a * ca
    out.add_(b, alpha=cb)
    return out.to(tensors[0].dtype)
