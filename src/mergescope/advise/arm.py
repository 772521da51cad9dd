"""The advisor's arm: in a study (``study=forecast``, ``study=routes``), every pair's pre-merge diagnostics
(``task=pairdev``) after the transport arm's merges, then one forecast per route the study built
(``task=route_forecast``); ``task=advise`` runs alone on any pair."""

from __future__ import annotations

from mergescope.arm import Arm, Phase, Report


def pair_jobs(plan) -> list:
    """Every pair of the study's sweep, then every pair of the adapt arm's (``adaptation.pairs``) and of the native
    arm's outside the sweep (``native_pairs``) not among them."""
    from mergescope.adapt.arm import adapt_pairs
    from mergescope.jobs import job, pair_override
    from mergescope.native.arm import native_outside_pairs
    from mergescope.runs import model_label

    if "advise" not in plan.arms:
        return []
    out = plan.pair_jobs("pairdev")
    seen = {frozenset((model_label(j.cfg.pair.a), model_label(j.cfg.pair.b))) for j in out}
    extra = [*(adapt_pairs(plan) if "adapt" in plan.arms else []),
             *(native_outside_pairs(plan) if "native" in plan.arms else [])]
    for a, b in extra:
        key = frozenset((model_label(a), model_label(b)))
        if key not in seen:
            seen.add(key)
            out.append(job("pairdev", [*plan.base, *pair_override(a, b)]))
    return out


def route_jobs(plan) -> list:
    """One fit per route the study's merges build: transport, and transport+adapt where the transport arm adapts; adapt
    union and adapt intersection where the study runs the adapt arm (each of its operators); transplant where the
    native arm transplants (``native.transplant``). They run side by side on the study's workers; the held-out check
    of them all is the next phase (:func:`check_jobs`)."""
    from mergescope.jobs import composed, job, key_of

    if "advise" not in plan.arms:
        return []
    user_merge = any(key_of(o) == "merge" for o in plan.base)  # as the transport arm composes its directions
    merge = composed([*plan.base, *([] if user_merge else ["merge=transport"])]).merge
    adapt = bool((merge.get("adapt") or {}).get("enabled"))
    routes = ["transport", *(["transport+adapt"] if adapt else [])] if "transport" in plan.arms else []
    if "adapt" in plan.arms:
        ops = [str(o) for o in (plan.cfg.adaptation.get("operators") or ["expand", "truncate"])]
        routes += [r for op, r in (("expand", "adapt union"), ("truncate", "adapt intersection")) if op in ops]
    if "native" in plan.arms and (plan.cfg.get("native") or {}).get("transplant") is not None:
        routes.append("transplant")
    return [job("route_forecast", [*plan.base, f"advise.route={r}"]) for r in routes]


def check_jobs(plan) -> list:
    """The held-out check of every route fit (``task=advise_check``), once every fit of ``route forecasts`` is done."""
    from mergescope.jobs import job

    return [job("advise_check", list(plan.base))] if route_jobs(plan) else []


def _pair_text(j, r) -> str:
    from mergescope.jobs import pair_text

    m = r.metrics
    return (f"pairdev {pair_text(j)}: dev CKA {m.get('dev_cka', float('nan')):.3f} (calibrated "
            f"{m.get('dev_cka_calibrated', float('nan')):.3f}), bits/byte {m.get('dev_bpb_a', float('nan')):.3f} / "
            f"{m.get('dev_bpb_b', float('nan')):.3f}")


def _route_text(j, r) -> str:
    m = r.metrics
    if j.task == "advise_check":
        return (f"advise_check on {m.get('n_pairs', 0):.0f} held-out pairs: coverage {m.get('coverage', float('nan')):.2f} "
                f"[{m.get('coverage_lo', float('nan')):.2f}, {m.get('coverage_hi', float('nan')):.2f}] of the nominal "
                f"{m.get('level', float('nan')):.2f}; the advised route measured more than the runner-up in "
                f"{m.get('advised_beats_other', float('nan')):.2f} of the pairs")
    return (f"{j.cfg.advise.route} forecast on {m.get('n_merges', 0):.0f} merges: held-out Spearman "
            f"{m.get('member_spearman', float('nan')):+.3f} [{m.get('member_spearman_lo', float('nan')):+.3f}, "
            f"{m.get('member_spearman_hi', float('nan')):+.3f}] with both models unseen, "
            f"{m.get('family_spearman', float('nan')):+.3f} with the target unseen")


def _w_pairdev(c, cfg, w) -> None:
    """Each model loaded and read once over its language's dev lines."""
    from mergescope.config import plain_copy

    a = cfg.get("advise") or {}
    data = plain_copy(cfg.data)
    data.split = str(a.get("split") or "dev")
    n = int(a.get("sentences") or 64)
    held = []
    for side in (cfg.pair.a, cfg.pair.b):
        s = c.shape(side, w)
        if s:
            w.add_load(s)
            w.add_forward(s, c.tokens(data, side.lang, n)[1], logits=True, passes=1.0)
            held = [s]
    w.held = held


def _w_none(c, cfg, w) -> None:
    """Reads the store's runs and fits a linear model: seconds."""


ARMS = [Arm(
    "advise", order=97, uses=("forecast", "represent", "adapt", "native"), settings=("advise",),
    tasks={"pairdev": "mergescope.advise.job:run_pairdev", "route_forecast": "mergescope.advise.job:run_route_forecast",
           "advise": "mergescope.advise.job:run_advise", "advise_check": "mergescope.advise.job:run_advise_check"},
    work={"pairdev": _w_pairdev, "route_forecast": _w_none, "advise": _w_pairdev, "advise_check": _w_none},
    phases=(Phase("route diagnostics", pair_jobs, _pair_text, workers=True),
            Phase("route forecasts", route_jobs, _route_text, workers=True), Phase("route check", check_jobs, _route_text)),
    report=Report(sections={(80, 4): "mergescope.advise.report:section"}, summary={"route_forecast": "Forecasting a route"},
                  kinds={"advise_check": "the advisor against merges it did not see: coverage and advised against runner-up",
                         "pair_dev": "a pair's pre-merge diagnostics for every route (configs, tokenizers, FLORES dev)",
                         "route_forecast": "a route's forecast fitted and validated on the experiment's merges of that route",
                         "advise": "every route of a pair with its forecast gain, before any merge"}),
)]
