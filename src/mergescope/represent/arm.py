"""The representation arm: each model's quality on its own language, the measure sweep (every pair x metric of the
study's sweep) and typology per pair."""

from __future__ import annotations

from mergescope.arm import Arm, Phase


def _pair_text(j) -> str:
    from mergescope.runs import model_label

    return f"{model_label(j.cfg.pair.a)} x {model_label(j.cfg.pair.b)}"


def _quality_text(j, r) -> str:
    from mergescope.runs import model_label

    return f"quality {model_label(j.cfg.model)}: nll={r.metrics.get('nll', float('nan')):.4f}"


ARMS = [Arm(
    "representation", order=10,
    tasks={"measure": "mergescope.represent.job:run_measure", "quality": "mergescope.represent.job:run_quality",
           "typology": "mergescope.typology:run_typology"},
    phases=(Phase("quality", lambda plan: plan.model_jobs("quality"), _quality_text),
            Phase("measure", lambda plan: plan.measures, lambda j, r: f"{j.cfg.metric.name} {_pair_text(j)}"),
            Phase("typology", lambda plan: plan.pair_jobs("typology"), lambda j, r: f"typology {_pair_text(j)}")),
)]
