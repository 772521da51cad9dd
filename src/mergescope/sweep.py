"""A study sweep's ``all`` axes, written out: what both the study runner (:mod:`mergescope.study`) and ``launch.py -m``
(:func:`mergescope.cli.expand_multirun_study`) expand ``metric: all`` and ``pair: all`` to."""

from __future__ import annotations

from mergescope.config import conf_options
from mergescope.errors import MergescopeError


def every_metric() -> str:
    """``metric: all`` in a study's sweep: every registered metric plug-in that has its conf/metric YAML, in report
    order (a new metric is in every such sweep with no other edit)."""
    from mergescope.registry import metrics

    have = set(conf_options("metric"))
    return ",".join(e.name for e in metrics.entries() if e.name in have)


def every_pair(models: list[str]) -> str:
    """``pair: all``: every unordered pair of the study's ``models`` (conf/model names), in list order."""
    if len(models) < 2:
        raise MergescopeError(f"the sweep's pair: all needs the study's models (a list of at least two conf/model names at "
                              f"the top level, models: [...]), got {models}")
    return ",".join(f"{a}__{b}" for i, a in enumerate(models) for b in models[i + 1:])
