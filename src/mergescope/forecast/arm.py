"""The forecast arm: the fine-tune families' merges (every two experts of a family, with its base as the task vectors'
origin), then one job that fits and validates the merge forecast on every native merge of the experiment."""

from __future__ import annotations

from mergescope.arm import Arm, Phase, Report


def _family_entries(plan) -> list[tuple]:
    """Each fine-tune family: (its base entry, its experts' entries, its revisions, its own overrides)."""
    from mergescope.forecast.settings import ForecastSettings
    from mergescope.jobs import composed

    out = []
    for fam in ForecastSettings.from_cfg(plan.cfg).family_list():
        entry = lambda name: composed([*plan.base, f"model={name}"]).model  # noqa: E731
        out.append((entry(fam.base), [entry(e) for e in fam.experts], fam.revisions, fam.overrides))
    return out


def family_models(plan) -> list:
    """The fine-tune families' models (bases, then experts): trained when missing, a base before its experts."""
    if "forecast" not in plan.arms:
        return []
    return [e for base, experts, *_ in _family_entries(plan) for e in (base, *experts)]


def family_pairs(plan) -> list:
    """Every two experts of a family, at every pair of its revisions: a native job with the family's base as the task
    vectors' origin (``native.base``) and ``forecast.family_overrides`` (e.g. ``native.outcome=both``)."""
    import itertools

    from omegaconf import OmegaConf

    from mergescope.forecast.settings import ForecastSettings
    from mergescope.jobs import hydra_value, job, pair_override

    if "forecast" not in plan.arms:
        return []
    extra = list(ForecastSettings.from_cfg(plan.cfg).family_overrides)
    out = []
    for base, experts, revisions, own in _family_entries(plan):
        b = f"++native.base={hydra_value(OmegaConf.to_container(base, resolve=False))}"
        for ea, eb in itertools.combinations(experts, 2):
            for ra, rb in itertools.product(revisions, repeat=2):
                a = OmegaConf.create({**OmegaConf.to_container(ea, resolve=False), "revision": None if ra == "main" else ra})
                bb = OmegaConf.create({**OmegaConf.to_container(eb, resolve=False), "revision": None if rb == "main" else rb})
                out.append(job("native", [*plan.base, *pair_override(a, bb), b, *extra, *own]))
    return out


def premerge_pairs(plan) -> list:
    """The pre-merge diagnostics (task=premerge, on FLORES dev) of every pair the benchmark holds: the checkpoint arm's
    pairs and the fine-tune families'."""
    from mergescope.jobs import job
    from mergescope.native.arm import checkpoint_pairs

    if "forecast" not in plan.arms:
        return []
    return [job("premerge", j.overrides) for j in [*checkpoint_pairs(plan), *family_pairs(plan)]]


def _premerge_text(j, r) -> str:
    from mergescope.jobs import pair_text

    m = r.metrics
    return (f"premerge {pair_text(j)}: dev NLL gap {m.get('dev_nll_gap', float('nan')):.3f}, gradient cosine "
            f"{m.get('dev_grad_cosine', float('nan')):+.3f}")


def _w_premerge(c, cfg, w) -> None:
    """Both models loaded; each reads its own language's dev sentences with a backward pass (about three forwards),
    and the pair's union of languages once more when it is larger."""
    from mergescope.config import plain_copy
    from mergescope.native.arm import outcome_tokens

    sa, sb = c.shape(cfg.pair.a, w), c.shape(cfg.pair.b, w)
    if not (sa and sb):
        return
    f = cfg.get("forecast") or {}
    n = int(f.get("premerge_sentences") or 64)
    data = plain_copy(cfg.data)
    data.split = str(f.get("premerge_split") or "dev")
    union = outcome_tokens(c, cfg, n, data)
    for s, lang in ((sa, cfg.pair.a.lang), (sb, cfg.pair.b.lang)):
        w.add_load(s)
        own = c.tokens(data, lang, n)[1]  # with a backward (~3 forwards); one language: that pass alone
        w.add_forward(s, 3 * own + (0.0 if union == own else union), logits=True, passes=1.0)
    w.held = [sa, sb]


def _pair_text(j, r) -> str:
    from mergescope.jobs import pair_text

    return f"fine-tune pair {pair_text(j)}: barrier={r.metrics.get('lmc_barrier', float('nan')):.3f}"


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
    "forecast", order=95, uses=("native",), settings=("forecast",),
    tasks={"forecast": "mergescope.forecast.job:run_forecast", "premerge": "mergescope.forecast.premerge:run_premerge"},
    work={"forecast": _w_none, "premerge": _w_premerge}, models=family_models, models_order=40,
    phases=(Phase("forecast merges", family_pairs, _pair_text, workers=True),
            Phase("forecast premerge", premerge_pairs, _premerge_text, workers=True), Phase("forecast", _jobs, _text)),
    report=Report(sections={(80, 3): f"{_R}:section"}, summary={"forecast": "What predicts a merge"},
                  kinds={"forecast": "the merge forecast fitted and validated on the experiment's merges (held out by "
                                     "family and by operator), with its shuffled-target control"},
                  figures=(("forecast_calibration", "forecast calibration: predicted vs measured gain"),)),
)]
