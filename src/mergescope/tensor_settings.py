"""Merge settings that vary by tensor, as mergekit's (0.1.5) parameter filters and gradients, resolved per tensor name.

Any merge operator keyword may be given, instead of one value, as
- a **gradient**: a list of numbers, interpolated linearly over the layers: for a tensor of layer i of L, at
  position t = i / (L - 1) (t = 1 when L = 1) of the list; a tensor outside the layers (embeddings, final norm, head)
  takes t = 0, as mergekit's pre- and post-weights do;
- a **filter list**: ``[{filter: self_attn, value: 0.3}, {filter: mlp, value: [0, 1]}, {value: 0.5}]``: the first
  entry whose ``filter`` is a substring of the tensor's name (or that has no filter, or ``*``) gives the value, itself
  a number, a gradient or any other setting.

``weights`` is a list with one entry per model; each entry may vary as above. Layers are counted from the state
dict's names (``...layers.<i>.``, ``...h.<i>.``, ``...blocks.<i>.``), the same rule for every family. A tensor whose
filters give no value keeps the operator's default for that keyword; a model's weight must have one (as in mergekit,
where a weight is required).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from mergescope.errors import MergescopeError

PER_MODEL = ("weights",)
LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
MISSING = object()


def _is_filters(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(e, Mapping) for e in v)


def _is_gradient(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 1 and all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in v)


def varies(key: str, value: Any) -> bool:
    """Whether a keyword's value depends on the tensor (a gradient or filters; for ``weights``, any model's entry)."""
    if key in PER_MODEL:
        return isinstance(value, list) and any(isinstance(e, list) for e in value)
    return _is_filters(value) or _is_gradient(value)


def any_varies(kwargs: Mapping[str, Any]) -> bool:
    return any(varies(k, v) for k, v in kwargs.items())


def layer_count(names: Iterable[str]) -> int:
    """1 + the largest layer index among ``names`` (0 when none is a layer tensor)."""
    idx = [int(m.group(1)) for n in names if (m := LAYER.search(n))]
    return max(idx) + 1 if idx else 0


def position(name: str, n_layers: int) -> float:
    """mergekit's t of a tensor: i / (L - 1) in layer i of L (1 when L = 1); 0 outside the layers."""
    m = LAYER.search(name)
    if m is None:
        return 0.0
    return int(m.group(1)) / (n_layers - 1) if n_layers > 1 else 1.0


def evaluate(value: Any, name: str, t: float) -> Any:
    """One setting at one tensor (module doc); :data:`MISSING` when a filter list has no entry for it."""
    if _is_filters(value):
        for cond in value:
            f = cond.get("filter")
            if f is None or f == "*" or f in name:
                if "value" not in cond:
                    raise MergescopeError(f"a filter entry {dict(cond)} has no 'value': give {{filter: ..., value: ...}}")
                return evaluate(cond["value"], name, t)
        return MISSING
    if _is_gradient(value):
        x = t * (len(value) - 1)
        i0 = int(x)
        i1 = min(len(value) - 1, i0 + 1)
        frac = x - i0
        return (1 - frac) * float(value[i0]) + frac * float(value[i1])
    if isinstance(value, list) and len(value) == 1:
        return value[0]
    return value


def at(kwargs: Mapping[str, Any], name: str, t: float) -> dict[str, Any]:
    """The keywords of one tensor position: every varying setting evaluated at ``name`` and ``t``."""
    out = {}
    for k, v in kwargs.items():
        if k in PER_MODEL and varies(k, v):
            vals = [evaluate(e, name, t) for e in v]
            if any(x is MISSING for x in vals):
                i = next(i for i, x in enumerate(vals) if x is MISSING)
                raise MergescopeError(f"merge weights[{i}] gives no value for tensor '{name}': end its filter list with a "
                                      "default entry {value: <number>}")
            out[k] = vals
        elif varies(k, v):
            x = evaluate(v, name, t)
            if x is not MISSING:
                out[k] = x
        else:
            out[k] = v
    return out


def leaves(value: Any) -> Iterator[Any]:
    """Every plain value a setting can take (each gradient endpoint, each filter's value)."""
    if _is_filters(value):
        for cond in value:
            yield from leaves(cond.get("value"))
    elif _is_gradient(value):
        yield from value
    else:
        yield value


def variants(kwargs: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Concrete keyword sets that cover every value each varying setting can take (one setting at a time, the others
    at their first value): what the operator's ``check`` validates before any model loads."""
    first = {}
    for k, v in kwargs.items():
        if k in PER_MODEL and varies(k, v):
            first[k] = [next(leaves(e)) for e in v]
        elif varies(k, v):
            first[k] = next(leaves(v))
        else:
            first[k] = v
    yield first
    for k, v in kwargs.items():
        if not varies(k, v):
            continue
        if k in PER_MODEL:
            for i, e in enumerate(v):
                for x in leaves(e):
                    yield {**first, k: [*first[k][:i], x, *first[k][i + 1:]]}
        else:
            for x in leaves(v):
                yield {**first, k: x}
