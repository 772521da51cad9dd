"""NearSwap: the first model moved toward the second by at most ``t`` per entry.

For the two tensors a (``tensors[0]``) and b (``tensors[1]``): w = clip(t / max(|a - b|, 1e-6), 0, 1) entry by entry
and result = w b + (1 - w) a. Where |a - b| <= t the entry is b's (swapped where the models are near, hence the name);
elsewhere it moves from a by exactly t toward b, so for t >= 1e-6 the result is a + clip(b - a, -t, t).

This is mergekit 0.1.5's ``nearswap`` (reference: the QuartetAnemoi-70B-t0.0001 model card,
https://huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001, which used t = 0.0001), with ``tensors[0]`` in the
role of its ``base_model`` (as ``slerp`` maps model a): a two-model method, no common ancestor needed. Exactly two
models; no weights.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from mergescope.errors import MergescopeError
from mergescope.merge._common import check_n_models, check_number, check_tensors, work_dtype
from mergescope.merge._mergekit import MK, per_model
from mergescope.registry import merges

OP = "nearswap"


def _check(kwargs: Mapping, context: Mapping) -> None:
    check_n_models(OP, context.get("n_models"), 2, 2, why=": the first plays mergekit's base_model")
    t = kwargs.get("t", 0.0001)
    check_number(OP, "t", t)
    if float(t) < 0:
        raise MergescopeError(f"merge '{OP}' t={t} is negative: set merge.t >= 0 (the largest move per entry)")


def _mk(kw, n, has_base):
    return MK("nearswap", {"t": float(kw.get("t", 0.0001))}, per_model(n), base="first")


@merges.register(OP, needs_base=False, check=_check, mergekit=_mk, mix=False,
                 reference="https://huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001", order=96)
def nearswap(tensors: list[Tensor], base: Tensor | None, t: float = 0.0001) -> Tensor:
    """a + w (b - a), w = clip(t / max(|a - b|, 1e-6), 0, 1) entry by entry (module doc); ``base`` is not used."""
    check_tensors(OP, tensors)
    _check({"t": t}, {"n_models": len(tensors)})
    dt = work_dtype(tensors[0])
    a, b = tensors[0].to(dt), tensors[1].to(dt)
    w = (float(t) / (a - b).abs().clamp(min=1e-6)).clamp(min=0.0, max=1.0)
    return (w * b + (1 - w) * a).to(tensors[0].dtype)
