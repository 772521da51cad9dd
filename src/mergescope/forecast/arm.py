"""The forecast arm: after the checkpoint arm's merges, one job fits and validates the merge forecast on them."""

from __future__ import annotations

from mergescope.arm import Arm, Phase, Report


def _jobs(plan) -> list:
    from mergescope.jobs import job

    return [job("forecast", list(plan.base))]


def _text(j, r) -> str:
    m = r.metrics
    return (f"forecast: held-out Spearman {m.get('lofo_spearman', float('nan')):+.3f} leaving one family out, "
            f"{m.get('looo_spearman', float('nan')):+.3f} leaving one operator out, on {m.get('n_merges', 0):.0f} merges")


def _w_none(c, cfg, w) -> None:
    """Reads the store's runs and fits a linear model: seconds."""


_R = "mergescope.forecast.report"

ARMS = [Arm(
    "forecast", order=95, uses=("native",), tasks={"forecast": "mergescope.forecast.job:run_forecast"}, settings=("forecast",),
    work={"forecast": _w_none}, phases=(Phase("forecast", _jobs, _text),),
    report=Report(sections={(80, 3): f"{_R}:section"}, summary={"forecast": "What predicts a merge"},
                  kinds={"forecast": "the merge forecast fitted and validated on the experiment's merges (held out by "
                                     "family and by operator), with its shuffled-target control"},
                  figures=(("forecast_calibration", "forecast calibration: predicted vs measured gain"),)),
)]
