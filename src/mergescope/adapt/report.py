"""Report section: dimensional adaptation (Expand / Truncate then small-ratio averaging).

Ratio curves per pair and protocol (union at both ends, intersection one-sided), the collapse band (grid
ratios worse than both ends), the ratio chosen on the validation split with its test numbers, controls
against the merge, the comparison operators, the seesaw per task (language, FLORES domain), attention
entropy and residual norm, the gain against the size gap and the competence overlap of each pair (nested /
intersecting / reversed, from the two source models' task profiles), with run ids and a PNG figure (embedded in
the report as a data URI).
"""

from __future__ import annotations

import itertools
import math
import re

import numpy as np

from mergescope.analysis import claims
from mergescope.analysis.records import Rec
from mergescope.analysis.context import Analysis
from mergescope.analysis.tables import RTable, Section, f3, short
from mergescope.plotting import pyplot

__all__ = ["adapt_section", "chosen_point", "concentration", "expansion_tables", "gap_rows", "per_ratio_rows", "seesaw_rows"]


def _groups(runs: list[Rec]) -> dict[tuple[str, str, str], list[Rec]]:
    out: dict[tuple[str, str, str], list[Rec]] = {}
    for r in runs:
        out.setdefault((r.tags.get("small", ""), r.tags.get("large", ""), r.tags.get("protocol", "")), []).append(r)
    return out


def _points(runs: list[Rec], tested: bool = False) -> list[Rec]:
    """The merge's point runs by ratio, one per ratio: where a ratio was scored on the validation split alone and then
    on both (``adaptation.grid_scored=val``, the chosen ratio), the run scored on both. ``tested``: only the ratios
    scored on the test split."""
    by: dict[float, Rec] = {}
    for r in (r for r in runs if r.tags.get("control") == "none" and r.tags.get("ratio") != "best"):
        k = r.m("ratio")
        if k not in by or (math.isnan(by[k].m("test_nll")) and not math.isnan(r.m("test_nll"))):
            by[k] = r
    return [by[k] for k in sorted(by) if not tested or not math.isnan(by[k].m("test_nll"))]


def _curve_table(key, pts: list[Rec]) -> RTable:
    rows = [[f"{r.m('ratio'):g}", f3(r.m("val_nll")), f3(r.m("test_nll")), f3(r.m("test_bpb")),
             f3(r.m("attn_entropy_mean")), f3(r.m("resid_norm_final")), short(r.run_id)] for r in pts]
    return RTable(f"{key[2]}: {key[0]} ~ {key[1]} ({'E(small)' if key[2] == 'union' else 'small'} at 0, "
                  f"{'large' if key[2] == 'union' else 'T(large)'} at 1)",
                  ["ratio", "val NLL", "test NLL", "test bits/byte", "attn entropy", "residual norm", "run"], rows,
                  note="NLL in nats/token (one tokenizer; every token predicted from the start token), mean over the "
                       "languages; attention entropy over the heads that reach the residual stream, mean over layers; "
                       "residual norm = the last layer's output before the final norm")


def compared_merges(runs: list[Rec]) -> list[str]:
    """The merge presets the chosen-ratio runs were compared with (``adaptation.compare``: each logs
    ``test_nll_<preset>``), by name: the summary's comparison columns, derived from the runs, not listed here."""
    from mergescope.config import conf_options

    best = [r for r in runs if r.tags.get("ratio") == "best"]
    return [n for n in sorted(conf_options("merge")) if any(f"test_nll_{n}" in r.metrics for r in best)]


def _test_tables(study, run: Rec):
    """A point run's test split per language from its per-sentence table: ({language: Scores}, {language: docs})."""
    table = study.score_table(run.run_id) if study is not None else None
    if table is None:
        return None
    sc, docs = table
    keys = [lang for (arm, lang) in sc if arm == "model" and lang.startswith("test.")]
    return ({k: sc[("model", k)] for k in keys}, {k: docs[k] for k in keys}) if keys else None


def collapse_band(study, pts: list[Rec]) -> str:
    """The grid ratios worse than both ends: each interior point's test NLL minus each end's, with its paired interval
    over FLORES articles (a mean over languages, an article drawn in every language at once), BH across the
    grid's comparisons; a ratio is in the band where both differences are "higher". Runs without tables: not told."""
    ends = {r.m("ratio"): r for r in pts if r.m("ratio") in (0.0, 1.0)}
    inner = [r for r in pts if 0 < r.m("ratio") < 1]
    if len(ends) < 2 or not inner:
        return "none in grid" if not inner else "no ends measured"
    if any(r.tags.get("scored") == "val" for r in inner):
        return "not measured (adaptation.grid_scored=val: the grid scored on the validation split alone)"
    rows = [_change(study, r, ends[end]) for r in inner for end in (0.0, 1.0)]
    if any(row is None for row in rows):
        return "not told (runs without per-sentence tables)"
    said = claims.table_verdicts(rows)
    band = [f"{r.m('ratio'):g}" for i, r in enumerate(inner) if said[2 * i] == said[2 * i + 1] == "higher"]
    return ", ".join(band) or "none in grid"


def _summary_row(key, runs: list[Rec], pts: list[Rec], compared: list[str], study=None) -> list[str] | None:
    best = next((r for r in runs if r.tags.get("ratio") == "best"), None)
    if best is None:
        return None
    band = collapse_band(study, pts)
    seeds = lambda k: (f" (mean of {best.m(f'{k}_seeds'):.0f} seeds, sd {best.m(f'test_nll_{k}_sd'):.4f})"  # noqa: E731
                       if math.isfinite(best.m(f"{k}_seeds")) else "")
    cells = [f3(best.m(f"test_nll_{k}")) + seeds(k) + (f" (merge minus it {claims.cell(best, f'best_minus_{k}')})"
                                             if math.isfinite(best.m(claims.metric(f"best_minus_{k}"))) else "")
             for k in ("scaling", "noise", *compared)]
    grid = [r.m("ratio") for r in pts if 0 < r.m("ratio") < 1]
    return [f"{key[2]} {key[0]} ~ {key[1]}", f"{best.m('best_ratio'):g}" + claims.edge_note(best.m("best_ratio"), grid),
            f3(best.m("best_test_nll")),
            f3(best.m("test_nll_r0")), f3(best.m("test_nll_r1")), claims.cell(best, "gain_vs_small"),
            claims.cell(best, "gain_vs_better_end"), *cells, band, short(best.run_id)]


def side_grid(chosen: float, grid) -> list[float]:
    """The grid ratios on the chosen ratio's side of 1/2: small-ratio mixing (a little of the large side) and
    near-1 mixing are two regimes, so 0.04 of [0.02, 0.04, 0.96, 0.98] sits at the small side's upper edge."""
    return [g for g in grid if (g < 0.5) == (chosen < 0.5)]


def headline(key, best: Rec, grid) -> str:
    """One pair's finding, what a careful reader needs first: the merge against ratio 0 (helps / hurts / cannot be
    told), then the merge against each control, the scaling control's own effect where it explains part of the
    gain, so the merge's own part (merge minus the scaling control) leads; the chosen ratio's edge within its side of
    the grid is said."""
    ctls = [k for k in ("scaling", "noise") if math.isfinite(best.m(f"test_nll_{k}"))]
    said = {"higher": "helps", "lower": "hurts", "tie": "cannot be told from", "too few": "too few articles to tell from",
            "no interval": "(no interval) against"}[claims.verdict(best, "gain_vs_small")]
    ratio = best.m("best_ratio")
    side = side_grid(ratio, grid)
    edge = claims.edge_note(ratio, side).replace(" (", "; ").rstrip(")") if len(side) >= 3 else (
        f"; at the {'upper' if ratio >= max(side) else 'lower'} edge {ratio:g} of the {len(side)} grid ratios on its side "
        "of 1/2: the optimum may lie beyond it" if side else "")
    out = (f"{key[2]} {key[0]} ~ {key[1]}: ratio {ratio:g} (chosen on dev{edge}) {said} ratio 0 on test (gain "
           f"{claims.cell(best, 'gain_vs_small')} nats/token)")
    if ctls:
        vs = claims.family([(best, f"best_minus_{k}") for k in ctls])
        words = {"lower": "beats it", "higher": "is worse than it", "tie": "cannot be told from it",
                 "too few": "too few articles to tell", "no interval": "no interval"}
        out += "; " + ", ".join(f"merge minus its {k} control {claims.cell(best, f'best_minus_{k}')} ({words[v]})"
                                for k, v in zip(ctls, vs))
        if "scaling" in ctls:
            k = claims.metric("best_minus_scaling")
            own, gain = -best.m(k), best.m(claims.metric("gain_vs_small"))
            if math.isfinite(own) and math.isfinite(gain) and gain > 0:
                out += (f"; the scaling control alone (the small model times 1 - ratio, nothing from the large one) gives "
                        f"{gain - own:+.4f} of the {gain:+.4f}, the merge's own part is {own:+.4f}")
    return out + f" (run {short(best.run_id)})"


def _tasks(pts: list[Rec]) -> list[str]:
    return sorted({k[len("test_nll."):] for r in pts for k in r.metrics if k.startswith("test_nll.")})


def chosen_point(runs: list[Rec], pts: list[Rec]) -> Rec | None:
    """The point run at the ratio the summary run chose on the validation split (None without a summary)."""
    best = next((r for r in runs if r.tags.get("ratio") == "best"), None)
    if best is None:
        return None
    return next((r for r in pts if math.isclose(r.m("ratio"), best.m("best_ratio"), abs_tol=1e-12)), None)


def seesaw_rows(key, pts: list[Rec], chosen: Rec | None, summary: Rec | None = None) -> tuple[list[list[str]], dict[str, int]]:
    """The seesaw of ONE model, the one chosen on the validation split: per task (language, FLORES domain), its test
    NLL against both ends of the ratio axis, each difference with its paired interval from the summary run
    (``seesaw_vs_r0.<task>``, ``seesaw_vs_r1.<task>``). ``regressed`` = worse than the ratio-0 anchor, ``worse than
    both`` = worse than either model it was built from: each only where the interval lies above 0 (a summary recorded
    before the intervals: "no interval", never counted)."""
    lo = next((r for r in pts if r.m("ratio") == 0.0), None)
    hi = next((r for r in pts if r.m("ratio") == 1.0), None)
    if chosen is None or lo is None or hi is None:
        return [], {}
    rows, counts = [], {"tasks": 0, "regressed": 0, "worse_than_both": 0}
    sm = summary if summary is not None else Rec("", 0, {}, {}, {})
    tasks = [t for t in _tasks(pts) if all(math.isfinite(x.m(f"test_nll.{t}")) for x in (chosen, lo, hi))]
    said = claims.family([(sm, f"seesaw_vs_r{e}.{t}") for e in (0, 1) for t in tasks])  # one table: BH across both ends
    for i, task in enumerate(tasks):
        k = f"test_nll.{task}"
        c, a, b = chosen.m(k), lo.m(k), hi.m(k)
        v0, v1 = said[i], said[len(tasks) + i]
        counts["tasks"] += 1
        counts["regressed"] += int(v0 == "higher")
        counts["worse_than_both"] += int(v0 == "higher" and v1 == "higher")
        rows.append([f"{key[2]} {key[0]} ~ {key[1]}", f"{chosen.m('ratio'):g}", task, f3(a), f3(b), f3(c),
                     claims.cell(sm, f"seesaw_vs_r0.{task}"), claims.cell(sm, f"seesaw_vs_r1.{task}"),
                     "yes" if v0 == "higher" else v0 if v0 in ("no interval", "too few") else "no",
                     "yes" if v0 == v1 == "higher" else "no", short(chosen.run_id)])
    return rows, counts


def per_ratio_rows(key, pts: list[Rec]) -> list[list[str]]:
    """Every grid ratio's change against ratio 0 per task (test split): a view of the curve, not a selection."""
    anchor = next((r for r in pts if r.m("ratio") == 0.0), None)
    if anchor is None:
        return []
    return [[f"{key[2]} {key[0]} ~ {key[1]}", task, *(f"{r.m(f'test_nll.{task}') - anchor.m(f'test_nll.{task}'):+.4f}"
                                                     for r in pts if r.m("ratio") > 0)]
            for task in _tasks(pts)]


def _count(v: float) -> str:
    return f"{int(v):,}" if math.isfinite(v) else "—"


def _num(v: float, fmt: str = "+.4f") -> str:
    return format(v, fmt) if math.isfinite(v) else "—"


def _ratio(small: float, large: float) -> str:
    return f"{large / small:.2f}" if small > 0 and math.isfinite(small) and math.isfinite(large) else "—"


def gap_rows(best: list[Rec]) -> list[list[str]]:
    """One row per summary run (kind=adapt, ratio=best), per protocol in order of the parameter ratio: the size gap
    (large / small parameters, hidden, depth), the competence overlap and the merge gain, with run ids."""
    def order(r: Rec) -> tuple:
        x = r.m("n_params_large") / r.m("n_params_small") if r.m("n_params_small") > 0 else math.inf
        return (r.tags.get("protocol", ""), x if math.isfinite(x) else math.inf, r.tags.get("large", ""))

    rows = []
    for r in sorted(best, key=order):
        frac = r.m("overlap_frac_large_better")
        sources = ", ".join(short(r.params.get(f"runs.source:{side}")) for side in ("small", "large")
                            if r.params.get(f"runs.source:{side}"))
        rows.append([r.tags.get("protocol", ""), f"{r.tags.get('small', '')} <- {r.tags.get('large', '')}",
                     _count(r.m("n_params_small")), _count(r.m("n_params_large")),
                     _ratio(r.m("n_params_small"), r.m("n_params_large")), _ratio(r.m("hidden_small"), r.m("hidden_large")),
                     _ratio(r.m("layers_small"), r.m("layers_large")), r.tags.get("competence", "—"),
                     "—" if math.isnan(frac) else f"{frac:.2f} of {r.m('overlap_tasks'):.0f}",
                     _num(r.m("small_better_margin"), ".4f"), claims.cell(r, "gain_vs_small"), claims.cell(r, "gain_vs_better_end"),
                     short(r.run_id), sources or "—"])
    return rows


def _exact_mean_test(x: list[float], y: list[float]) -> tuple[float, float]:
    """(two-sided exact permutation p of mean(x) - mean(y) over every split of the pooled values, the smallest p the
    design can reach: 2 / C(n, k), or 1 when that exceeds 1)."""
    pooled, k = [*x, *y], len(x)
    obs = abs(sum(x) / k - sum(y) / len(y))
    splits = list(itertools.combinations(range(len(pooled)), k))
    total = sum(pooled)
    hits = sum(1 for idx in splits
               if abs((s := sum(pooled[i] for i in idx)) / k - (total - s) / len(y)) >= obs - 1e-12 * max(1.0, obs))
    return hits / len(splits), min(1.0, 2.0 / len(splits))


def concentration(items: list[tuple[str, str, float]]) -> str:
    """One sentence: per protocol, whether the merge gain (``(protocol, competence, gain)`` items) differs between the
    intersecting pairs and the nested ones: an exact permutation test of the difference of mean gains over the pairs,
    a verdict only where p <= 0.05; where no split of so few pairs can reach it, "untestable at this n" and the signs.
    A protocol without both kinds of pair cannot tell; reversed pairs (the small model better everywhere it differs)
    are counted apart."""
    parts = []
    for proto in sorted({p for p, _, _ in items}):
        by = {c: [g for p, cc, g in items if p == proto and cc == c and math.isfinite(g)]
              for c in ("intersecting", "nested", "reversed")}
        inter, nest = by["intersecting"], by["nested"]
        rev = f"; {len(by['reversed'])} reversed pair(s) apart" if by["reversed"] else ""
        if not inter or not nest:
            parts.append(f"{proto}: cannot be told ({len(inter)} intersecting, {len(nest)} nested pairs{rev})")
            continue
        mi, mn = sum(inter) / len(inter), sum(nest) / len(nest)
        p, floor = _exact_mean_test(inter, nest)
        means = (f"mean gain vs small {mi:+.4f} over {len(inter)} intersecting pair(s) against {mn:+.4f} over "
                 f"{len(nest)} nested{rev}")
        if floor > 0.05:
            said = f"untestable at this n (the smallest attainable p is {floor:.2f}; the sign: {'higher' if mi > mn else 'lower'} on intersecting)"
        elif p <= 0.05:
            said = f"{'higher' if mi > mn else 'lower'} on intersecting pairs (exact permutation p {p:.3f})"
        else:
            said = f"cannot be told (exact permutation p {p:.2f})"
        parts.append(f"{proto}: {said}; {means}")
    return ("Whether the merge gains concentrate on intersecting pairs in this study (the mean gain over intersecting "
            "against nested pairs, an exact permutation test over the pairs): " + ("; ".join(parts) or "no pairs") + ".")


def _gap_table(sec: Section, groups) -> None:
    best = [r for rs in groups.values() for r in rs if r.tags.get("ratio") == "best"]
    if not best:
        return
    sec.tables.append(RTable(
        "Gain against the size gap and the competence overlap, per protocol and pair",
        ["protocol", "pair (small <- large)", "params small", "params large", "param ratio", "hidden ratio",
         "depth ratio", "competence", "large better (tasks)", "small-better margin", "gain vs small [95% CI]",
         "gain vs better end [95% CI]", "run", "source runs"], gap_rows(best),
        note="competence from the two source models scored as themselves (test split, nats/token, per language and "
             "FLORES domain): nested = the large model's NLL <= the small model's on every task; intersecting = each "
             "model better on at least one task; reversed = the small model better where they differ; "
             "small-better margin = summed NLL excess of the large model where the small one is better; the gains in "
             f"nats/token {claims.SCOPE_NOTE[claims.SCOPE['value']]}, with their paired 95% intervals"))
    sec.text.append(concentration([(r.tags.get("protocol", ""), r.tags.get("competence", ""),
                                    r.m(claims.metric("gain_vs_small"))) for r in best]))


def _change(study, a: Rec, b: Rec | list[Rec]) -> tuple[float, float, float, float, float] | None:
    """``a`` minus ``b`` on the test split (b: one run, or a control's seed runs) in the report's scope, from the runs'
    per-sentence tables: ``(estimate, lo, hi, p, groups)`` of its paired 95% interval (None without the tables)."""
    from mergescope.evidence import compare_strata

    ta = _test_tables(study, a)
    tb = [_test_tables(study, x) for x in (b if isinstance(b, list) else [b])]
    if ta is None or any(t is None for t in tb):
        return None
    scope = claims.SCOPE["value"]
    what = "article" if all(d is not None for d in ta[1].values()) else "sentence"
    m = compare_strata("x", ta[0], [t[0] for t in tb] if len(tb) > 1 else tb[0][0], ta[1], what, scopes=(scope,))
    k = "x" if scope == "all" else "x_rest"
    return m[k], m[f"{k}_lo"], m[f"{k}_hi"], m[f"{k}_p"], m[f"{k}_groups"]


def figure_points(study, runs: list[Rec]) -> tuple[list[tuple], list[tuple], tuple | None]:
    """What the ratio figure draws for one pair: each interior grid ratio's test NLL change against ratio 0 with its
    interval ``(ratio, e, lo, hi)``, each control at its ratio ``(name, ratio, e, lo, hi)`` (a control over seeds: its
    seeds' distribution), and ratio 1's change (drawn off the scale when it is far)."""
    pts = _points(runs, tested=True)
    r0 = next((r for r in pts if r.m("ratio") == 0.0), None)
    if r0 is None:
        return [], [], None
    inner = [(r.m("ratio"), *c[:3]) for r in pts if 0 < r.m("ratio") < 1 and (c := _change(study, r, r0)) is not None]
    ctl: dict[tuple[str, float], list[Rec]] = {}
    for r in runs:
        if r.tags.get("control") in ("scaling", "noise"):
            ctl.setdefault((r.tags["control"], r.m("ratio")), []).append(r)
    controls = []
    for (name, ratio), rs in sorted(ctl.items()):
        c = _change(study, r0, rs if len(rs) > 1 else rs[0])  # ratio 0 minus the control: flip for control minus ratio 0
        if c is not None:
            controls.append((name, ratio, -c[0], -c[2], -c[1]))
    r1 = next((r for r in pts if r.m("ratio") == 1.0), None)
    return inner, controls, None if r1 is None else _change(study, r1, r0)


def _finding_ylim(items: list[tuple], controls: list[tuple]) -> tuple[float, float] | None:
    """The y-range of the region the finding is about: the intervals of the small-side ratios up to 1.5 times the
    largest one that improves on ratio 0 (the ratios a choice can land on) and of the controls, with a margin; points
    outside it are named at the edge instead of stretching the scale."""
    near = [(x, e, lo, hi) for x, e, lo, hi in items if x < 0.5]
    helpful = [x for x, e, _, _ in near if e < 0]
    reach = 1.5 * max(helpful) if helpful else max((x for x, *_ in near), default=0.0)
    ys = [v for x, _, lo, hi in near if x <= reach for v in (lo, hi)] + [v for c in controls for v in c[3:5]] + [0.0]
    if len(ys) < 2:
        return None
    lo, hi = min(ys), max(ys)
    pad = 0.12 * (hi - lo or 1e-3)
    return lo - pad, hi + pad


def _figure(groups, study=None):
    """Per pair: the test NLL change of each grid ratio against ratio 0 with its paired 95% interval, the controls
    beside (offset, their interval over the articles and their seeds); the small-ratio side (where the choices land)
    on its own scale, points far off it and ratio 1 named at the edge; the near-1 side on a second panel; and the
    attention entropy."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), gridspec_kw={"width_ratios": [3, 1.4, 2]})
    ax, far = axes[0], axes[1]
    limits = []
    for gi, (key, runs) in enumerate(groups.items()):
        inner, controls, r1 = figure_points(study, runs)
        color = f"C{gi}"
        label = f"{key[2]} {key[0]}~{key[1]}"
        for panel, part in ((ax, [p for p in inner if p[0] < 0.5]), (far, [p for p in inner if p[0] >= 0.5])):
            if part:
                x, e, lo, hi = (np.array(v) for v in zip(*part))
                panel.errorbar(x, e, yerr=[e - lo, hi - e], fmt="o", color=color, ms=4, capsize=2, label=f"{label}: merge")
        for name, ratio, e, lo, hi in controls:
            ax.errorbar([ratio + 0.002 * (1 if name == "noise" else 2)], [e], yerr=[[e - lo], [hi - e]],
                        fmt="x" if name == "noise" else "s", color=color, mfc="none", ms=6, capsize=2, alpha=0.8,
                        label=f"{label}: {name} control")
        lim = _finding_ylim(inner, controls)
        if lim is not None:
            limits.append(lim)
        off = [f"{x:g}: {e:+.3f}" for x, e, lo, hi in inner if x < 0.5 and lim is not None and (e > lim[1] or e < lim[0])]
        if r1 is not None:
            off.append(f"1: {r1[0]:+.3f}")
        if off:
            ax.annotate(f"{key[2]}, off the scale: " + ", ".join(off), xy=(0.98, 0.03 + 0.07 * gi), xycoords="axes fraction",
                        ha="right", fontsize=7, color=color)
        pts = _points(runs)
        axes[2].plot([r.m("ratio") for r in pts], [r.m("attn_entropy_mean") for r in pts], "o", color=color, label=label)
    if limits:
        ax.set_ylim(min(v[0] for v in limits), max(v[1] for v in limits))
    for panel in (ax, far):
        panel.axhline(0, color="k", lw=0.8, gid="zero")
    ax.set(xlabel="ratio (weight of the large side), below 1/2",
           ylabel=f"test NLL minus ratio 0 (nats/token, {claims.SCOPE['value']} tokens)",
           title="merge and controls against the small model (95% intervals; below 0 = better)")
    far.set(xlabel="ratio, above 1/2", title="near the large end")
    axes[2].set(xlabel="ratio", ylabel="attention entropy (nats, mean over layers)", title="attention entropy")
    ax.legend(fontsize=6, loc="upper left")
    for a in axes:
        a.title.set_fontsize(9)
    fig.tight_layout()
    return fig


def _sci(v: float) -> str:
    return f"{v:.1e}" if math.isfinite(v) else "—"


def expansion_tables(runs: list[Rec]) -> tuple[list[RTable], str]:
    """The function check (kind=expansion): does Expand keep the model, against the eps rule's control, and does
    Truncate(slots) give it back; with its cost. Returns the tables and the finding sentence."""
    runs = sorted(runs, key=lambda r: (r.tags.get("model", ""), r.tags.get("mode", ""), r.tags.get("target", "")))
    kept = [[r.tags.get("model", ""), r.tags.get("mode", ""), r.tags.get("target", ""), _sci(r.m("max_abs_logit_diff")),
             _sci(r.m("max_abs_logit_diff_as_run")), _sci(r.m("max_abs_logit_diff_eps_kept")), f"{r.m('argmax_agree'):.4f}",
             f"{r.m('nll_source'):.4f} -> {r.m('nll_expanded'):.4f}", "yes" if r.m("kept") == 1.0 else "no",
             short(r.run_id)] for r in runs]
    cost = [[r.tags.get("model", ""), r.tags.get("mode", ""), _count(r.m("n_params_source")), _count(r.m("n_params_target")),
             _sci(r.m("roundtrip_max_abs")),
             f"{r.m('roundtrip_tensors_bitwise'):.0f} of {r.m('roundtrip_tensors'):.0f}" if math.isfinite(r.m("roundtrip_tensors")) else "—",
             f"{r.m('wall_s'):.1f}", f"{r.m('peak_rss_gb'):.2f}", short(r.run_id)] for r in runs]
    dtype = ", ".join(sorted({r.tags.get("dtype", "") for r in runs}))
    tables = [
        RTable("Function kept: the expanded model's logits against the source's", [
            "model", "mode", "target shape", "max |Δ logit|", "as run (float32 norms)", "eps kept (control)",
            "argmax agree", "NLL source -> expanded", "kept", "run"], kept,
            note=f"both models in {dtype}, every real token of the check's sentences, every tokenizer row; max |Δ logit| "
                 "with every RMSNorm computed in that dtype (the operator itself); 'as run' = as transformers computes "
                 "them (its RMSNorm casts to float32 whatever the model's dtype: float32 rounding); 'eps kept' = the same "
                 "expanded tensors with the source's norm eps instead of the eps rule eps x h_s/h_t (zero mode, hidden "
                 "grown; the rule's control); kept = max |Δ logit| <= expansion.tol and every argmax equal; NLL in "
                 "nats/token"),
        RTable("Truncate(slots) back, and the cost of the check", [
            "model", "mode", "params source", "params target", "Truncate(slots) max |Δ|", "tensors bitwise",
            "wall s", "peak RSS GB", "run"], cost,
            note="Truncate(select=slots) of the expanded state dict against the source's tensors (zero mode; the norm "
                 "gains are multiplied by c then divided by c, so they return to one ulp); wall time of the run; peak RSS "
                 "of the process that ran it, up to the end of the run")]
    parts = []
    for r in runs:
        ctl = r.m("max_abs_logit_diff_eps_kept")
        back = r.m("roundtrip_max_abs")
        target = re.sub(r" head_dim=\d+ vocab=\d+$", "", r.tags.get("target", ""))  # the shape that grew
        parts.append(f"Expand({r.tags.get('mode', '')}) of {r.tags.get('model', '')} into {target} "
                     f"{'keeps' if r.m('kept') == 1.0 else 'does not keep'} its function (max |Δ logit| "
                     f"{_sci(r.m('max_abs_logit_diff'))}, {_sci(r.m('max_abs_logit_diff_as_run'))} as run"
                     + (f"; {_sci(ctl)} without the eps rule" if math.isfinite(ctl) else "") + ")"
                     + (f", and Truncate(slots) gives its tensors back to {_sci(back)}" if math.isfinite(back) else "")
                     + f" (run {short(r.run_id)})")
    return tables, "; ".join(parts) + "."


def adapt_section(an: Analysis, number: str) -> Section:
    """The dimensional-adaptation arm: the function check of Expand (kind=expansion); curves, choice on validation,
    test numbers, controls, seesaw (kind=adapt)."""
    sec = Section("adapt", f"{number}. Dimensional adaptation (Expand / Truncate, then averaging)")
    checks = [r for r in an.study.records if r.kind == "expansion"]
    if checks:
        tables, sec.finding = expansion_tables(checks)
        sec.tables += tables
    runs = [r for r in an.study.records if r.tags.get("route") == "adapt" and r.kind in ("adapt", "merge")]
    if not runs:
        sec.missing.append("dimensional adaptation merges: not measured (no kind=adapt runs; run `python launch.py study=adapt`)")
        return sec
    groups = _groups([r for r in runs if r.kind == "adapt" and r.tags.get("control") != "source"])
    for r in runs:
        if r.kind == "merge":
            key = (r.tags.get("small", ""), r.tags.get("large", ""), r.tags.get("protocol", ""))
            groups.setdefault(key, [])
    compared = compared_merges(runs)
    summary = [row for key, rs in groups.items() if (row := _summary_row(key, rs, _points(rs), compared, an.study))]
    sec.tables.append(RTable("Best ratio chosen on the validation split, reported on the test split",
                             ["protocol / pair", "best ratio", "test NLL", "ratio 0", "ratio 1", "gain vs small [95% CI]",
                              "gain vs better end [95% CI]", "scaling ctl", "noise ctl", *compared, "collapse band", "run"],
                             summary,
                             note="test NLL (mean over languages, every token); gain vs small = ratio 0 minus the chosen ratio, "
                                  "gain vs better end = the better end minus it (positive: the merge helps), merge minus a "
                                  "control or comparison at the chosen ratio (negative: the merge beats it), each in nats/token "
                                  f"{claims.SCOPE_NOTE[claims.SCOPE['value']]} with its paired 95% interval over FLORES articles "
                                  "(an article drawn in every language at once); collapse band = grid ratios worse than both "
                                  f"ends on test, each by its paired interval, {claims.BH_NOTE}"))
    _gap_table(sec, groups)
    for key, rs in groups.items():
        if _points(rs):
            sec.tables.append(_curve_table(key, _points(rs)))
    seesaw, verdicts = [], []
    for key, rs in groups.items():
        pts = _points(rs)
        rows, counts = seesaw_rows(key, pts, chosen_point(rs, pts), next((r for r in rs if r.tags.get("ratio") == "best"), None))
        seesaw += rows
        if counts:
            verdicts.append(f"{key[2]} {key[0]} ~ {key[1]}: {counts['regressed']} of {counts['tasks']} tasks worse than "
                            f"ratio 0, {counts['worse_than_both']} worse than both ends (each where the interval lies above 0, "
                            f"{claims.BH_NOTE})")
    sec.tables.append(RTable("Seesaw of the model chosen on the validation split: per task, its test NLL against both ends",
                             ["protocol / pair", "chosen ratio", "task", "ratio-0 NLL", "ratio-1 NLL", "chosen NLL",
                              "vs ratio 0", "vs ratio 1", "regressed", "worse than both", "run"], seesaw,
                             note="one model per protocol and pair (the ratio chosen on dev), scored on devtest; vs ratio "
                                  "0 / 1: the chosen model's NLL minus the end's on that task (nats/token, "
                                  f"{claims.SCOPE_NOTE[claims.SCOPE['value']]}), with its paired 95% interval (resampled "
                                  "by FLORES article; a domain pools its languages, an article drawn in every language "
                                  "at once); negative = better. The NLL columns are over every token. regressed = "
                                  "worse than the ratio-0 anchor with the interval above 0; worse than both = so "
                                  "against both ends"))
    if verdicts:
        sec.text.append("Seesaw at the ratio chosen on the validation split: " + "; ".join(verdicts) + ".")
    parts = []
    for key, rs in groups.items():
        best = next((r for r in rs if r.tags.get("ratio") == "best"), None)
        if best is None:
            continue
        parts.append(headline(key, best, [r.m("ratio") for r in _points(rs) if 0 < r.m("ratio") < 1]))
    if parts:
        sec.finding = " ".join(x for x in (sec.finding, "; ".join(parts) + ".") if x)
    for key, rs in groups.items():
        pts = _points(rs, tested=True)  # the ratios scored on the test split (all of them unless grid_scored=val)
        grid = [f"{r.m('ratio'):g}" for r in pts if r.m("ratio") > 0]
        rows = per_ratio_rows(key, pts)
        if rows:
            sec.tables.append(RTable(f"Per-ratio view (every grid ratio, not a selection): {key[2]} {key[0]} ~ {key[1]}, "
                                     "test NLL change against ratio 0 per task", ["protocol / pair", "task", *grid], rows,
                                     note="each column is one measured ratio; the choice is made on dev, above"))
    if any(not math.isnan(r.m("test_nll")) for r in runs):
        sec.add_figure("adapt_ratio_curves", "test NLL change against ratio 0 at each measured ratio with its paired 95% "
                       "interval (points only: no line across unmeasured ratios; x noise control over its seeds, s scaling "
                       "control, offset beside their ratio), and attention entropy", lambda: _figure(groups, an.study))
    return sec


SEED_ADAPT = ("intersection at a small ratio helps (Qwen2.5-3B 0.5459 -> 0.5716 on benchmarks); near-balanced mixing "
              "collapses", "dimensional-adaptation-merging-paper.txt, sections 5-6")


def _beside_text(an: Analysis) -> str:
    best = [r for r in an.study.kind("adapt") if r.tags.get("ratio") == "best"]
    if not best:
        return "not measured (no adapt runs)"
    return "; ".join(f"{r.tags.get('protocol', r.tags.get('operator', '?'))} {r.tags.get('small')} ~ {r.tags.get('large')}: ratio "
                     f"{r.m('best_ratio'):g} chosen on dev, {claims.cell(r, 'gain_vs_small')} nats/token on test over the small "
                     f"model ({claims.verdict(r, 'gain_vs_small')})"
                     for r in best)


def beside(an: Analysis) -> list[list[str]]:
    """Dimensional adaptation's row beside the spec documents: the chosen ratio's gain over the small model, per pair."""
    return [["dimensional adaptation", _beside_text(an), *SEED_ADAPT]]


def coverage_cell(an: Analysis, p: dict) -> str:
    """What the adapt arm measured on a pair (the coverage table's adapt column)."""
    k = sum(1 for t in an.study.kind("adapt") if {t.tags.get("small"), t.tags.get("large")} == {p["a"], p["b"]})
    return f"measured ({k} runs)" if k else "not measured (no adapt runs for this pair; study=adapt runs the scale family)"
