"""Expand (union-style, App. 9.1): a smaller model placed inside a larger architecture.

``mode=zero`` (the paper): every source coordinate goes to its slot (``shapes.expand_maps``); every new
coordinate is zero; copied hidden-width norm scales are multiplied by c = sqrt(h_s/h_t) (``norm_scale``),
which keeps an RMSNorm model's function (its eps is then effectively eps/c^2); new layers are residual
identities placed by the slot map over depth. Gemma 3 (``shapes.OFFSET_NORM_FAMILIES``, ``SCALED_EMBEDDING_FAMILIES``):
its norms scale by (1 + w), so the rule applies to 1 + w (w -> (1 + w) c - 1; a zero-padded w is a scale of 1, on
coordinates that stay zero); its model multiplies the embedding lookup by sqrt(h), so the embedding rows are multiplied
by e = sqrt(h_s/h_t) (the residual stream keeps its values), and with a tied head the final norm's c is divided by e
(the head reads the final norm's output through the same rescaled rows); q_norm / k_norm act on one head's head_dim,
which Expand keeps, and are copied. ``mode=repeat``: width grows by tiling whole units (integer
multiples), every weight that reads a repeated axis divided by the repeat count; LayerNorm models keep their
function too, because a tiled vector has the same mean and variance. A tied target's head is the tiled embedding,
which must not be divided (it is also the input lookup), so there the final norm's scale (and bias) -- read by the
head alone -- is divided by the hidden repeat count instead: the r tiled copies of e . x sum to r e . x, and the
1/r on the final norm gives back e . x (the logits are the source's, tied or untied).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

from mergescope.adapt.plugins import adapters, index, walk
from mergescope.adapt.roles import Role, final_norm_name
from mergescope.shapes import Shape, expand_maps, repeat_maps
from mergescope.errors import MergescopeError

MODES = ("zero", "repeat")


def _check(kwargs: Mapping, context: Mapping) -> None:
    if kwargs.get("mode", "zero") not in MODES:
        raise MergescopeError(f"adapt.mode={kwargs.get('mode')!r}: choose one of {', '.join(MODES)}")


def norm_factor(src: Shape, tgt: Shape, mode: str, norm_scale: bool) -> float:
    """c = sqrt(h_s/h_t) for zero-mode norm scales (1 when repeating or when switched off)."""
    return math.sqrt(src.hidden / tgt.hidden) if mode == "zero" and norm_scale else 1.0


def embed_factor(src: Shape, tgt: Shape) -> float:
    """e = sqrt(h_s/h_t) for a family whose model multiplies its embedding lookup by sqrt(hidden) (Gemma 3): rows
    times e keep the residual stream (E e sqrt(h_t) = E sqrt(h_s)); 1 for every other family."""
    return math.sqrt(src.hidden / tgt.hidden) if tgt.embed_scaled else 1.0


def rescale(w: Tensor, role: Role, tgt: Shape, c: float, e: float, inverse: bool = False) -> Tensor:
    """A kept tensor's values under the width rules: a hidden-width norm scale times c (the tied final norm of a
    scaled-embedding family times c/e), applied to 1 + w for Gemma's (1 + w) norms; embedding rows times e. With
    ``inverse`` the same factors divide (Truncate(slots) undoes Expand(zero) exactly this way)."""
    if role.kind == "norm":
        f = c / e if tgt.tied and e != 1.0 and role.name == final_norm_name(tgt.family) else c
    elif role.kind == "embed":
        f = e
    else:
        return w
    if f == 1.0:
        return w
    off = tgt.norm_offset if role.kind == "norm" else 0.0
    if off:
        return ((w + off) / f if inverse else (w + off) * f) - off
    return w / f if inverse else w * f


def place_zero(w: Tensor, role: Role, shape: torch.Size, maps: dict[str, Tensor], c: float, e: float = 1.0,
               tgt: Shape | None = None) -> Tensor:
    out = torch.zeros(shape, dtype=w.dtype)
    if tgt is None:  # no family rules: a norm scale times c
        out[index([maps[a] for a in role.axes])] = w * c if role.kind == "norm" else w
    else:
        out[index([maps[a] for a in role.axes])] = rescale(w, role, tgt, c, e)
    return out


def place_repeat(w: Tensor, role: Role, shape: torch.Size, maps: dict[str, Tensor], src: Shape, tgt: Shape) -> Tensor:
    out = w[index([maps[a] for a in role.axes])]
    if role.kind == "linear":
        out = out / (tgt.size(role.axes[-1]) // src.size(role.axes[-1]))
    elif tgt.tied and role.layer is None and role.kind in ("norm", "norm_bias"):
        out = out / (tgt.hidden // src.hidden)  # the final norm, read by the tied (undivided) head only
    assert out.shape == shape, (role.name, out.shape, shape)
    return out.contiguous()


@adapters.register("expand", n_positional=4, check=_check, direction="up")
def expand(sd: Mapping[str, Tensor], src: Shape, tgt: Shape, targets: Mapping[str, torch.Size],
           mode: str = "zero", norm_scale: bool = True, untied_into_tied: bool = False) -> Iterator[tuple[str, Tensor]]:
    """Expand ``sd`` (shape ``src``) into the tensors ``targets`` of shape ``tgt``, one tensor at a time.
    ``untied_into_tied``: accept an untied source into a tied target (its lm_head is discarded)."""
    maps = expand_maps(src, tgt) if mode == "zero" else repeat_maps(src, tgt)
    layer_src = {int(t): s for s, t in enumerate(maps["layers"].tolist())}
    c = norm_factor(src, tgt, mode, norm_scale)
    if mode == "zero":
        e = embed_factor(src, tgt)
        return walk(sd, tgt, targets, layer_src, lambda w, role, shape: place_zero(w, role, shape, maps, c, e, tgt),
                    untied_into_tied)
    return walk(sd, tgt, targets, layer_src, lambda w, role, shape: place_repeat(w, role, shape, maps, src, tgt),
                untied_into_tied)
