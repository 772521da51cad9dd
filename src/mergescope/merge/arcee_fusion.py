"""Arcee Fusion: the first model takes the second's value only at the entries where the change matters most.

For the two tensors a (``tensors[0]``, the model fused into) and b (``tensors[1]``), row by row (the last dimension;
a 1-d tensor is one row): p = softmax(b) + 1e-8, q = softmax(a) + 1e-8, KL = sum p log(p / q) per row, and the
importance of every entry is |b - a| x its row's KL. With the importances' quartiles Q1, Q2, Q3 (the order statistic
of rank floor(q (n - 1)) among the n entries, 0-based, no interpolation), the threshold is Q2 + 1.5 (Q3 - Q1) (an
upper-outlier fence), and result = a + (b - a) [importance >= threshold]: b's value where the importance reaches the
fence, a's elsewhere.

This is mergekit 0.1.5's ``arcee_fusion`` (reference https://arcee.ai; no paper defines it: mergekit's code is the
definition), with ``tensors[0]`` in the role of its ``base_model`` (a two-model method, no common ancestor needed).
One departure, where mergekit's result is not reproducible: on a tensor of more than 1,000,000 entries mergekit
estimates the quartiles from 1,000,000 entries drawn at random with replacement from the unseeded global generator
(another run, another threshold); here they are always the exact order statistics above, which that sample
estimates. Equal to mergekit on every tensor up to that size (tests/test_merge_methods.py). Exactly two models.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from mergescope.merge._common import check_n_models, check_tensors, work_dtype
from mergescope.merge._mergekit import MK, per_model
from mergescope.registry import merges

OP = "arcee_fusion"
SAMPLED_ABOVE = 1_000_000  # mergekit's quartiles are sampled, not exact, on tensors larger than this


def _check(kwargs: Mapping, context: Mapping) -> None:
    check_n_models(OP, context.get("n_models"), 2, 2, why=": the first plays mergekit's base_model")


def _mk(kw, n, has_base):
    return MK("arcee_fusion", {}, per_model(n), base="first",
              notes=[f"mergekit's arcee_fusion estimates its threshold from {SAMPLED_ABOVE:,} random entries (unseeded) on "
                     f"tensors of more than {SAMPLED_ABOVE:,} entries; mergescope's is exact (equal on smaller tensors)"])


def importance(a: Tensor, b: Tensor) -> Tensor:
    """|b - a| times the KL divergence of softmax(b) from softmax(a) along the last dimension (each + 1e-8)."""
    p = torch.softmax(b, dim=-1) + 1e-8
    q = torch.softmax(a, dim=-1) + 1e-8
    kl = (p * torch.log(p / q)).sum(dim=-1, keepdim=True)
    return (b - a).abs() * kl


def fence(scores: Tensor) -> Tensor:
    """Q2 + 1.5 (Q3 - Q1) of ``scores``, each quartile the order statistic of 0-based rank floor(q (n - 1))."""
    flat = scores.reshape(-1)
    n = flat.numel()
    q1, q2, q3 = (torch.kthvalue(flat, (num * (n - 1)) // 4 + 1).values for num in (1, 2, 3))
    return q2 + 1.5 * (q3 - q1)


@merges.register(OP, needs_base=False, check=_check, mergekit=_mk, reference="https://arcee.ai", order=97)
def arcee_fusion(tensors: list[Tensor], base: Tensor | None) -> Tensor:
    """a + (b - a) where the importance |b - a| KL reaches its upper-outlier fence (module doc); ``base`` is not used."""
    check_tensors(OP, tensors)
    _check({}, {"n_models": len(tensors)})
    dt = work_dtype(tensors[0])
    a, b = tensors[0].to(dt), tensors[1].to(dt)
    if a.dim() == 0:
        a, b = a.reshape(1), b.reshape(1)
    scores = importance(a, b)
    keep = (scores >= fence(scores)).to(dt)
    return (a + (b - a) * keep).reshape(tensors[0].shape).to(tensors[0].dtype)
