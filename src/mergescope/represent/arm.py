"""The representation arm: each model's quality on its own language, the measure sweep (every pair x metric of the
study's sweep) and typology per pair."""

from __future__ import annotations

from mergescope.arm import Arm, Phase, Report


def _pair_text(j) -> str:  # jobs imports torch: on use only
    from mergescope.jobs import pair_text

    return pair_text(j)


def _quality_text(j, r) -> str:
    from mergescope.runs import model_label

    return f"quality {model_label(j.cfg.model)}: nll={r.metrics.get('nll', float('nan')):.4f}"



# ------------------------------------------------------------------ the counted cost of plan=true (mergescope.costs)


def _w_quality(c, cfg, w) -> None:
    s = c.shape(cfg.model, w)
    from mergescope.represent.one_forward import enabled

    if s and enabled(cfg):  # the study's one forward of this model and side, paid once
        c.extraction(cfg, cfg.model, s, w)
        w.held = [s]
    elif s:
        w.add_load(s)
        w.add_forward(s, c.tokens(cfg.data, cfg.model.lang, cfg.data.get("max_sentences"))[1], logits=True)
        w.held = [s]


def _w_measure(c, cfg, w) -> None:
    sa, sb = c.shape(cfg.pair.a, w), c.shape(cfg.pair.b, w)
    key = (str(cfg.represent.pooling), str(cfg.represent.layer))
    c.extraction(cfg, cfg.pair.a, sa, w, key=key)
    c.extraction(cfg, cfg.pair.b, sb, w, key=key)
    if sa and sb:  # the metric itself, on the matched pairs, each control seed and each permutation of its null
        n, _ = c.tokens(cfg.data, cfg.pair.a.lang, cfg.data.get("max_sentences"))
        ctl = cfg.get("control") or {}
        evals = 1 + int(ctl.get("seeds") or 1) + int(ctl.get("calibration_permutations") or 0)
        w.flops += evals * metric_flops(n, sa.hidden, sb.hidden)
    w.held = [s for s in (sa, sb) if s][:1]  # one model at a time


def metric_flops(n: int, da: int, db: int) -> float:
    """One evaluation of a representation metric on n sentences of widths da and db: the cross-product of the two
    sides (n da db, CKA's and Procrustes' matrix) and the n x n similarity of each side (the kNN metrics', retrieval's),
    at two FLOPs a multiply-add."""
    return 2.0 * n * (da * db + n * (da + db))


def _w_none(c, cfg, w) -> None:
    """Reads tables and cached results only."""


_R = "mergescope.represent.report"

ARMS = [Arm(
    "representation", order=10,
    tasks={"measure": "mergescope.represent.job:run_measure", "quality": "mergescope.represent.job:run_quality",
           "typology": "mergescope.typology:run_typology"},
    work={"quality": _w_quality, "measure": _w_measure, "typology": _w_none}, peak_kind={"measure": "quality"},
    phases=(Phase("quality", lambda plan: plan.model_jobs("quality"), _quality_text),
            Phase("measure", lambda plan: plan.measures, lambda j, r: f"{j.cfg.metric.name} {_pair_text(j)}"),
            Phase("measure one language", lambda plan: plan.one_language, lambda j, r: f"{j.cfg.metric.name} {_pair_text(j)} (one language)"),
            Phase("typology", lambda plan: plan.pair_jobs("typology"), lambda j, r: f"typology {_pair_text(j)}")),
    report=Report(sections={(30, 0): f"{_R}:cka_section", (30, 1): f"{_R}:one_language_section", (40, 1): f"{_R}:per_model_quality"},
                  pair_rows=f"{_R}:pair_rows", pair_tables=f"{_R}:pair_tables", beside=f"{_R}:beside",
                  pair_diagnostics=("nll_mean", "typology_syntactic", "typology_genetic", "typology_featural"),
                  figures=(("cka_matched_vs_shuffled", "matched vs shuffled CKA"),), summary={"cka": "Representation"}, model_kinds=("quality",),
                  kinds={"quality": "one model's mean per-token NLL on its own side of the data",
                         "measure": "one representation metric on one pair with its shuffled control (metric=native: the "
                                    "native weight-space job)",
                         "typology": "URIEL distances between a pair's languages"},
                  logical_keys={"measure": f"{_R}:measure_key", "quality": f"{_R}:model_key", "typology": f"{_R}:typology_key"}),
)]
