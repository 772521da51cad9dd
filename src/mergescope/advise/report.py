"""The route forecasts in the report: "Forecasting a route before merging" -- per route, what its benchmark holds, its
held-out scores three ways (target unseen, pair unseen, both models unseen) with Pearson beside Spearman, the
shuffled-target control and the two baselines, each family's level, and the final model's coefficients."""

from __future__ import annotations

import json
import math

from mergescope.analysis.context import Analysis
from mergescope.analysis.tables import RTable, Section, short

__all__ = ["section", "GOAL"]

GOAL = 0.55  # the held-out Spearman a route's forecast is asked for (the merge forecast's own goal)
ANCHOR = ("Zhou et al. 2026 (arXiv 2601.22285), same-architecture ViT-B task pairs, leave one task out: held-out Pearson "
          "0.54-0.66; none forecasts across architectures")


def _ci(v, lo, hi, why: str = "nothing left to fit on") -> str:
    if v is None or not math.isfinite(v):
        return f"— ({why})"
    return f"{v:+.3f} [{lo:+.3f}, {hi:+.3f}]" if lo is not None and math.isfinite(lo) else f"{v:+.3f}"


def _gap(g) -> str:
    if not g or not all(math.isfinite(x) for x in g):
        return "—"
    said = "forecast better" if g[1] > 0 else "baseline better" if g[2] < 0 else "cannot be told apart"
    return f"{g[0]:+.3f} [{g[1]:+.3f}, {g[2]:+.3f}]: {said}"


def _within(m: dict) -> str:
    """The both-unseen ranking within each operator setting: what the forecast says beyond which setting was used."""
    within = {k.split(".", 1)[1]: x for k, x in m.items() if k.startswith("member_spearman.") and math.isfinite(x)}
    if not within:
        return ""
    return (" Within one operator setting (an alpha, a ratio, an operator at a mix: what it says beyond the setting): "
            + ", ".join(f"{k} {x:+.2f}" for k, x in sorted(within.items())) + ".")


def _verdict(route: str, m: dict, n_fam: int) -> str:
    rho, lo = m.get("member_spearman", float("nan")), m.get("member_spearman_lo", float("nan"))
    n = int(m.get("n_merges", 0))
    if not math.isfinite(rho):
        return f"{route}: with both models of a pair held out nothing is left to fit on ({n_fam} models): no verdict."
    reach = (f"meets the goal of {GOAL} with its lower bound" if lo >= GOAL
             else f"reaches the goal of {GOAL} in its estimate but not its lower bound" if rho >= GOAL
             else f"falls short of the goal of {GOAL}")
    return (f"{route}: on {n} merges, the forecast ranks the merges of pairs whose two models it never saw at Spearman "
            f"{rho:+.3f} [{lo:+.3f}, {m.get('member_spearman_hi', float('nan')):+.3f}] (Pearson "
            f"{m.get('member_pearson', float('nan')):+.3f}); it {reach}; shuffled-"
            f"target control {m.get('family_shuffled_spearman', float('nan')):+.3f}." + _within(m))


def section(an: Analysis, number: str) -> Section | None:
    runs = an.study.kind("route_forecast")
    if not runs:
        return None
    latest = {}
    for r in runs:  # the newest fit per route
        latest[r.tags.get("route")] = r
    sec = Section("route_forecast", f"{number}. Forecasting a route before merging")
    sec.text.append("Each route's forecast: a lasso on its merges' pre-merge diagnostics (configs, tokenizers and FLORES "
                    "dev: widths, depths, vocabulary overlap, bits per byte, calibrated CKA) with one indicator per "
                    "operator (a transport alpha, an adapt ratio), "
                    "its penalty chosen on the training families; validated with the target model unseen, the pair "
                    "unseen, and both of the pair's models unseen (the advisor's case). task=advise reads these fits.")
    verdicts = []
    for route, r in sorted(latest.items()):
        m = r.metrics
        text = an.study.artifact_text(r.run_id, "forecast/validation.json")
        if text is None:
            sec.missing.append(f"route_forecast {route}: run {short(r.run_id)} has no validation.json")
            continue
        v = json.loads(text)
        fam = v["family"]
        verdicts.append(_verdict(route, m, int(m.get("n_families", 0))))
        rows = []
        for scheme, what in (("family", "target model unseen"), ("pair", "pair unseen"), ("member", "both models unseen")):
            rows.append([what, f"{m.get(f'{scheme}_n', 0):.0f}",
                         _ci(m.get(f"{scheme}_spearman"), m.get(f"{scheme}_spearman_lo"), m.get(f"{scheme}_spearman_hi")),
                         _ci(m.get(f"{scheme}_pearson"), m.get(f"{scheme}_pearson_lo"), m.get(f"{scheme}_pearson_hi"))])
        rows.append(["anchor", "—", "—", "0.54-0.66 (ViT-B, one architecture)"])
        sec.tables.append(RTable(f"{route}: held-out scores on {m.get('n_merges', 0):.0f} merges of {m.get('n_pairs', 0):.0f} "
                                 f"pairs, {m.get('n_families', 0):.0f} target models [{short(r.run_id)}]",
                                 ["held out", "merges", "Spearman [95%]", "Pearson [95%]"], rows,
                                 note="pooled over the held-out folds; intervals: bootstrap over pairs. " + ANCHOR))
        sec.tables.append(RTable(f"{route}: against its baselines and its control (target model unseen)",
                                 ["comparison", "value"],
                                 [["single best feature (chosen on the training families)", _ci(fam["single_spearman"], *fam["single_ci"])],
                                  ["forecast minus it (paired, same merges)", _gap(fam.get("lasso_minus_single"))],
                                  ["no diagnostic (each alpha's training mean)", _ci(fam["nodiag_spearman"], *fam["nodiag_ci"])],
                                  ["forecast minus it", _gap(fam.get("lasso_minus_nodiag"))],
                                  ["shuffled-target control (mean, 95% range)",
                                   f"{fam['shuffled_mean']:+.3f} [{fam['shuffled_range'][0]:+.3f}, {fam['shuffled_range'][1]:+.3f}]"]]))
        groups = fam.get("by_group") or {}
        if groups:
            sec.tables.append(RTable(f"{route}: each target model held out (its ranking and its level)",
                                     ["target", "merges", "Spearman inside", "mean forecast", "mean measured"],
                                     [[g, str(t[3]), _ci(*t[:3], why="a constant forecast inside it"), f"{t[4]:+.4f}", f"{t[5]:+.4f}"]
                                      for g, t in groups.items()]))
        fin = v["final"]
        coef = sorted(zip(fin["features"], fin["coef"]), key=lambda t: -abs(t[1]))
        sec.tables.append(RTable(f"{route}: the final model (standardised coefficients)", ["feature", "coefficient"],
                                 [[n, f"{c:+.4f}"] for n, c in coef if c != 0] or [["(none: the intercept alone)", "—"]],
                                 note=f"lambda {fin['lambda']:g}; intercept {fin['intercept']:+.4f}"))
    checks = an.study.kind("advise_check")
    if checks:
        verdicts.append(_check(sec, checks[-1]))
    sec.finding = " ".join(verdicts)
    sec.text.insert(0, sec.finding)
    return sec


def _check(sec: Section, r) -> str:
    """The advisor against merges it did not see: coverage per route and pooled, the advised route against the
    runner-up; its one-sentence verdict."""
    m = r.metrics
    level = m.get("level", 0.9)
    kinds = sorted(k.split(".", 1)[1] for k in m if k.startswith("coverage.") and not k.startswith("coverage_"))
    rows = [[k.replace("_", " ").replace("transport adapt", "transport+adapt"), f"{m.get(f'n_merges.{k}', 0):.0f}",
             _rate(m, f"coverage.{k}", f"coverage_lo.{k}", f"coverage_hi.{k}")] for k in kinds]
    rows.append(["all routes", f"{m.get('n_merges', 0):.0f}", _rate(m, "coverage", "coverage_lo", "coverage_hi")])
    sec.tables.append(RTable(f"the advisor against merges it did not see: each merge's {level:.0%} interval from the fit that "
                             f"held its pair out [{short(r.run_id)}]", ["route", "merges", f"coverage (nominal {level:.2f}) [95%]"],
                             rows, note="interval: the held-out prediction plus the quantiles of the same route's held-out "
                                        "residuals of the other pairs; 95% interval of the coverage: bootstrap over pairs"))
    n = m.get("n_pairs", 0)
    sec.tables.append(RTable(f"the advised route against the runner-up on {n:.0f} held-out pairs", ["", "share of pairs [95%]"],
                             [["the advised merge measured the larger gain (a coin: 0.50)",
                               _rate(m, "advised_beats_other", "advised_beats_other_lo", "advised_beats_other_hi")],
                              ["the advised merge helped (its interval above 0)", _rate(m, "advised_helps", "advised_helps_lo", "advised_helps_hi")],
                              ["the runner-up helped", _rate(m, "other_helps", "other_helps_lo", "other_helps_hi")],
                              ["advised minus runner-up, mean gain (nats/token)",
                               _ci(m.get("advised_minus_other"), m.get("advised_minus_other_lo"), m.get("advised_minus_other_hi"))],
                              ["the oracle's gain minus the advised one (regret)", f"{m.get('regret_vs_oracle', float('nan')):+.4f}"]],
                             note="per held-out pair, the advised merge is the route and operator with the highest held-out "
                                  "forecast, the runner-up the best-forecast merge of the next route; intervals: bootstrap over pairs"))
    cov, lo, hi = m.get("coverage", float("nan")), m.get("coverage_lo", float("nan")), m.get("coverage_hi", float("nan"))
    held = "holds its level" if lo <= level <= hi else "under-covers" if hi < level else "over-covers"
    b, b_lo, b_hi = (m.get(k, float("nan")) for k in ("advised_beats_other", "advised_beats_other_lo", "advised_beats_other_hi"))
    pick = ("beats a coin" if b_lo > 0.5 else "loses to a coin" if b_hi < 0.5 else "cannot be told from a coin")
    return (f"Against merges it did not see ({n:.0f} held-out pairs): the {level:.0%} interval covers {cov:.2f} [{lo:.2f}, "
            f"{hi:.2f}] of the merges ({held}); the advised route measured more than the runner-up in {b:.2f} [{b_lo:.2f}, "
            f"{b_hi:.2f}] of the pairs ({pick}).")


def _rate(m: dict, k: str, lo: str, hi: str) -> str:
    v = m.get(k)
    if v is None or not math.isfinite(v):
        return "—"
    return f"{v:.2f} [{m.get(lo, float('nan')):.2f}, {m.get(hi, float('nan')):.2f}]"
