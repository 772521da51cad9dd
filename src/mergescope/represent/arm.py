"""The representation arm: each model's quality on its own language, the measure sweep (every pair x metric of the
study's sweep) and typology per pair."""

from __future__ import annotations

from mergescope.arm import Arm, Phase


def _pair_text(j) -> str:  # jobs imports torch: on use only
    from mergescope.jobs import pair_text

    return pair_text(j)


def _quality_text(j, r) -> str:
    from mergescope.runs import model_label

    return f"quality {model_label(j.cfg.model)}: nll={r.metrics.get('nll', float('nan')):.4f}"



# ------------------------------------------------------------------ the counted cost of plan=true (mergescope.costs)


def _w_quality(c, cfg, w) -> None:
    s = c.shape(cfg.model, w)
    if s:
        w.add_load(s)
        w.add_forward(s, c.tokens(cfg.data, cfg.model.lang, cfg.data.get("max_sentences"))[1], logits=True)
        w.held = [s]


def _w_measure(c, cfg, w) -> None:
    sa, sb = c.shape(cfg.pair.a, w), c.shape(cfg.pair.b, w)
    key = (str(cfg.represent.pooling), str(cfg.represent.layer))
    c.extraction(cfg, cfg.pair.a, sa, w, key=key)
    c.extraction(cfg, cfg.pair.b, sb, w, key=key)
    w.held = [s for s in (sa, sb) if s][:1]  # one model at a time


def _w_none(c, cfg, w) -> None:
    """Reads tables and cached results only."""


ARMS = [Arm(
    "representation", order=10,
    tasks={"measure": "mergescope.represent.job:run_measure", "quality": "mergescope.represent.job:run_quality",
           "typology": "mergescope.typology:run_typology"},
    work={"quality": _w_quality, "measure": _w_measure, "typology": _w_none}, peak_kind={"measure": "quality"},
    phases=(Phase("quality", lambda plan: plan.model_jobs("quality"), _quality_text),
            Phase("measure", lambda plan: plan.measures, lambda j, r: f"{j.cfg.metric.name} {_pair_text(j)}"),
            Phase("typology", lambda plan: plan.pair_jobs("typology"), lambda j, r: f"typology {_pair_text(j)}")),
)]
