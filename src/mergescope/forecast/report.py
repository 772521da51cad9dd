"""The forecast in the report: "What predicts a merge" -- held-out scores per validation and per operator beside the
anchor's, the shuffled-target control, the features that carry the final model, its calibration, and the held-out
forecast of each pair's merges beside what they measured."""

from __future__ import annotations

import csv
import io
import json
import math

import numpy as np

from mergescope.analysis.context import Analysis
from mergescope.analysis.tables import RTable, Section, f3, short
from mergescope.forecast.fit import MIN_CLASS
from mergescope.forecast.table import TARGET
from mergescope.plotting import pyplot

__all__ = ["section"]


def _ci(v: float, lo: float, hi: float) -> str:
    return "—" if not math.isfinite(v) else f"{v:+.3f} [{lo:+.3f}, {hi:+.3f}]" if math.isfinite(lo) else f"{v:+.3f}"


def _auroc(val: dict) -> str:
    pos = int(val.get("n_positive", MIN_CLASS))
    if min(pos, int(val["n"]) - pos) < MIN_CLASS:  # too few of one outcome: the number would be noise
        return f"not read: {pos} of {val['n']} merges positive (fewer than {MIN_CLASS} of one kind)"
    return _ci(val["auroc"], *val["auroc_ci"])


def _gap(val: dict, key: str) -> str:
    """The forecast's Spearman minus a baseline's on the same merges, paired, with its interval and what it says."""
    g = val.get(key)
    if not g or not all(np.isfinite(g)):
        return "—"
    said = "forecast better" if g[1] > 0 else "baseline better" if g[2] < 0 else "cannot be told apart"
    return f"{g[0]:+.3f} [{g[1]:+.3f}, {g[2]:+.3f}]: {said}"


def _scores(val: dict, name: str) -> list[str]:
    lo, hi = val["spearman_ci"]
    nodiag = _ci(val["nodiag_spearman"], *val["nodiag_ci"]) if "nodiag_spearman" in val else "—"
    return [name, str(val["n"]), _ci(val["spearman"], lo, hi), _auroc(val),
            _ci(val["single_spearman"], *val["single_ci"]), _gap(val, "lasso_minus_single"), nodiag,
            _gap(val, "lasso_minus_nodiag"),
            f"{val['shuffled_mean']:+.3f} [{val['shuffled_range'][0]:+.3f}, {val['shuffled_range'][1]:+.3f}]"]


def _calibration_figure(cal: list[dict]):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.5, 4))
    p = [c["predicted"] for c in cal]
    m = [c["measured"] for c in cal]
    ax.plot(p, m, "o-", label="held-out bins (leave one family out)")
    lo, hi = min(p + m), max(p + m)
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="predicted = measured")
    ax.set_xlabel("predicted gain over the better expert (nats/token)")
    ax.set_ylabel("measured gain")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _intro(sec: Section, r, rows: list[dict], split: bool) -> None:
    """What the fit read: merges, pairs and families per route."""
    routes = {}
    for row in rows:
        k = row.get("route", "checkpoint")
        routes.setdefault(k, [set(), set(), 0])
        routes[k][0].add(row["pair"])
        routes[k][1].add(row["family"])
        routes[k][2] += 1
    what = {"checkpoint": ("checkpoint pairs", "training runs"),
            "fine-tune": ("fine-tune pairs (two language experts of one base, scored on both languages)", "bases")}
    parts = [f"{n} merges of {len(p)} {what.get(k, (k, 'families'))[0]} in {len(f)} {what.get(k, (k, 'families'))[1]}"
             for k, (p, f, n) in sorted(routes.items())]
    sec.text.append("A lasso on the pair's standardised pre-merge diagnostics (from its weights, and on FLORES dev), "
                    + ("one per route, " if split else "") + "its penalty chosen on the training families only, fitted on "
                    f"{r.m('n_merges'):.0f} native merges"
                    + (f" ({'; '.join(parts)})" if parts else "") + f", {r.m('n_families'):.0f} families in all (a family: "
                    "one training run, or one fine-tune base); the target is each merge's gain over the better "
                    "expert (nats/token, the first token apart); beats = its paired 95% interval lies above 0 "
                    f"({r.m('beats_rate'):.0%} of the merges)."
                    + (f" One row per distinct merge: {r.m('n_repeats'):.0f} merges that are another operator's on "
                       "the same pair (task arithmetic at weight 1/2 is the linear average) are left out."
                       if r.m("n_repeats") > 0 else "")
                    + (f" {r.m('n_dropped'):.0f} merges are not in it: a diagnostic of their pair is missing (its "
                       "native or premerge run not finished, or a value not finite)." if r.m("n_dropped") > 0 else ""))


def _finding(sec: Section, r, lofo: dict, looo: dict) -> None:
    """The finding: within each route when there are several (the pooled number beside its control)."""
    routes = lofo.get("by_route") or {}
    if routes:
        inside = "; ".join(f"{k} {_ci(*routes[k][:3])} (shuffled within it {lofo['shuffled_by_route'][k][0]:+.3f})"
                           if k in lofo.get("shuffled_by_route", {}) else f"{k} {_ci(*routes[k][:3])}" for k in sorted(routes))
        sec.finding = (f"Held out by family, within each route predicted and measured gains rank together with Spearman "
                       f"{inside}. Pooled over routes {_ci(lofo['spearman'], *lofo['spearman_ci'])}, but the routes' "
                       f"typical gains alone give {lofo['shuffled_mean']:+.3f} (targets shuffled within each route): the "
                       f"within-route numbers are the forecast's (run {short(r.run_id)}).")
    else:
        sec.finding = (f"Held out by family, predicted and measured gains rank together with Spearman "
                       f"{_ci(lofo['spearman'], *lofo['spearman_ci'])} (shuffled-target control {lofo['shuffled_mean']:+.3f}); "
                       f"with the operator unseen {_ci(looo['spearman'], *looo['spearman_ci'])} (run {short(r.run_id)}).")


def _operators(sec: Section, lofo: dict, looo: dict) -> None:
    """Per operator (the goal), within each route and per operator within it."""
    ops = sorted(set(lofo["by_operator"]) | set(looo["by_operator"]))
    # the goal is read within each route when there are several: pooled over routes, the gap between their typical
    # gains alone would rank the merges
    within = lofo.get("by_route_operator") or {}
    per = within or {op: lofo["by_operator"][op] for op in ops if op in lofo["by_operator"]}
    met = [k for k, (rho, lo, _, _) in per.items() if math.isfinite(lo) and lo >= 0.55]
    where = "within its route " if within else ""
    sec.text.append(f"Per operator {where}(route|operator), held out by family: Spearman {min(x[0] for x in per.values()):+.3f} to "
                    f"{max(x[0] for x in per.values()):+.3f}; the goal of 0.55 is met with its interval for "
                    f"{len(met)} of {len(per)}" + (f" ({', '.join(met)})" if met else "") + "." if per else
                    "Per operator: no held-out predictions.")
    sec.tables.append(RTable("Held-out Spearman per operator, every route pooled", ["operator", "merges", "leave one family out", "leave one operator out"],
                             [[op, str(lofo["by_operator"].get(op, [0, 0, 0, 0])[3]), _ci(*lofo["by_operator"][op][:3]) if op in lofo["by_operator"] else "—",
                               _ci(*looo["by_operator"][op][:3]) if op in looo["by_operator"] else "—"] for op in ops],
                             note="goal: 0.55 or more for every operator (above the anchor's 0.26-0.50); an interval "
                                  "reaching below it says the data does not get there" + ("; with several routes read "
                                  "the table within routes below: pooled, the routes' different typical gains inflate it" if within else "")))
    if lofo.get("by_route"):
        shr = lofo.get("shuffled_by_route", {})
        sec.tables.append(RTable("Held-out Spearman within each route, and per operator within it",
                                 ["route | operator", "merges", "leave one family out", "leave one operator out",
                                  "shuffled within the route (leave one family out)"],
                                 [[k, str(d[k][3]), _ci(*d[k][:3]), _ci(*e[k][:3]) if k in e else "—",
                                   f"{shr[k][0]:+.3f} [{shr[k][1]:+.3f}, {shr[k][2]:+.3f}]" if k in shr else "—"]
                                  for d, e in ((lofo["by_route"], looo.get("by_route", {})),
                                               (lofo.get("by_route_operator", {}), looo.get("by_route_operator", {})))
                                  for k in sorted(d)],
                                 note="within a route the ranking must hold without the gap between routes' typical gains; "
                                      "a route with one family left in training (fine-tune: two bases) is predicted from one. "
                                      "Leaving an operator out keeps the pair's other operators' merges in training (the same "
                                      "features, known outcomes): an easier test than a new family"))


def _families_and_models(sec: Section, v: dict, lofo: dict) -> None:
    """Each held-out family alone, and the final model(s)."""
    fams = lofo.get("by_group") or {}
    if fams:
        ranked = {f: t for f, t in fams.items() if math.isfinite(t[0])}
        flat = [f for f, t in fams.items() if not math.isfinite(t[0])]
        sec.text.append("Inside each held-out family: Spearman " + ", ".join(f"{f} {t[0]:+.2f}" for f, t in ranked.items())
                        + (f"; a constant forecast (no ranking) for {', '.join(flat)}" if flat else "") + ".")
        sec.tables.append(RTable("Each family held out: the ranking inside it, and its level", [
            "family", "merges", "Spearman inside the family", "mean forecast", "mean measured"],
            [[f, str(t[3]), _ci(*t[:3]) if math.isfinite(t[0]) else "— (a constant forecast: intercept only)",
              f"{t[4]:+.4f}", f"{t[5]:+.4f}"] for f, t in fams.items()],
            note="a family's merges predicted by models fitted without it (leave one family out); inside one family the "
                 "ranking is read apart from whether its typical gain was foreseen (the pooled Spearman mixes both)"))
    finals = v.get("finals") or {"all": v["final"]}
    for route, fin in finals.items():
        coef = sorted(zip(fin["features"], fin["coef"]), key=lambda t: -abs(t[1]))
        whom = "every merge" if route == "all" else f"every {route} merge"
        sec.tables.append(RTable(f"The final model ({whom}; standardised coefficients)", ["feature", "coefficient"],
                                 [[n, f"{c:+.4f}"] for n, c in coef if c != 0] or [["(none: the intercept alone)", "—"]],
                                 note=f"lambda {fin['lambda']:g}; intercept {fin['intercept']:+.4f}; left out: "
                                      + "; ".join(f"{k} ({w})" for k, w in v["excluded"].items())))


def section(an: Analysis, number: str) -> Section | None:
    runs = an.study.kind("forecast")
    if not runs:
        return None
    r = runs[-1]
    sec = Section("forecast", f"{number}. What predicts a merge: the forecast on merges it has not seen")
    text = an.study.artifact_text(r.run_id, "forecast/validation.json")
    if text is None:
        sec.missing.append(f"forecast: run {short(r.run_id)} has no validation.json")
        return sec
    v = json.loads(text)
    lofo, looo = v["lofo"], v["looo"]
    pred = an.study.artifact_text(r.run_id, "forecast/predictions.csv")
    rows = list(csv.DictReader(io.StringIO(pred))) if pred else []
    _intro(sec, r, rows, any(k != "all" for k in v.get("finals", {})))
    _finding(sec, r, lofo, looo)
    sec.text.append(sec.finding)
    sec.tables.append(RTable("Held-out scores (95% intervals: bootstrap over pairs)", [
        "validation", "merges", "Spearman", "AUROC (beats)", "single best feature", "forecast minus it",
        "no diagnostic", "forecast minus it", "shuffled-target control"],
        [_scores(lofo, "leave one family out"), _scores(looo, "leave one operator out"),
         *([_scores(v["avg"], "leave one family out, gain over the endpoints' mean (AUROC: gain > 0)")] if "avg" in v else []),
         ["anchor (Zhou et al., ViT-B)", "190 task pairs", "0.26-0.50 pooled by method", "—", "about -0.44 (gradient L2)",
          "—", "—", "—", "—"]],
        note="Spearman of held-out predictions against measured gains, pooled over the held-out groups; the single best "
             "feature is chosen on the training groups by |Spearman|; the no-diagnostic forecast reads no diagnostic at "
             "all (each operator's mean gain over the training rows); \"forecast minus it\": the paired difference of "
             "the two Spearmans on the same merges, 95% interval over pairs; the control refits on permuted targets "
             f"({lofo.get('n', 0)} rows, mean and 95% range over the refits). {v['anchor']}."))
    _operators(sec, lofo, looo)
    _families_and_models(sec, v, lofo)
    cal = lofo["calibration"]
    if cal:
        sec.tables.append(RTable("Calibration (held out by family): predicted vs measured, by quintile of the prediction",
                                 ["bin", "merges", "predicted", "measured"],
                                 [[f"{c['bin']:.0f}", f"{c['n']:.0f}", f3(c["predicted"], 4), f3(c["measured"], 4)] for c in cal]))
        sec.add_figure("forecast_calibration", "forecast calibration: predicted vs measured gain", lambda: _calibration_figure(cal))
    if pred:
        by_pair: dict[str, list] = {}
        for row in rows:
            by_pair.setdefault(row["pair"], []).append(row)
        sec.tables.append(RTable("Each pair: its held-out forecast (leave one family out) beside what its merges measured, mean over operators",
                                 ["pair", "merges", "forecast", "measured", "beat both experts"],
                                 [[p, str(len(rs)), f"{sum(float(x['predicted_lofo']) for x in rs) / len(rs):+.4f}",
                                   f"{sum(float(x[TARGET]) for x in rs) / len(rs):+.4f}", f"{sum(int(x['beats']) for x in rs)}/{len(rs)}"]
                                  for p, rs in by_pair.items()]))
        an.csv["tables/forecast_predictions.csv"] = pred
    return sec
