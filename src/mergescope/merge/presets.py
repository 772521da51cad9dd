"""A merge preset by name (``conf/merge/<name>.yaml``): what every route that merges elementwise reads (the native arm,
the adapt arm's averaging after Expand/Truncate)."""

from __future__ import annotations

from omegaconf import DictConfig

from mergescope.config import conf_options, load_conf
from mergescope.errors import MergescopeError, did_you_mean

__all__ = ["preset_config", "TRANSPORT_HINT"]

TRANSPORT_HINT = ("transport is not an elementwise operator: it is directional and fits plans on activations; "
                  "run it with task=transport (the study runs it for every pair)")



def preset_config(name: str) -> DictConfig:
    if name in ("transport", "transport_released"):
        raise MergescopeError(f"an elementwise merge cannot be transport: {TRANSPORT_HINT}")
    if name not in conf_options("merge"):
        raise MergescopeError(f"unknown merge '{name}': {did_you_mean(name, conf_options('merge'))}")
    return load_conf("merge", name)
