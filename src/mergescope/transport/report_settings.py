"""Transport settings swept across runs: epsilon calibration (``study=epsilon_calibration``) and probe count
(``study=probe_count``). Each section appears only when the experiment's transport runs differ in that setting.

Plan statistics are the same for every alpha of one direction (the plans are fitted once), so each direction
counts once per setting: its run at the headline alpha (:func:`~mergescope.analysis.records.transport_headline`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from mergescope.analysis.records import Rec, direction, transport_headline
from mergescope.analysis.context import Analysis
from mergescope.analysis import claims
from mergescope.transport.report import CLAIM_RULE
from mergescope.analysis.tables import RTable, Section, f3, short
from mergescope.plotting import pyplot

__all__ = ["epsilon_of", "probe_of", "by_setting", "epsilon_rows", "epsilon_section", "probe_section", "figure_epsilon",
           "epsilon_calibration", "probe_count", "EPSILON_COLUMNS"]

EPSILON_COLUMNS = ["epsilon", "directions", "cost mean (1 - rho)", "cost sd", "plan_row_max", "uniform 1/m", "row_max x m",
                   "plan_entropy", "plan_cost_ratio", "log-domain fallbacks", "mean delta_target_lang", "runs"]


def epsilon_of(r: Rec) -> float:
    """The run's ``merge.epsilon`` (logged config param)."""
    v = r.param("merge.epsilon")
    return float(v) if isinstance(v, (int, float)) else math.nan


def probe_of(r: Rec) -> tuple[str, int]:
    """The run's probe set and the number of probe sentences it fitted its plans on (``n_probe``)."""
    ps = r.param("merge.probe_set") or "flores200"  # the default is left out of the job config
    n = r.m("n_probe")
    return str(ps), int(n) if np.isfinite(n) else int(r.param("merge.probe_sentences") or 0)


def by_setting(runs: list[Rec], key: Callable[[Rec], Any]) -> dict[Any, list[Rec]]:
    """Setting value -> one run per direction (its headline-alpha run), in setting order."""
    cells: dict[tuple[Any, str], list[Rec]] = {}
    for r in runs:
        cells.setdefault((key(r), direction(r)), []).append(r)
    out: dict[Any, list[Rec]] = {}
    for (value, _), rs in cells.items():
        h = transport_headline(rs) or rs[0]
        out.setdefault(value, []).append(h)
    return dict(sorted(out.items()))


def _mean(rs: list[Rec], key: str) -> float:
    vals = [r.m(key) for r in rs if np.isfinite(r.m(key))]
    return float(np.mean(vals)) if vals else math.nan


def _fallback_share(rs: list[Rec]) -> str:
    fb, n = sum(r.m("plan_log_domain_fallbacks") for r in rs), sum(r.m("n_plans") for r in rs)
    return f"{int(fb)}/{int(n)} ({100 * fb / n:.0f}%)" if n > 0 and np.isfinite(fb + n) else "—"


def epsilon_rows(groups: dict[float, list[Rec]]) -> list[list[str]]:
    rows = []
    for eps, rs in groups.items():
        rm, u = _mean(rs, "plan_row_max"), _mean(rs, "plan_uniform_row_max")
        rows.append([f"{eps:g}", str(len(rs)), f3(_mean(rs, "plan_cost_mean"), 4), f3(_mean(rs, "plan_cost_sd"), 4), f3(rm, 4),
                     f3(u, 4), f3(rm / u if u > 0 else math.nan, 2), f3(_mean(rs, "plan_entropy")), f3(_mean(rs, "plan_cost_ratio"), 4),
                     _fallback_share(rs), f3(_mean(rs, "delta_target_lang"), 4), ", ".join(short(r.run_id) for r in rs[:6])])
    return rows


def failed_settings(an: Analysis) -> dict[float, list[tuple[str, str, str]]]:
    """epsilon -> (run id, direction, reason) of the experiment's FAILED transport runs whose plans did not converge
    (the study records them and goes on: a non-converging epsilon is a calibration result)."""
    out: dict[float, list[tuple[str, str, str]]] = {}
    for r in an.study.failed("transport"):
        err = r.tags.get("error", "")
        if r.tags.get("outcome") == "not_converged" or "did not converge" in err:  # the string: stores before the tag
            eps = float(r.params.get("merge.epsilon", "nan"))
            d = direction(r)
            if all(d != x[1] for x in out.get(eps, [])):  # a relaunch retries and fails again: one per direction
                out.setdefault(eps, []).append((r.run_id, d, err))
    return dict(sorted(out.items()))


def failed_rows(failed: dict[float, list[tuple[str, str, str]]], done: dict[float, list[Rec]]) -> list[list[str]]:
    """One row per epsilon with a non-converged direction: how many of its directions converged, and why not."""
    return [[f"{eps:g}", f"{len(done.get(eps, []))} of {len(done.get(eps, [])) + len(fs)}", fs[0][2][:300],
             ", ".join(short(rid) for rid, _, _ in fs[:6])] for eps, fs in failed.items()]


def epsilon_section(an: Analysis, runs: list[Rec], number: str) -> Section:
    """Per epsilon: the neuron-cost statistics, the plans' sharpness against uniform, cost ratio and fallbacks."""
    sec = Section("epsilon_calibration", f"{number}. Epsilon calibration of the transport plans")
    groups = by_setting(runs, epsilon_of)
    sec.text.append("merge.epsilon swept over the same directions (one run per direction and epsilon, at its headline alpha). "
                    "The neuron costs 1 - rho do not depend on epsilon; the plan does: row_max x m = 1 is the uniform coupling "
                    "(epsilon too large: every target neuron averages all donor neurons), m is a hard assignment.")
    sec.tables.append(RTable("Epsilon calibration", EPSILON_COLUMNS, epsilon_rows(groups),
                             note="Means over directions (and over each direction's plans, every interface and layer). "
                                  "plan_cost_ratio = the plan's transport cost / the exact unregularised optimum; log-domain "
                                  "fallbacks = plans plain Sinkhorn could not solve to merge.marginal_tol, of all plans fitted."))
    sec.add_figure("epsilon_calibration", "transport plans against merge.epsilon: sharpness, entropy, cost ratio, fallbacks",
                   lambda: figure_epsilon(runs))
    failed = failed_settings(an)
    if failed:
        sec.tables.append(RTable("Epsilon settings whose plans did not converge (FAILED runs, reason logged as tag `error`)",
                                 ["epsilon", "directions converged", "reason (first failure)", "failed runs"],
                                 failed_rows(failed, groups),
                                 note="A plan is accepted only when both marginals meet merge.marginal_tol within merge.max_iter "
                                      "Sinkhorn iterations (plain, then on the reduced cost plain, stabilised, log-domain); "
                                      "no fusion runs through a plan that fails."))
    an.csv["tables/epsilon_calibration.csv"] = sec.tables[0].csv()
    an.console_tables.append(sec.tables[0])
    return sec


def probe_section(an: Analysis, runs: list[Rec], number: str) -> Section:
    """Per probe set and probe count: the plans' statistics and the fusion deltas, direction by direction."""
    sec = Section("probe_count", f"{number}. Probe count: the plans and the deltas against the number of probe sentences")
    groups = by_setting(runs, probe_of)
    rows = [[ps, str(n), direction(r), f3(r.m("plan_cost_mean"), 4), f3(r.m("plan_row_max"), 4), f3(r.m("plan_entropy")),
             f3(r.m("plan_cost_ratio"), 4), claims.cell(r, "delta_target_lang"), claims.cell(r, "ot_minus_rand_target_lang"),
             short(r.run_id)]
            for (ps, n), rs in groups.items() for r in sorted(rs, key=direction)]
    sec.tables.append(RTable("Probe count", ["probe set", "probes", "direction", "cost mean (1 - rho)", "plan_row_max", "plan_entropy",
                                             "plan_cost_ratio", "delta_target_lang", "ot_minus_rand_target_lang", "run"], rows,
                             note="One run per direction and probe setting, at its headline alpha. Probes are never the evaluation "
                                  "sentences (FLORES devtest): flores200 = FLORES dev, ntrex128 = NTREX-128 (1997 sentences). "
                                  f"Differences in nats/token {claims.SCOPE_NOTE[claims.SCOPE['value']]}, with their paired 95% "
                                  "intervals over the evaluation's FLORES articles."))
    summary = [[ps, str(n), str(len(rs)), f3(_mean(rs, "plan_row_max"), 4), f3(_mean(rs, "plan_entropy")),
                f3(_mean(rs, claims.metric("delta_target_lang")), 4),
                f"{claims.count_lower(rs, 'ot_minus_rand_target_lang')}/{len(rs)}"]
               for (ps, n), rs in groups.items()]
    sec.tables.append(RTable("Probe count: means over directions", ["probe set", "probes", "directions", "plan_row_max",
                                                                    "plan_entropy", "mean delta_target_lang", "beats control"], summary,
                             note=f"beats control: {CLAIM_RULE}."))
    an.csv["tables/probe_count.csv"] = sec.tables[0].csv()
    return sec


def figure_epsilon(runs: list[Rec]):
    """Four panels against epsilon (log scale), one line per direction: row_max with the uniform 1/m, entropy,
    cost ratio, share of plans on the log-domain solver."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    per_dir: dict[str, list[Rec]] = {}
    for eps, rs in by_setting(runs, epsilon_of).items():
        for r in rs:
            per_dir.setdefault(direction(r), []).append(r)
    panels = [("plan_row_max", "mean row max of Phi"), ("plan_entropy", "mean row entropy (nats)"),
              ("plan_cost_ratio", "cost / unregularised optimum"), ("fallback", "share of plans on log-domain Sinkhorn")]
    for d, rs in per_dir.items():
        xs = [epsilon_of(r) for r in rs]
        for ax, (key, _) in zip(axes, panels):
            ys = [r.m("plan_log_domain_fallbacks") / r.m("n_plans") if key == "fallback" else r.m(key) for r in rs]
            ax.plot(xs, ys, "o-", label=d, lw=1)
        axes[0].plot(xs, [r.m("plan_uniform_row_max") for r in rs], "k--", lw=0.8)
    for ax, (_, label) in zip(axes, panels):
        ax.set(xscale="log", xlabel="merge.epsilon", ylabel=label)
    axes[0].set_title("row max (dashed: uniform 1/m)", fontsize=9)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    return fig


def epsilon_calibration(an: Analysis, number: str) -> Section | None:
    """The epsilon section, when the experiment's transport runs (or its non-converged ones) differ in merge.epsilon."""
    runs = an.study.kind("transport")
    if len({e for e in map(epsilon_of, runs) if np.isfinite(e)} | set(failed_settings(an))) > 1:
        return epsilon_section(an, runs, number)
    return None


def probe_count(an: Analysis, number: str) -> Section | None:
    """The probe-count section, when the experiment's transport runs differ in their probe set or count."""
    runs = an.study.kind("transport")
    return probe_section(an, runs, number) if len({probe_of(r) for r in runs}) > 1 else None
