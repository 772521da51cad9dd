"""Truncate (intersection-style, App. 9.2): a larger model projected into a smaller architecture.

``select=prefix`` (the paper): the overlapping prefix of every oversized axis; layers beyond the target depth
dropped; a tied target's head follows its embedding. ``select=slots``: the exact inverse of Expand(zero)'s
placement (the slots the small shape occupies inside the large one, norm scales divided by c unless
``norm_scale=false``), for the
planted round trip Truncate(Expand(theta)) = theta. Gemma 3 (a model that multiplies its embedding lookup by
sqrt(hidden), with (1 + w) norms; ``expand.rescale``): in both modes the kept embedding rows are multiplied by
sqrt(h_s/h_t) so the residual stream keeps its values, and a tied target's final norm scale 1 + w by sqrt(h_t/h_s)
so the head, which reads it through those rows, gives the same logits for the kept coordinates; in ``slots`` every
factor is the exact inverse of Expand(zero)'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

from mergescope.adapt.ops.expand import embed_factor, norm_factor, rescale
from mergescope.adapt.plugins import adapters, index, walk
from mergescope.adapt.roles import Role
from mergescope.shapes import Shape, expand_maps, truncate_maps
from mergescope.errors import MergescopeError

SELECTS = ("prefix", "slots")


GQA = ("prefix", "aligned")


def _check(kwargs: Mapping, context: Mapping) -> None:
    if kwargs.get("select", "prefix") not in SELECTS:
        raise MergescopeError(f"adapt.select={kwargs.get('select')!r}: choose one of {', '.join(SELECTS)}")
    if kwargs.get("gqa", "prefix") not in GQA:
        raise MergescopeError(f"adapt.gqa={kwargs.get('gqa')!r}: choose one of {', '.join(GQA)}")


def take(w: Tensor, role: Role, shape: torch.Size, maps: dict[str, Tensor], c: float, e: float = 1.0,
         tgt: Shape | None = None) -> Tensor:
    out = w[index([maps[a] for a in role.axes])]
    if tgt is not None:
        out = rescale(out, role, tgt, c, e, inverse=True)
    elif role.kind == "norm" and c != 1.0:
        out = out / c
    assert out.shape == shape, (role.name, out.shape, shape)
    return out.contiguous()


@adapters.register("truncate", n_positional=4, check=_check, direction="down")
def truncate(sd: Mapping[str, Tensor], src: Shape, tgt: Shape, targets: Mapping[str, torch.Size],
             select: str = "prefix", norm_scale: bool = True, untied_into_tied: bool = False,
             gqa: str = "prefix") -> Iterator[tuple[str, Tensor]]:
    """Truncate ``sd`` (shape ``src``) into the tensors ``targets`` of the smaller shape ``tgt``.
    ``untied_into_tied``: accept an untied source into a tied target (its lm_head is discarded). ``gqa``: which query
    heads the prefix keeps (``prefix``: the paper's first heads; ``aligned``: heads chosen so that each keeps the KV head
    it was trained with, see ``shapes.gqa_aligned_heads``)."""
    if select == "slots":
        maps = expand_maps(tgt, src)
        c = norm_factor(tgt, src, "zero", norm_scale)
    else:
        maps, c = truncate_maps(src, tgt, gqa), 1.0
    layer_src = {t: int(s) for t, s in enumerate(maps["layers"].tolist())} if select == "slots" else \
        {t: t for t in range(tgt.layers)}
    e = embed_factor(tgt, src)  # divided by: the kept rows times sqrt(h_s/h_t), the residual stream's values kept
    return walk(sd, tgt, targets, layer_src, lambda w, role, shape: take(w, role, shape, maps, c, e, tgt),
                untied_into_tied)
