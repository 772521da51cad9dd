"""The dimensional-adaptation arm (Expand / Truncate, then ratio-controlled weighted averaging).

``shapes`` (shapes from configs, slot maps, refusals), ``roles`` (the axis of every tensor dimension),
``plugins`` (the operator registry; operators in ``ops/``), ``model`` (adapt a loaded model into another
architecture in memory), ``evaluate`` (NLL / bits per byte per language and FLORES domain, attention entropy,
residual norm), ``protocol`` (merges, controls, comparisons), ``overlap`` (the competence overlap of a pair: nested /
intersecting / reversed from two task profiles), ``job`` (``task=adapt``).
"""

from mergescope.adapt.plugins import adapt_state, adapters, resolve_adapter
from mergescope.shapes import Shape, expand_blockers, expand_maps, shape_of, slot_map, truncate_maps

__all__ = ["Shape", "adapt_state", "adapters", "expand_blockers", "expand_maps", "resolve_adapter", "shape_of",
           "slot_map", "truncate_maps"]
