"""The transport arm in the report: its columns of the pair rows (both directions' deltas at the headline alpha, the
post-fusion adaptation effect) and its table of the pair matrix, its coverage cell, its row beside the spec documents,
and section 7: transport-based cross-architecture fusion for every direction and alpha, with its shuffled-plan
control, then post-fusion fine-tuning."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mergescope.analysis import claims
from mergescope.analysis.context import Analysis
from mergescope.analysis.records import Rec, direction, transport_headline
from mergescope.analysis.pairs import put
from mergescope.analysis.tables import RTable, Section, f3, median, runs_cell, short, text_note
from mergescope.plotting import pyplot

__all__ = ["transport", "role_table", "figure_transport", "ablation_table", "variant", "CLAIM_RULE", "pair_rows", "pair_tables",
           "coverage_cell"]

CLAIM_RULE = claims.RULE
"""The rule every count of this section follows (:data:`mergescope.analysis.claims.RULE`)."""


def adapt_runs(study) -> list[Rec]:
    """Fused-then-adapted runs (kind=transport_adapt); the no-fusion baselines (stage=baseline) are their references."""
    return [r for r in study.kind("transport_adapt") if r.tags.get("stage") != "baseline" and r.tags.get("donor") not in (None, "none")]


def transport_key(r: Rec) -> tuple:
    """One job per direction, alpha and setting (transport_variant: absent on runs before it)."""
    t = r.tags
    return (r.kind, t.get("direction") or (t.get("target"), t.get("donor")), t.get("alpha"), t.get("transport_variant"))


def transport_adapt_key(r: Rec) -> tuple:
    """One job per direction and adaptation (mergescope's, the released SFT per freeze and alpha)."""
    t = r.tags
    return (r.kind, t.get("direction") or (t.get("target"), t.get("donor")), t.get("adapt_mode"), t.get("transport_variant"))


def pair_rows(an: Analysis, rows: dict[str, dict[str, Any]], others: dict[str, dict[str, Any]]) -> None:
    """Both directions' transport deltas of each pair at the headline alpha, and the post-fusion adaptation effect."""
    transport, adapt = an.study.kind("transport"), adapt_runs(an.study)
    for p in rows.values():
        _add_transport(p, transport, adapt)


def _add_transport(p: dict[str, Any], transport: list[Rec], adapt: list[Rec]) -> None:
    """Both directions' transport deltas at the headline alpha (``merge.headline_alpha``), and the post-fusion adaptation effect."""
    v = p["values"]
    deltas, ctrls = [], []
    for side, other in (("a", "b"), ("b", "a")):
        runs = [r for r in transport if r.tags.get("target") == p[side] and r.tags.get("donor") == p[other]]
        head = transport_headline(runs)
        put(p, f"transport_delta_{side}", head, claims.metric("delta_target_lang"))  # the report's NLL scope
        put(p, f"transport_ot_minus_rand_{side}", head, claims.metric("ot_minus_rand_target_lang"))
        deltas.append(v[f"transport_delta_{side}"])
        ctrls.append(v[f"transport_ot_minus_rand_{side}"])
        ad = next((r for r in reversed(adapt) if r.tags.get("target") == p[side] and r.tags.get("donor") == p[other]), None)
        put(p, f"adapt_effect_{side}", ad, claims.metric("fusion_effect_after_adapt"))
    v["transport_delta"] = float(np.mean(deltas)) if all(np.isfinite(deltas)) else float("nan")
    v["transport_ot_minus_rand"] = float(np.mean(ctrls)) if all(np.isfinite(ctrls)) else float("nan")


_TRANSPORT_SOURCES = (("a<-b", "transport_delta_a"), ("b<-a", "transport_delta_b"), ("adapt a<-b", "adapt_effect_a"),
                      ("adapt b<-a", "adapt_effect_b"))


def _transport_table(pairs: list[dict[str, Any]]) -> RTable:
    rows = [[p["pair"], *[f3(p["values"].get(f"{k}_{side}"), 4) for k in ("transport_delta", "transport_ot_minus_rand", "adapt_effect")
                          for side in "ab"], runs_cell(p, _TRANSPORT_SOURCES)] for p in pairs]
    return RTable("Transport and post-fusion adaptation per pair", [
        "pair", "delta a<-b", "delta b<-a", "ot_minus_rand a<-b", "ot_minus_rand b<-a", "adapt_effect a<-b",
        "adapt_effect b<-a", "runs"], rows,
        note="delta = fused minus unfused NLL on the target's language at the headline alpha, merge.headline_alpha, "
             f"nats/token {claims.SCOPE_NOTE[claims.SCOPE['value']]} (negative = helped); ot_minus_rand < 0 = the OT plan beat its shuffled-plan control; adapt_effect = "
             "fused-then-adapted minus adapted baseline.")


def pair_tables(an: Analysis, sec: Section) -> None:
    """The transport table of the pair matrix, or why its columns are empty."""
    sec.tables.append(_transport_table(an.pairs))
    if an.pairs and not an.study.kind("transport"):
        sec.missing.append("transport columns: not measured (no kind=transport runs in this experiment)")
    if an.pairs and not adapt_runs(an.study):
        sec.missing.append("post-fusion adaptation columns: not measured (no kind=transport_adapt runs in this experiment)")


def coverage_cell(an: Analysis, p: dict[str, Any]) -> str:
    k = sum(1 for t in an.study.kind("transport") if {t.tags.get("target"), t.tags.get("donor")} == {p["a"], p["b"]})
    return f"measured ({k} runs)" if k else "not measured (no transport runs)"


def _counts(rs: list[Rec]) -> tuple[int, int]:
    """(fusion helped, the OT plan beat its control) on the target's language, over runs (one per direction): each
    only where its interval excludes zero (:mod:`mergescope.analysis.claims`)."""
    return claims.count_lower(rs, "delta_target_lang"), claims.count_lower(rs, "ot_minus_rand_target_lang")


def _shrink(rs: list[Rec]) -> tuple[int, int]:
    """(the OT fusion beat its shrink-only control, runs that have one) on the target's language: the shrink-only control
    is the same fusion (alpha, mask) with the transported term zero; runs recorded before it have no shrink_* metrics."""
    have = [x for x in rs if np.isfinite(x.m("ot_minus_shrink_target_lang"))]
    return claims.count_lower(have, "ot_minus_shrink_target_lang"), len(have)


def variant(r: Rec) -> str:
    """A transport run's setting (``transport_variant``: the preset and every switch it changes); runs before the tag:
    mergescope's method."""
    return r.tags.get("transport_variant") or "seed"


def _by_setting(runs: list[Rec]) -> dict[tuple[str, str], list[Rec]]:
    """Runs grouped by (direction, setting), in the order met."""
    groups: dict[tuple[str, str], list[Rec]] = {}
    for r in runs:
        groups.setdefault((direction(r), variant(r)), []).append(r)
    return groups


def _headlines(runs: list[Rec]) -> list[Rec]:
    """The headline-alpha run of every (direction, setting)."""
    return [x for x in (transport_headline(v) for v in _by_setting(runs).values()) if x is not None]


INTERVAL_COLS = ("delta_target_lang", "delta_donor_lang", "ot_minus_rand_target_lang", "ot_minus_rand_donor_lang",
                 "ot_minus_shrink_target_lang", "ot_minus_shrink_donor_lang", "shrink_delta_target_lang", "rand_delta_target_lang")
"""The differences a transport run logs with a paired interval (in both NLL scopes)."""

ABLATION_COLS = ("delta_target_lang", "delta_donor_lang", "ot_minus_rand_target_lang", "ot_minus_shrink_target_lang",
                 "shrink_delta_target_lang", "transported_relative_norm", "transported_relative_norm_weights",
                 "transported_relative_norm_biases", "plan_entropy_gap", "plan_rowmax_over_uniform",
                 "plan_cost_ratio")


def _nll_key(name: str) -> str:
    """A pooled NLL metric in the analysis's scope: ``nll_target_lang`` -> ``nll_rest_target_lang`` (a name without
    ``nll_`` is returned as it is)."""
    if claims.SCOPE["value"] == "all":
        return name
    for head in ("nll_", "select_nll_", "rand_nll_", "shrink_nll_", "base_nll_"):
        if name.startswith(head):
            return head + "rest_" + name[len(head):]
    return name


def main_variant(head: list[Rec]) -> str:
    """The study's main transport setting: the one run on the most directions (mergescope's on a tie); the others are
    the ablation's settings, run on fewer directions."""
    dirs: dict[str, set[str]] = {}
    for r in head:
        dirs.setdefault(variant(r), set()).add(direction(r))
    return max(dirs, key=lambda v: (len(dirs[v]), v == "seed")) if dirs else "seed"


def selection_grid(r: Rec) -> list[float]:
    """The alphas a run tested at its selected alpha chose among (its ``select_curve_nll_rest_at_<alpha>`` metrics)."""
    head = "select_curve_nll_rest_at_"
    return sorted(float(k[len(head):]) for k in r.metrics if k.startswith(head))


def alpha_choice(rs: list[Rec]) -> tuple[str, str, str, str]:
    """One (direction, setting)'s runs over its alphas: (the alpha with the lowest NLL on the selection split, its delta
    on the evaluation sentences; the alpha with the lowest delta on the evaluation itself, that delta). The first is a
    measurement (chosen on FLORES dev lines disjoint from the probes and the evaluation); the second is the paper's
    protocol (the best alpha read off the reported numbers), optimistic by construction. "—" where no run has a
    selection split."""
    sel, dk = _nll_key("select_nll_target_lang"), claims.metric("delta_target_lang")
    if rs and all(r.tags.get("test_at") == "selected" for r in rs):  # one run: the alpha chosen on dev, tested alone
        r = rs[-1]
        return (f"{r.m('alpha'):g}" + claims.edge_note(r.m("alpha"), selection_grid(r)), claims.cell(r, "delta_target_lang"),
                "— (only the chosen alpha is tested)", "—")
    have = [r for r in rs if np.isfinite(r.m(sel))]
    dev = min(have, key=lambda r: (r.m(sel), r.m("alpha"))) if len(have) == len(rs) and have else None
    ev = min(rs, key=lambda r: (r.m(dk), r.m("alpha"))) if rs else None
    grid = [r.m("alpha") for r in rs]
    show = lambda r: ((f"{r.m('alpha'):g}" + claims.edge_note(r.m("alpha"), grid), claims.cell(r, "delta_target_lang"))  # noqa: E731
                      if r is not None else ("—", "—"))
    return (*show(dev), *show(ev))


def ablation_table(head: list[Rec], runs: list[Rec] | None = None) -> RTable:
    """Per direction with more than one setting, per setting (the released method, each switch alone, mergescope's full
    set ...) at its headline alpha: each column, and whether the OT plan beat each control; with ``runs`` (every alpha's
    run) the alpha chosen on the selection split and the alpha best on the evaluation (:func:`alpha_choice`)."""
    groups, every = _by_setting(head), _by_setting(runs or [])
    several = {d for d, _ in groups if sum(1 for dd, _ in groups if dd == d) > 1}
    rows = []
    for (d, v), rs in sorted(groups.items()):
        if d not in several:
            continue
        beats_r = claims.count_lower(rs, "ot_minus_rand_target_lang")
        beats_s, n_s = _shrink(rs)
        means = [(claims.cell(rs[0], c) if len(rs) == 1 and c in INTERVAL_COLS else
                  f3(float(np.nanmean([x.m(claims.metric(c) if c in INTERVAL_COLS else c) for x in rs]))
                     if any(np.isfinite(x.m(claims.metric(c) if c in INTERVAL_COLS else c)) for x in rs) else float("nan"), 4))
                 for c in ABLATION_COLS]
        rows.append([d, v, *means, f"{beats_r}/{len(rs)}", f"{beats_s}/{n_s}" if n_s else "—", *alpha_choice(every.get((d, v), []))])
    return RTable("Transport settings: the released method, each deviation, mergescope's set (headline alpha)",
                  ["direction", "setting", *ABLATION_COLS, "beats random plan", "beats shrink only", "alpha chosen on dev",
                   "delta_target_lang at it", "alpha best on the evaluation", "delta_target_lang at that"], rows,
                  note="setting: the preset (seed = merge=transport; released:code / released:paper = merge=transport_released "
                       "with merge.follow) and every switch changed from it. Differences in nats/token "
                       f"{claims.SCOPE_NOTE[claims.SCOPE['value']]}, with their paired 95% interval where one setting has one "
                       f"direction. beats: {CLAIM_RULE}. ot_minus_shrink_*: the OT fusion against the "
                       "shrink-only control (the same alpha and mask, transported term zero). transported_relative_norm: "
                       "|M*T| / |M*W| (_weights: the weight matrices alone; _biases: the bias vectors alone). plan_entropy_gap: log m minus the plans' mean row entropy (0 = uniform); "
                       "plan_rowmax_over_uniform: mean row max x m (1 = uniform); plan_cost_ratio: transport cost over the "
                       "unregularised optimum (ot.emd2). alpha chosen on dev: the grid alpha with the lowest NLL of the fused "
                       "target on the selection split (merge.select_sentences FLORES dev lines after the probes, disjoint from "
                       "them and from the evaluation), its delta read on the evaluation sentences; — where the runs have no "
                       "selection split; a choice at an edge of the alpha grid is marked (the optimum may lie outside it). alpha best on the evaluation: the paper's protocol (the best alpha read off the "
                       "reported sentences themselves), optimistic by construction: not a measurement of a chosen alpha.")


def fusion_rows(runs: list[Rec]) -> RTable:
    """Every direction and alpha: the NLLs, each difference with its interval, the plan and weight diagnostics."""
    cols = ["nll_target_lang", "delta_target_lang", "delta_donor_lang", "ot_minus_rand_target_lang",
            "ot_minus_rand_donor_lang", "shrink_delta_target_lang", "ot_minus_shrink_target_lang", "ot_minus_shrink_donor_lang",
            "transported_relative_norm", "transported_relative_norm_weights", "transported_relative_norm_biases", "fused_weight_cosine", "fused_relative_l2", "plan_row_max", "plan_entropy", "plan_cost_ratio",
            "select_delta_target_lang", "first_token_nll_target_lang", "eval_groups_target_lang"]
    several = len({variant(r) for r in runs}) > 1
    heads = [{"fused_weight_cosine": "transport_weight_cosine", "fused_relative_l2": "transport_relative_l2"}.get(c, c) for c in cols]
    scope = claims.SCOPE["value"]
    show = lambda r, c: claims.cell(r, c) if c in INTERVAL_COLS or c.startswith("select_delta") else f3(r.m(_nll_key(c)), 4)  # noqa: E731
    rows = [[direction(r) + (f" [{variant(r)}]" if several else ""), r.tags.get("alpha", f3(r.m("alpha"))),
             *[show(r, c) for c in cols], short(r.run_id)]
            for r in sorted(runs, key=lambda r: (direction(r), variant(r), r.m("alpha")))]
    return RTable("Fusion without adaptation: every direction and alpha", ["direction", "alpha", *heads, "run"], rows,
                             note=f"NLL in nats/token {claims.SCOPE_NOTE[scope]} (analysis.nll_scope={scope}; both scopes are "
                                  "logged); each difference with its paired 95% bootstrap interval over the evaluation "
                                  "sentences' FLORES articles (eval_groups_target_lang: how many; first_token_nll_target_lang: "
                                  "the unfused target's mean nats on each sentence's first token, predicted from the start token "
                                  "alone). Negative delta_* = fusion reduced NLL (helped). ot_minus_rand_* < 0 = the OT plan beat the "
                                  "shuffled-plan control (same fusion, plan rows shuffled; the mean over merge.control_seeds "
                                  "random plans, its interval including their spread). shrink_delta_* / ot_minus_shrink_*: "
                                  "the shrink-only control, the same fusion (alpha, mask) with the transported term zero, and the "
                                  "OT fusion against it (< 0 = the transported term helped beyond the shrink). "
                                  "transported_relative_norm: |M*T| / |M*W| on the fused entries (_weights / _biases: the weight "
                                  "matrices / the bias vectors alone). transport_weight_cosine / "
                                  "transport_relative_l2: every fused tensor against the target's original, after the transport. "
                                  "select_delta_target_lang: the fused target's delta on the alpha-selection split (FLORES dev "
                                  "lines after the probes; — when the run has none): what the ablation table's alpha is chosen on.")


def _fusion_table(an: Analysis, sec: Section, runs: list[Rec]) -> None:
    several = len({variant(r) for r in runs}) > 1
    sec.tables.append(fusion_rows(runs))
    by_dir: dict[str, list[Rec]] = {}
    for r in runs:
        by_dir.setdefault(direction(r), []).append(r)
    heads = _headlines(runs)
    main = main_variant(heads)
    head = [r for r in heads if variant(r) == main]  # the counts: the main setting's directions (the ablation's apart)
    helped, beats = _counts(head)
    hurt = claims.count(head, "delta_target_lang", "higher")
    beats_s, n_s = _shrink(head)
    shrink_txt = (f"; it beats its shrink-only control (transported term zero) in {beats_s}/{n_s}" if n_s else
                  "; no run has the shrink-only control (recorded before it)")
    dk = claims.metric("delta_target_lang")
    med = median(x.m(dk) for x in head)
    top = min(head, key=lambda x: x.m(dk)) if head else None
    at = ", ".join(sorted({x.tags["headline_alpha"] for x in head})) or "— (no run carries a headline_alpha tag)"
    chosen = bool(head) and all(x.tags.get("test_at") == "selected" for x in head)
    where = (f"At the alpha each direction chose on its selection split (FLORES dev lines after the probes; {at}), the "
             "only alpha its evaluation sentences score," if chosen else
             f"At the headline alpha {at} (merge.headline_alpha, fixed in the config, never chosen on the evaluation sentences),")
    sec.text.append(f"{len(by_dir)} directions fused" + (f" (setting {main}; the others: the ablation table)" if several else "")
                    + f". {where} fusion improves the target on its own language in {helped}/{len(head)} "
                    f"directions and makes it worse in {hurt}/{len(head)} (median delta {f3(med, 4)} nats/token); the OT "
                    "plan beats its shuffled-plan control on the "
                    f"target's language in {beats}/{len(head)}{shrink_txt}; {CLAIM_RULE}; nats/token "
                    f"{claims.SCOPE_NOTE[claims.SCOPE['value']]}."
                    + (f" Largest gain at that alpha: {direction(top)}, delta {claims.cell(top, 'delta_target_lang')} "
                       f"(run {short(top.run_id)})." if top else ""))
    said = text_note(getattr(an, "study", None), head[0].run_id, "target_lang") if head else ""
    if said:
        sec.text.append(f"Evaluation text of each direction (the target's language; data.split's first lines): {said}. "
                        "Every verdict of this section is about that text.")
    per_alpha = {}
    for r in (x for x in runs if variant(x) == main):
        per_alpha.setdefault(float(r.tags.get("alpha", r.m("alpha"))), []).append(r)
    sec.finding = ((f"At the alpha chosen on dev ({at})" if chosen else f"At the headline alpha {at}") + f", fusion helps the target in {helped}/{len(head)} directions, hurts it in "
                   f"{hurt}/{len(head)} and cannot be told in the rest (median delta {f3(med, 4)} nats/token; {claims.BH_NOTE}); "
                   f"the OT plan beats its shuffled-plan control in {beats}/{len(head)}{shrink_txt}. " + control_reading(head))
    if chosen:  # the grid on the selection split: where each direction's choice fell
        sec.text.append("Alpha chosen on the selection split, per direction: " + "; ".join(
            f"{direction(x)}: {x.m('alpha'):g}{claims.edge_note(x.m('alpha'), selection_grid(x))}" for x in head)
            + f" (grid {', '.join(f'{a:g}' for a in selection_grid(head[0]))}).")
    else:
        sec.text.append("Every alpha: " + "; ".join(f"alpha {a:g}: helped {_counts(v)[0]}/{len(v)}, beats its control {_counts(v)[1]}/{len(v)}"
                                                   for a, v in sorted(per_alpha.items())) + ".")
    an.metrics.update({"transport_directions": float(len(by_dir)), "transport_helped": float(helped),
                       "transport_hurt": float(hurt), "transport_beats_control": float(beats),
                       "transport_beats_shrink": float(beats_s)})
    if several:
        _ablation(an, sec, heads, runs)
    if head:
        sec.tables.append(role_table(head, at))
        an.csv["tables/transport_by_role.csv"] = sec.tables[-1].csv()
    ident = [r for r in runs if "plan_diagonal_share" in r.metrics]
    if ident:
        _identity_tables(sec, ident)
    sec.add_figure("transport_deltas", "transport-based cross-architecture merge: fusion deltas with the shuffled-plan control",
                   lambda: figure_transport(runs))
    an.csv["tables/transport.csv"] = sec.tables[0].csv()
    an.console_tables.append(sec.tables[0])


IDENTITY_COLS = ["plan_diagonal_share", "plan_control_diagonal_share", "plan_chance_diagonal_share",
                 "plan_layer_diagonal_share", "plan_layer_diagonal_kept", "plan_layer_chance"]


def architecture(r: Rec, side: str) -> str:
    """A transport run's target's or donor's architecture (``model_type`` of its true config, logged by the run)."""
    return str(r.group(f"model_{side}.true").get("model_type") or "?")


def same_architecture(r: Rec) -> bool:
    """Target and donor of one architecture (a known ``model_type``, equal on both sides)."""
    a = architecture(r, "target")
    return a != "?" and a == architecture(r, "donor")


def _identity_tables(sec: Section, ident: list[Rec]) -> None:
    """How near the plans are to the identity, for the directions that log it: one table of the same-architecture
    directions (where the identity is the natural matching) and one of the cross-architecture directions, each named
    for what all its rows share, each with a sentence against chance (the layer plan only where both models have the
    same depth)."""
    seen: dict[str, Rec] = {}
    for r in sorted(ident, key=lambda r: (direction(r), r.m("alpha"))):
        seen.setdefault(direction(r), r)  # the plans are the same in every alpha's run of a direction
    groups = (("Same architecture", [r for r in seen.values() if same_architecture(r)]),
              ("Different architectures", [r for r in seen.values() if not same_architecture(r)]))
    for title, rs in groups:
        if not rs:
            continue
        sec.tables.append(RTable(f"{title}: how near the plans are to the identity",
                                 ["direction", "architectures", *IDENTITY_COLS, "run"],
                                 [[direction(r), f"{architecture(r, 'target')} <- {architecture(r, 'donor')}",
                                   *[f3(r.m(c), 4) for c in IDENTITY_COLS], short(r.run_id)] for r in rs],
                                 note="plan_diagonal_share: share of the rows of the same-layer neuron plans whose maximum is "
                                      "on the diagonal (1 = the identity matching; chance 1/width); the control's is the "
                                      "shuffled-plan control's rows. plan_layer_diagonal_share: target layers whose P_eff "
                                      "maximum is the same layer (chance 1/layers); _kept: whose kept donor layers include it."))
        parts = []
        for r in rs:
            lay, ch = r.m("plan_layer_diagonal_share"), r.m("plan_layer_chance")
            at_chance = " (at chance)" if math.isfinite(lay) and math.isfinite(ch) and abs(lay - ch) < 1e-9 else ""
            layer = f", layer plan {f3(lay, 3)} against chance {f3(ch, 3)}{at_chance}" if math.isfinite(lay) else ""
            parts.append(f"{direction(r)}: {f3(r.m('plan_diagonal_share'), 3)} of the same-layer rows on the diagonal "
                         f"(control {f3(r.m('plan_control_diagonal_share'), 3)}, chance {f3(r.m('plan_chance_diagonal_share'), 4)})"
                         + layer)
        sec.text.append(f"{title} ({len(rs)} direction{'s' if len(rs) != 1 else ''}): " + "; ".join(parts[:6])
                        + ("; ... (the table)" if len(parts) > 6 else "") + ".")


def control_reading(head: list[Rec]) -> str:
    """What "beats its control" means in these directions: where fusion itself hurts, beating the shuffled plan means
    hurting less than it; where fusion helps, whether the OT plan beats its shuffled plan and its shrink-only control
    there (the transported term's own part: OT minus shrink)."""
    delta = claims.verdicts(head, "delta_target_lang")
    rand = claims.verdicts(head, "ot_minus_rand_target_lang")
    shrink = claims.verdicts(head, "ot_minus_shrink_target_lang")
    hurt_less = sum(1 for d, c in zip(delta, rand) if d == "higher" and c == "lower")
    out = []
    if hurt_less:
        out.append(f"In {hurt_less} of the directions where the OT plan beats its shuffled plan, fusion itself hurts the "
                   "target: there \"beats\" means \"hurts less than the shuffled plan\"")
    helped = [i for i, d in enumerate(delta) if d == "lower"]
    if helped:
        out.append(f"Of the {len(helped)} direction(s) where fusion helps, the OT plan beats its shuffled plan in "
                   f"{sum(1 for i in helped if rand[i] == 'lower')} and its shrink-only control in "
                   f"{sum(1 for i in helped if shrink[i] == 'lower')} ("
                   + "; ".join(f"{direction(head[i])}: delta {claims.cell(head[i], 'delta_target_lang')}, OT minus shuffled "
                               f"{claims.cell(head[i], 'ot_minus_rand_target_lang')}, OT minus shrink-only "
                               f"{claims.cell(head[i], 'ot_minus_shrink_target_lang')}" for i in helped[:4])
                   + ("; ..." if len(helped) > 4 else "") + ")")
    else:
        out.append("Fusion helps the target in no direction at this alpha")
    return ". ".join(out) + "."


def _ablation(an: Analysis, sec: Section, heads: list[Rec], runs: list[Rec]) -> None:
    """The settings table (:func:`ablation_table`), its CSV and its sentence."""
    sec.tables.append(ablation_table(heads, runs))
    an.csv["tables/transport_ablation.csv"] = sec.tables[-1].csv()
    sec.text.append("Settings compared (headline alpha): " + "; ".join(
        f"{r[0]} [{r[1]}]: delta {r[2]}, beats random plan {r[-6]}, beats shrink only {r[-5]}"
        + (f"; alpha chosen on dev {r[-4]} (delta {r[-3]})" if r[-4] != "—" else "") for r in sec.tables[-1].rows) + ".")


def role_table(head: list[Rec], at: str) -> RTable:
    """Transport by role: the headline-alpha runs (one per direction) grouped by target model, then by donor model."""
    rows = []
    for role in ("target", "donor"):
        groups: dict[str, list[Rec]] = {}
        for r in head:
            groups.setdefault(r.tags.get(role, "?"), []).append(r)
        for model, rs in sorted(groups.items()):
            helped, beats = _counts(rs)
            rows.append([role, model, str(len(rs)), f3(float(np.mean([x.m(claims.metric("delta_target_lang")) for x in rs])), 4),
                         f3(float(np.mean([x.m(claims.metric("ot_minus_rand_target_lang")) for x in rs])), 4), f"{helped}/{len(rs)}",
                         f"{beats}/{len(rs)}"])
    return RTable(f"Transport by role (headline alpha {at})", ["role", "model", "directions", "mean delta_target_lang",
                                                               "mean ot_minus_rand_target_lang", "helped", "beats control"], rows,
                  note="Every direction with the model as target (its own language, fused from each donor), then every direction "
                       f"with the model as donor; means in nats/token {claims.SCOPE_NOTE[claims.SCOPE['value']]}. helped "
                       f"(delta_target_lang) and beats control (ot_minus_rand_target_lang): {CLAIM_RULE}.")


def _adapt_table(sec: Section, runs: list[Rec]) -> None:
    cols = ["nll_base_before", "nll_fused_before", "nll_baseline_after", "nll_damped_baseline_after", "nll_fused_after"]
    diffs = ["fusion_effect_after_adapt", "fusion_effect_vs_damped_after_adapt", "rand_fusion_effect_after_adapt",
             "ot_minus_rand_after_adapt"]
    rows = [[direction(r), variant(r), r.tags.get("adapt_mode", "residual_frozen"), r.tags.get("alpha", ""),
             *[f3(r.m(c), 4) for c in cols], *[claims.cell(r, c) for c in diffs], short(r.run_id)]
            for r in sorted(runs, key=lambda r: (direction(r), variant(r), r.tags.get("adapt_mode", "")))]
    sec.tables.append(RTable("Post-fusion adaptation", ["direction", "setting", "adaptation", "alpha", *cols, *diffs, "run"], rows,
                             note="adaptation: residual_frozen = mergescope's (theta = W - R trained, the transported residual R "
                                  "frozen, Adam); released:<freeze>@<a> = the released residual SFT ((1 - a) W + a R, a its training "
                                  "alpha; frozen_hot: every parameter trains, R frozen; frozen_base: R only; none: both; AdamW, "
                                  "warmup and linear decay), its baseline the same training of the unfused target. "
                                  "fusion_effect_after_adapt = fused-then-adapted NLL minus the unfused model adapted the same way "
                                  "(negative = fusion helped); rand_ = the same for the random-plan-fused model (its control). "
                                  "The released SFT trains each fused tensor through (1 - a) W + a R, so its updates are damped "
                                  "by (1 - a) where the plain baseline's are not: nll_damped_baseline_after is the unfused target "
                                  "trained the same way with R = its own weights, and fusion_effect_vs_damped_after_adapt the "
                                  "fused model minus it (the fusion alone, the damping held equal). Differences with their "
                                  f"paired 95% interval, nats/token {claims.SCOPE_NOTE[claims.SCOPE['value']]}; the NLL "
                                  "columns over every token."))
    helped = claims.count_lower(runs, "fusion_effect_after_adapt")
    hurt = claims.count(runs, "fusion_effect_after_adapt", "higher")
    beats = [r for r in runs if np.isfinite(r.m("rand_fusion_effect_after_adapt"))]
    rand_helped = claims.count_lower(beats, "rand_fusion_effect_after_adapt")
    seeds = sorted({int(r.m("adapt_control_seeds")) for r in beats if np.isfinite(r.m("adapt_control_seeds"))})
    damped = [r for r in runs if np.isfinite(r.m("fusion_effect_vs_damped_after_adapt"))]
    alone = [r for r in runs if r.m("adapt_control_seeds") == 0]
    sec.text.append(f"After adaptation, fusion helps in {helped}/{len(runs)} directions and hurts in {hurt}/{len(runs)}"
                    + (f" ({claims.count_lower(damped, 'fusion_effect_vs_damped_after_adapt')}/{len(damped)} against the "
                       "baseline under the same damping)" if damped else "")
                    + (f"; the random-plan fusion, adapted the same way, helps in {rand_helped}/{len(beats)}, and the "
                       + (f"OT-fused model beats it in {claims.count_lower(beats, 'ot_minus_rand_after_adapt')}/{len(beats)} "
                          f"(the adapted control over {', '.join(map(str, seeds))} seeds: a distribution)" if seeds else
                          "OT-fused model against it is no verdict (one adapted control seed, recorded before the "
                          "control was adapted over its seeds: its spread is unknown)")
                       if beats else "")
                    + (f"; {len(alone)}/{len(runs)} adapted without their random-plan control (merge.adapt.control_seeds=0: "
                       "the fused model against its no-fusion baseline only)" if alone else "")
                    + f" ({CLAIM_RULE}; nats/token {claims.SCOPE_NOTE[claims.SCOPE['value']]}). "
                    + "; ".join(f"{direction(r)}: fusion effect {claims.cell(r, 'fusion_effect_after_adapt')}, OT minus random plan "
                                f"{claims.cell(r, 'ot_minus_rand_after_adapt')}" for r in runs) + ".")


def transport(an: Analysis, number: str) -> Section:
    """7. Transport fusion for every direction and alpha (with the shuffled-plan control), then adaptation."""
    sec = Section("transport", f"{number}. Transport-based cross-architecture merging")
    runs, adapted = an.study.kind("transport"), adapt_runs(an.study)
    if runs:
        _fusion_table(an, sec, runs)
    else:
        sec.missing.append("transport fusion: not measured (no kind=transport runs in this experiment)")
    if adapted:
        _adapt_table(sec, adapted)
    else:
        sec.missing.append("post-fusion adaptation: not measured (no kind=transport_adapt runs in this experiment)")
    return sec


def _interval(r: Rec, name: str) -> tuple[float, float, float]:
    """(estimate, distance down to the interval's lower end, up to its upper end) of difference ``name`` in the
    report's scope (NaN distances: no interval)."""
    k = claims.metric(name)
    e, lo, hi = r.m(k), r.m(f"{k}_lo"), r.m(f"{k}_hi")
    return e, e - lo, hi - e


def _transport_bars(ax, transport: list[Rec]) -> None:
    """Per direction and alpha: the OT fusion's delta with its paired 95% interval (bar and error bar) and the
    random-plan control's delta with its interval over the articles and its seeds (a black mark and bar beside)."""
    dirs = sorted({direction(r) for r in transport})
    alphas = sorted({r.m("alpha") if np.isfinite(r.m("alpha")) else float(r.tags.get("alpha", "nan")) for r in transport})
    w = 0.8 / max(1, len(alphas))
    for ai, a in enumerate(alphas):
        xs, ot, rd = [], [], []
        for di, d in enumerate(dirs):
            r = next((r for r in transport if direction(r) == d and (r.m("alpha") == a or r.tags.get("alpha") == str(a))), None)
            if r is None:
                continue
            xs.append(di + (ai - (len(alphas) - 1) / 2) * w)
            ot.append(_interval(r, "delta_target_lang"))
            rd.append(_interval(r, "rand_delta_target_lang"))
        x = np.array(xs)
        e, dn, up = (np.array(v) for v in zip(*ot)) if ot else (np.array([]),) * 3
        bars = ax.bar(x, e, width=w * 0.9, label=f"OT plan, alpha={a:g}")
        ax.errorbar(x, e, yerr=np.nan_to_num(np.vstack([dn, up])), fmt="none", ecolor=bars.patches[0].get_facecolor()
                    if bars.patches else "C0", elinewidth=1.2, capsize=2, alpha=0.9)
        ce, cdn, cup = (np.array(v) for v in zip(*rd)) if rd else (np.array([]),) * 3
        ax.errorbar(x + w * 0.3, ce, yerr=np.nan_to_num(np.vstack([cdn, cup])), fmt="k_", ms=7, mew=2, elinewidth=0.8,
                    capsize=1.5, label="random-plan control (interval: articles and its seeds)" if ai == 0 else None)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(dirs)), dirs, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(f"delta nats/token on the target's language\n(fused - unfused, {claims.SCOPE['value']} tokens)")
    ax.legend(fontsize=7)


def figure_transport(transport: list[Rec]):
    plt = pyplot()
    n_dirs = len({direction(r) for r in transport})
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 0.6 * n_dirs + 6), 4.5), gridspec_kw={"width_ratios": [2, 1]})
    _transport_bars(axes[0], transport)
    ax = axes[1]
    x = np.array([_interval(r, "rand_delta_target_lang")[0] for r in transport])
    y = np.array([_interval(r, "delta_target_lang")[0] for r in transport])
    ax.scatter(x, y, s=14)
    lim = [np.nanmin([x.min(), y.min()]), np.nanmax([x.max(), y.max()])]
    ax.plot(lim, lim, "k--", lw=0.8)
    ax.set_xlabel("shuffled-plan delta")
    ax.set_ylabel("OT-plan delta")
    ax.set_title("below the diagonal: OT below the control's mean\n(a verdict reads the intervals: section tables)", fontsize=8)
    fig.suptitle("Transport fusion without adaptation")
    fig.tight_layout()
    return fig


SEED_TRANSPORT = ("helps 2/20 directions, OT beats its shuffled plan 12/20 (median delta +0.0021)",
                  "crossarch-1b-diagnostics-report.txt, finding 3")


def _beside_text(an: Analysis) -> str:
    n = int(an.metrics.get("transport_directions", 0))
    if not n:
        return "not measured (no transport runs)"
    return (f"helps {int(an.metrics['transport_helped'])}/{n} directions, OT beats its shuffled plan "
            f"{int(an.metrics['transport_beats_control'])}/{n}, its shrink-only control {int(an.metrics.get('transport_beats_shrink', 0))}/{n}"
            " (each counted only where its paired 95% interval over FLORES articles excludes 0, the first token apart; "
            "no post-fusion adaptation unless the transport section shows one)")


def beside(an: Analysis) -> list[list[str]]:
    """Transport's row beside the spec documents: the directions it helped and where OT beat its controls."""
    return [["transport fusion at the headline alpha", _beside_text(an), *SEED_TRANSPORT]]
