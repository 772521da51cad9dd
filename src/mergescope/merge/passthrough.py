"""Passthrough (layer stacking, "frankenmerges"): a deeper or shallower model built from layer slices.

Not a per-tensor operator (it changes depth), so not a registered merge: :func:`stack_layers` builds a new
state dict and config from slices ``(state_dict, start, end)`` -- layers ``start..end-1`` of that model, in
slice order, renumbered 0..L-1. Layer tensors are those named ``<prefix>layers.<i>.<rest>``; the other
tensors are taken as mergekit 0.1.5's ``passthrough`` takes them: the ones before the first layer in the
state dict's order (embeddings) from the first slice's model, the ones after (final norm, LM head) from the
last slice's. The config is the first slice's with ``num_hidden_layers`` = L (``layer_types``, where a
config has one, picked layer by layer from it: the slices' models share one architecture). mergekit's per-input ``scale`` is not offered.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from mergescope.errors import MergescopeError

_LAYER = re.compile(r"^(.*?layers\.)(\d+)\.(.+)$")


def _split(sd: Mapping[str, Tensor]) -> tuple[list[str], dict[int, dict[str, tuple[str, str]]], list[str]]:
    """(tensors before the layers, {layer: {rest: (prefix, name)}}, tensors after the layers), in state-dict order."""
    pre, post, layers = [], [], {}
    for name in sd:
        m = _LAYER.match(name)
        if m:
            layers.setdefault(int(m.group(2)), {})[m.group(3)] = (m.group(1), name)
        elif layers:
            post.append(name)
        else:
            pre.append(name)
    return pre, layers, post


def stack_layers(slices: Sequence[tuple[Mapping[str, Tensor], int, int]], config: Mapping[str, Any] | Any
                 ) -> tuple[dict[str, Tensor], Any]:
    """The stacked model's state dict and config (module doc); ``config`` is the first slice's (a dict or a
    transformers config, copied). Tensors are shared with the inputs, not copied."""
    if not slices:
        raise MergescopeError("passthrough needs at least one layer slice: give (model, start, end) slices")
    out: dict[str, Tensor] = {}
    parts = [_split(sd) for sd, _, _ in slices]
    pre0, _, _ = parts[0]
    for name in pre0:
        out[name] = slices[0][0][name]
    j = 0
    picked: list[int] = []
    for k, ((sd, start, end), (_, layers, _)) in enumerate(zip(slices, parts)):
        if not 0 <= start < end <= len(layers):
            raise MergescopeError(f"passthrough slice {k} asks for layers [{start}, {end}) of a model with {len(layers)}: "
                                  "give 0 <= start < end <= its depth")
        for i in range(start, end):
            for rest, (prefix, name) in layers[i].items():
                out[f"{prefix}{j}.{rest}"] = sd[name]
            picked.append(i)
            j += 1
    _, _, post_last = parts[-1]
    for name in post_last:
        out[name] = slices[-1][0][name]
    cfg = copy.deepcopy(config)
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    put = cfg.__setitem__ if isinstance(cfg, dict) else lambda k, v: setattr(cfg, k, v)
    put("num_hidden_layers", j)
    types = get("layer_types")
    if types is not None:  # the slices' models share the architecture, so the first config's list serves all
        put("layer_types", [types[i] for i in picked])
    return out, cfg
