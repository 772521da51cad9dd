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
