"""Relative depth: depth r in [0, 1] of a model with L layers is hidden state round(r * L) of its own depth
(0 = the embeddings, L = the final, post-norm state), rounding halves up, so models of different depths are
compared at the same relative position rather than at the same layer number."""

from __future__ import annotations

import math
from collections.abc import Sequence

from mergescope.errors import MergescopeError

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def layer_at(depth: float, n_layers: int) -> int:
    """The hidden-state index at relative ``depth`` of a model with ``n_layers`` blocks."""
    r = float(depth)
    if not 0.0 <= r <= 1.0:
        raise MergescopeError(f"a relative depth must lie in [0, 1], got {depth}")
    if int(n_layers) < 1:
        raise MergescopeError(f"a model needs at least one layer, got {n_layers}")
    return int(math.floor(r * int(n_layers) + 0.5))


def depth_layers(depths: Sequence[float], n_layers: int) -> list[int]:
    """The hidden-state index of each relative depth."""
    return [layer_at(r, n_layers) for r in depths]


def distinct_depths(depths: Sequence[float], n_layers: int) -> list[bool]:
    """For each relative depth, whether this model has a state of its own there. Depths that round to one hidden
    state share it; the state belongs to the depth nearest to it (r * L closest to the index; the first on a tie)
    and the others are duplicates: with 2 layers, depths (0, .25, .5, .75, 1) map to states (0, 1, 1, 2, 2), and
    .25 and .75 are duplicates of .5 and 1. A cross-model comparison leaves a depth out where either model
    has no distinct state for it."""
    idx = depth_layers(depths, n_layers)
    owner: dict[int, int] = {}
    for k, (r, i) in enumerate(zip(depths, idx)):
        dist = abs(float(r) * int(n_layers) - i)
        if i not in owner or dist < abs(float(depths[owner[i]]) * int(n_layers) - i) - 1e-12:
            owner[i] = k
    return [owner[i] == k for k, i in enumerate(idx)]
