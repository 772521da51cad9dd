"""The dimensional-adaptation arms: ``adapt`` (union by Expand, intersection by Truncate, for every ``[small, large]``
of ``adaptation.pairs``) and ``expansion`` (the function check of Expand on ``expansion.models`` x ``targets``)."""

from __future__ import annotations

from mergescope.arm import Arm, Phase, Report


def adapt_jobs(plan) -> list:
    """For every ``[small, large]`` of ``adaptation.pairs``: union (adapt=expand) and intersection (adapt=truncate)."""
    from mergescope.errors import MergescopeError
    from mergescope.jobs import job, pair_override

    out = []
    if "adapt" not in plan.arms:
        return out
    ops = [str(o) for o in (plan.cfg.adaptation.get("operators") or ["expand", "truncate"])]
    bad = [o for o in ops if o not in ("expand", "truncate")]
    if bad:
        raise MergescopeError(f"adaptation.operators: unknown operator {bad[0]!r}: choose from expand (union), truncate (intersection)")
    for a, b in adapt_pairs(plan):
        extra = (plan.cfg.adaptation.get("operator_overrides") or {})
        out += [job("adapt", [*plan.base, *pair_override(a, b), f"adapt={op}", *(str(o) for o in extra.get(op) or [])])
                for op in ops]
    return out


def adapt_pairs(plan) -> list:
    """``adaptation.pairs`` as (small, large) model entries."""
    from mergescope.jobs import composed

    return [tuple(composed([*plan.base, f"model={m}"]).model for m in (small, large))
            for small, large in (plan.cfg.get("adaptation") or {}).get("pairs") or []]


def adapt_models(plan) -> list:
    """The adapt arm's models, trained (and scored) like the sweep's, whether or not the study runs the arm."""
    from mergescope.jobs import composed

    names = [n for pair in (plan.cfg.get("adaptation") or {}).get("pairs") or [] for n in pair]
    return [composed([*plan.base, f"model={name}"]).model for name in names]


def expansion_jobs(plan) -> list:
    """Every model of ``expansion.models`` against every target of ``expansion.targets`` (task=expansion)."""
    from mergescope.config import to_plain
    from mergescope.jobs import hydra_value, job

    if "expansion" not in plan.arms:
        return []
    ex = plan.cfg.expansion
    return [job("expansion", [*plan.base, f"model={m}", f"expansion.target={hydra_value(to_plain(t))}"])
            for m in ex.models for t in ex.targets]


def expansion_models(plan) -> list:
    """The expansion check's models, trained when missing."""
    from mergescope.jobs import composed

    if "expansion" not in plan.arms:
        return []
    return [composed([*plan.base, f"model={name}"]).model for name in (plan.cfg.get("expansion") or {}).get("models") or []]


def _adapt_text(j, r) -> str:
    from mergescope.jobs import pair_text

    return (f"adapt {j.cfg.adapt.name} {pair_text(j)}: "
            f"best ratio {r.metrics.get('best_ratio', float('nan')):g}")


def _expansion_text(j, r) -> str:
    from mergescope.runs import model_label

    return (f"expansion {j.cfg.expansion.target.mode} {model_label(j.cfg.model)}: "
            f"max |logit diff| {r.metrics.get('max_abs_logit_diff', float('nan')):.1e}")



# ------------------------------------------------------------------ the counted cost of plan=true (mergescope.costs)


def _w_adapt(c, cfg, w) -> None:
    sa, sb = c.shape(cfg.pair.a, w), c.shape(cfg.pair.b, w)
    if not (sa and sb):
        return
    small, big = sorted((sa, sb), key=lambda s: s.params)
    ad = cfg.adaptation
    n = int(ad.get("nll_sentences") or 200)
    for s in (sa, sb):
        w.add_load(s)
    named = ad.get("langs")  # null: every training language of both models (zoo.train_langs, else the entry's lang)
    langs = len(named) if named else len({str(l) for e in (cfg.pair.a, cfg.pair.b)
                                          for l in ((e.get("zoo") or {}).get("train_langs") or [e.get("lang")])})
    _, tok = c.tokens(cfg.data, cfg.pair.a.lang, n)
    union = str(cfg.get("adapt", {}).get("operator", "expand")) == "expand"
    merged = big if union else small  # union merges in the large model's shape, intersection in the small one's
    grid = len(ad.get("union_grid" if union else "intersection_grid") or [1])
    ctl = sum(int(ad.get("noise_seeds") or 1) if k == "noise" else 1 for k in (ad.get("controls") or []))
    compare = 0 if union else len(ad.get("compare") or [])
    val_only = str(ad.get("grid_scored") or "both") == "val"
    # per language: the ends, the controls and comparisons at the chosen ratio on both splits; the grid on both, or on
    # the validation split with the chosen ratio then on both; the two source models as themselves on both
    passes = 2 * 2 + grid * (1 if val_only else 2) + (2 if val_only else 0) + 2 * ctl + 2 * compare
    w.add_forward(merged, tok, logits=True, passes=float(langs * passes))
    w.add_forward(small, tok, logits=True, passes=2.0 * langs)
    w.add_forward(big, tok, logits=True, passes=2.0 * langs)
    w.held = [sa, sb]


def _w_expansion(c, cfg, w) -> None:
    s = c.shape(cfg.model, w)
    if s:
        w.add_load(s)
        tok = float(cfg.expansion.sentences) * c.k.probe_tokens_per_sentence
        w.add_forward(s, tok, logits=True, passes=2 * 4.0 * 2)  # float64 (2x), the model and its wider and back copies
        w.held = [s, s, s]


ARMS = [
    Arm("adapt", order=60, tasks={"adapt": "mergescope.adapt.job:run_adapt"}, settings=("adaptation",), groups=("adapt",),
        needs=("adaptation.pairs", lambda c: (c.get("adaptation") or {}).get("pairs")), models=adapt_models, models_order=10,
        work={"adapt": _w_adapt}, peak_kind={"adapt": "quality"},
        phases=(Phase("adapt", adapt_jobs, _adapt_text, workers=True),),  # no cache between its jobs: side by side
        report=Report(sections={(70, 1): "mergescope.adapt.report:adapt_section"}, beside="mergescope.adapt.report:beside",
                      coverage={"adapt": "mergescope.adapt.report:coverage_cell"}, summary={"adapt": "Dimensional adaptation"},
                      kinds={"adapt": "dimensional adaptation (Expand/Truncate) merges"},
                      rejudge={"adapt": "mergescope.adapt.job:rejudge_summary"})),
    Arm("expansion", order=70, tasks={"expansion": "mergescope.adapt.job:run_expansion"}, settings=("expansion",),
        needs=("expansion.models or expansion.targets",
               lambda c: (c.get("expansion") or {}).get("models") and (c.get("expansion") or {}).get("targets")),
        models=expansion_models, models_order=20, work={"expansion": _w_expansion}, peak_kind={"expansion": "quality"},
        phases=(Phase("expansion", expansion_jobs, _expansion_text),),
        report=Report(kinds={"expansion": "Expand of one model into a wider shape: logits against the source's, Truncate(slots) back"})),
]
