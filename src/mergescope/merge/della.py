"""DELLA (Deep et al., 2024): task vectors dropped at random with magnitude-ranked keep probabilities (MagPrune).

Per task vector delta_i = theta_i - base and per row (a 1-d tensor is one row; a tensor of more than two
dimensions has rows ``shape[0]`` and all its other entries flattened), the entries are ranked by |delta|
(r = 0 smallest ... n-1 largest) and each is kept with probability

    p = (density - epsilon) + 2 epsilon * r / (n - 1),

so keep probabilities run linearly from density - epsilon (smallest entries) to density + epsilon
(largest), mean ``density`` (a row of one entry: p = density). ``epsilon`` is the half-width, as in
mergekit 0.1.5 (its ``della_magprune``); density +- epsilon must lie in (0, 1). ``density`` >= 1 keeps
everything. The masks are drawn per model in model order from a ``torch.Generator`` seeded with ``seed``
(per tensor through ``merge_state_dicts``), on CPU in float32: the same draws as mergekit's
``torch.bernoulli(probs)`` under ``torch.manual_seed(seed)``.

Rescale of the kept entries: ``probability`` (the paper's, default: each kept entry divided by its own keep
probability, so E[kept delta] = delta, DARE's 1/density rule generalised), ``l1`` (mergekit 0.1.5's
``rescale: true``: the masked task vector scaled back to its L1 norm), or ``none``. Then weighted, summed,
sign-elected (``consensus=sign``: ``della``; ``none``: ``della_linear``) and divided by the (kept)
weights when ``normalize`` -- :func:`mergescope.merge.task_arithmetic.combine_task_vectors`. Ties in
|delta| are ranked by position (stable sort), where mergekit's argsort ranks them arbitrarily.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from mergescope.errors import MergescopeError
from mergescope.merge._common import (
    as_weights,
    bernoulli_mask,
    check_choice,
    check_fraction,
    check_number,
    check_seed,
    check_tensors,
    check_weights,
    work_dtype,
)
from mergescope.merge._mergekit import MK, per_model
from mergescope.merge.trim import zero_where_not
from mergescope.merge.task_arithmetic import rescale_kept, combine_task_vectors
from mergescope.registry import merges

OP = "della"
CONSENSUS = ("none", "sign", "count")
RESCALE = ("none", "probability", "l1")


def _check(kwargs: Mapping, context: Mapping) -> None:
    n_models = context.get("n_models")
    check_weights(OP, kwargs.get("weights"), n_models)
    density, eps = kwargs.get("density", 0.5), kwargs.get("epsilon", 0.15)
    check_fraction(OP, "density", density)
    check_number(OP, "epsilon", eps)
    if float(eps) < 0:
        raise MergescopeError(f"merge '{OP}' epsilon={eps} is negative: set merge.epsilon >= 0 (the half-width of the keep probabilities)")
    if float(density) < 1 and not (0.0 < float(density) - float(eps) and float(density) + float(eps) < 1.0):
        raise MergescopeError(
            f"merge '{OP}' density={density} epsilon={eps}: density +- epsilon must lie in (0, 1): lower merge.epsilon"
        )
    check_choice(OP, "consensus", kwargs.get("consensus", "sign"), CONSENSUS)
    check_choice(OP, "rescale", kwargs.get("rescale", "probability"), RESCALE)
    check_number(OP, "lambda_", kwargs.get("lambda_", 1.0))
    check_seed(OP, kwargs.get("seed", 0))


def magprune_probs(delta: Tensor, density: float, epsilon: float) -> Tensor:
    """Per-entry keep probabilities of MagPrune (module doc), float32 (float64 inputs: float64), shape of ``delta``."""
    dt = work_dtype(delta)
    rows = delta.reshape(1, -1) if delta.dim() < 2 else delta.reshape(delta.shape[0], -1)
    n = rows.shape[1]
    order = torch.sort(rows.abs(), dim=1, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(n, device=delta.device).expand_as(order).contiguous())
    rank_norm = rank.to(dt) / (n - 1) if n > 1 else torch.full(rows.shape, 0.5, dtype=dt, device=delta.device)
    return ((density - epsilon) + rank_norm * 2 * epsilon).reshape(delta.shape)


def _mk(kw, n, has_base):
    cons = kw.get("consensus", "sign")
    if cons == "count":
        return MK(None, notes=["mergekit's della elects signs by sum only (consensus=sign)"])
    notes = []
    if kw.get("rescale", "probability") == "probability" and float(kw.get("density", 0.5)) < 1:
        notes.append("rescale=probability (DELLA paper: / keep probability) has no mergekit equivalent; "
                     "mergekit's rescale: true rescales to the L1 norm")
    if float(kw.get("density", 0.5)) < 1:
        notes.append("random masks: mergekit draws them from its global RNG (mergekit-yaml --random-seed), "
                     "mergescope per tensor from the seed and the tensor's name: same distribution, other draws")
    return MK("della" if cons == "sign" else "della_linear",
              {"normalize": bool(kw.get("normalize", True)), "lambda": float(kw.get("lambda_", 1.0)),
               "rescale": kw.get("rescale", "probability") != "none"},
              per_model(n, weight=kw.get("weights") or 1.0, density=kw.get("density", 0.5), epsilon=kw.get("epsilon", 0.15)),
              notes=notes)


@merges.register(OP, needs_base=True, check=_check, mergekit=_mk, reference="https://arxiv.org/abs/2406.11617", order=50,
                 stochastic=True)
def della(
    tensors: list[Tensor],
    base: Tensor | None,
    weights: list[float] | None = None,
    density: float = 0.5,
    epsilon: float = 0.15,
    consensus: str = "sign",
    rescale: str = "probability",
    normalize: bool = True,
    lambda_: float = 1.0,
    seed: int = 0,
) -> Tensor:
    """base + lambda_ * combination of the MagPrune-dropped, rescaled task vectors (module doc)."""
    if base is None:
        raise MergescopeError(f"merge '{OP}' needs a common base model (task vectors theta - theta_base): use linear or slerp")
    check_tensors(OP, tensors, base)
    _check(dict(weights=weights, density=density, epsilon=epsilon, consensus=consensus, rescale=rescale,
                lambda_=lambda_, seed=seed), {"n_models": len(tensors)})
    dt = work_dtype(base)
    b = base.to(dt)
    w = as_weights(weights, len(tensors))
    gen = torch.Generator().manual_seed(int(seed))
    deltas: list[Tensor | None] = []
    for x, wi in zip(tensors, w):
        d = torch.sub(x.to(dt), b)
        if density < 1:
            probs = magprune_probs(d, float(density), float(epsilon))
            keep = bernoulli_mask(probs, gen)
            before = d.abs().sum() if rescale == "l1" else None
            zero_where_not(d, keep)
            if rescale == "probability":
                d.div_(probs)
            else:
                rescale_kept(d, before, float(density), rescale)
            del probs, keep
        if wi != 1.0:
            d.mul_(wi)
        deltas.append(d)
    return combine_task_vectors(deltas, w, b, consensus, normalize, float(lambda_)).to(base.dtype)
