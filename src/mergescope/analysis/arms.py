"""The report's sections on the merging arms (spec sections 5 to 7): checkpoint merging by trajectory
distance, the natively weight-mergeable cross-model pairs, and transport-based fusion with adaptation."""

from __future__ import annotations

import numpy as np

from mergescope.analysis.records import Rec, base_name, direction, is_checkpoint_pair, transport_headline
from mergescope.analysis.sections import Build
from mergescope.analysis.tables import CHECKPOINT_DIAGNOSTICS, RTable, Section, f3, median, short

__all__ = ["checkpoint_arm", "native_pair", "transport", "role_table", "BINS"]

BINS = [("within half a decade (log10 ratio <= 0.5)", lambda x: x <= 0.5),
        ("0.5 to 1.5 decades", lambda x: 0.5 < x <= 1.5),
        ("beyond 1.5 decades (log10 ratio > 1.5)", lambda x: x > 1.5)]


def _bin_row(run_label: str, name: str, rs: list[Rec]) -> list[str]:
    if not rs:
        return [run_label, name, "0", "—", "—", "—", ""]
    beats = [r.m("merge_beats_better_endpoint") for r in rs if np.isfinite(r.m("merge_beats_better_endpoint"))]
    share = f"{int(sum(beats))}/{len(beats)} ({100 * sum(beats) / len(beats):.0f}%)" if beats else "—"
    return [run_label, name, str(len(rs)), f3(median(r.m("lmc_barrier") for r in rs)), f3(median(r.m("merge_gain") for r in rs)),
            share, ", ".join(short(r.run_id) for r in rs) if len(rs) <= 8 else f"{len(rs)} runs (see per-pair table)"]


def _bin_rows(ck: list[Rec]) -> list[list[str]]:
    """Per training run (and pooled when there are several): all pairs, then each trajectory-distance bin."""
    rows = []
    fams = sorted({base_name(r.tags["model_a"]) for r in ck})
    for fam in [None, *fams] if len(fams) > 1 else [None]:
        sub = [r for r in ck if fam is None or base_name(r.tags["model_a"]) == fam]
        run_label = fam or ("all runs" if len(fams) > 1 else fams[0])
        rows.append(_bin_row(run_label, "all", sub))
        for name, pred in BINS:
            rows.append(_bin_row(run_label, name, [r for r in sub if np.isfinite(r.m("log10_step_ratio")) and pred(r.m("log10_step_ratio"))]))
    return rows


def checkpoint_arm(b: Build) -> Section:
    """5. Checkpoint merging by trajectory distance (per run and pooled) and per checkpoint pair."""
    sec = Section("checkpoint", "5. Checkpoint merging: the native weight-space arm")
    ck = b.checkpoint
    if not ck:
        sec.missing.append("checkpoint arm: not measured (no kind=measure metric=native runs with arm=checkpoint; "
                           "set checkpoints.models and checkpoints.revisions in the study)")
        return sec
    sec.text.append("Pairs of checkpoints of one training run: same architecture, vocabulary and parameter space, so "
                    "every weight-space quantity is defined. Trajectory distance = log10(step_b / step_a).")
    sec.tables.append(RTable("By trajectory distance", ["run", "bin", "n", "median lmc_barrier", "median merge_gain",
                                                          "merge beats better endpoint", "runs"], _bin_rows(ck),
                             note="lmc_barrier in nats/token (negative: the straight path is better than its chord); "
                                  "merge_gain = better endpoint's NLL - best merged NLL (positive: merging beats the better endpoint)."))
    per = [[r.tags["pair"], *[f3(r.m(c)) for c in CHECKPOINT_DIAGNOSTICS], f3(r.m("best_merged_nll")),
            "yes" if r.m("merge_beats_better_endpoint") == 1 else "no" if np.isfinite(r.m("merge_beats_better_endpoint")) else "—",
            short(r.run_id)] for r in ck]
    sec.tables.append(RTable("Per checkpoint pair", ["pair", *CHECKPOINT_DIAGNOSTICS, "best_merged_nll", "beats", "run"], per))
    sec.figures.append(("checkpoint_vs_distance", "checkpoint merge results vs trajectory distance"))
    b.csv["tables/checkpoint_arm.csv"] = sec.tables[1].csv()
    b.metrics["checkpoint_pairs"] = float(len(ck))
    beats = [r for r in ck if r.m("merge_beats_better_endpoint") == 1]
    bar = median(r.m("lmc_barrier") for r in ck)
    sec.finding = (f"Over {len(ck)} checkpoint pairs the median LMC barrier is {f3(bar)} nats/token and merging beats the "
                   f"better endpoint in {len(beats)}/{len(ck)} (the endpoints are the control; runs in the table).")
    b.console_tables.append(sec.tables[0])
    return sec


NATIVE_QUANTITIES = ("weight_cosine", "relative_l2", "norm_ratio", "weight_cosine_matrices", "relative_l2_matrices",
                     "norm_ratio_matrices", "nll_a", "lmc_midpoint_nll", "nll_t1", "lmc_barrier", "best_merged_nll", "merge_gain")


def eval_columns(merge_runs: list[Rec], evals: list[Rec]) -> tuple[list[str], dict[str, list[str]]]:
    """lm-eval results beside the merged models they scored (``eval=lm_eval``: kind=eval runs, ``merge_run`` tag):
    the metric names any of them logged, and per merge run its values and the eval run id ("—" where not run)."""
    by_merge = {e.tags.get("merge_run"): e for e in evals}
    names = sorted({k for r in merge_runs if r.run_id in by_merge for k in by_merge[r.run_id].metrics
                    if "." in k and not k.endswith("_stderr")})
    cells = {}
    for r in merge_runs:
        e = by_merge.get(r.run_id)
        cells[r.run_id] = [f3(e.m(k), 4) if e is not None else "—" for k in names] + [short(e.run_id) if e else "—"]
    return names, cells


def _native_pair_tables(sec: Section, n: Rec, merges: list[Rec], curve: list[tuple[float, float]],
                        evals: list[Rec] = ()) -> None:
    """One cross-model native run: its coverage, weight diagnostics, merged models and interpolation curve."""
    pair = n.tags["pair"]
    excluded = n.group("coverage").get("excluded_names") or []
    reasons = n.group("excluded_reasons")
    sec.text.append(f"**{pair}** (run {short(n.run_id)}): shared parameter space covers "
                    f"{int(n.m('n_shared_tensors'))} tensors / {int(n.m('shared_params')):,} parameters; "
                    "excluded: " + (", ".join(f"{e} ({reasons.get(e, 'shape differs')})" for e in excluded) or "nothing") + ".")
    tv = n.params.get("task_vectors")
    if tv:
        sec.text.append(f"Task vectors: {tv}.")
    sec.tables.append(RTable(f"{pair}: weight diagnostics and interpolation (run {short(n.run_id)})", ["quantity", "value"],
                             [[k, f3(n.m(k), 4)] for k in NATIVE_QUANTITIES if k in n.metrics],
                             note="t=0 is the host (model a) alone; t=1 replaces every shared tensor with the donor's."))
    mrows = []
    mine = sorted((r for r in merges if r.tags.get("pair") == pair), key=lambda r: r.tags.get("merge", ""))
    ev_names, ev_cells = eval_columns(mine, list(evals))
    for r in mine:
        prm = {k: v for k, v in r.group("merge").items() if k not in ("name", "operator")}
        nll = f3(r.m("nll"), 4) + (f" ± {f3(r.m('nll_sd'), 4)} ({int(r.m('n_seeds'))} seeds)" if r.m("n_seeds") > 1 else "")
        same = " (the linear model: weights sum to 1, lambda 1)" if r.tags.get("same_as") == "linear" else ""
        mrows.append([r.tags.get("merge", "") + same, ", ".join(f"{k}={v}" for k, v in prm.items()), nll,
                      f3(r.m("merge_gain"), 4), short(r.run_id), *(ev_cells[r.run_id] if ev_names else [])])
    if mrows:
        sec.tables.append(RTable(f"{pair}: merged models (kind=merge)", ["operator", "parameters", "nll", "merge_gain", "run",
                                                                        *(ev_names and [*ev_names, "eval run"])], mrows,
                                 note="lm-eval columns: eval=lm_eval on the merged model (kind=eval runs); — = not evaluated"
                                 if ev_names else ""))
    by_lang = _by_language(n, [r for r in merges if r.tags.get("pair") == pair])
    if by_lang is not None:
        sec.tables.append(by_lang)
    if curve:
        sec.tables.append(RTable(f"{pair}: linear interpolation NLL((1-t) a + t b) (metric steps lmc_t / lmc_nll of run {short(n.run_id)})",
                                 ["t", *[f3(t, 2) for t, _ in curve]], [["nll", *[f3(v) for _, v in curve]]]))


def nll_langs_of(n: Rec) -> list[str]:
    """The languages of ``native.nll_langs`` a native run scored on (its ``nll_a_<lang>`` metrics)."""
    return sorted(k[len("nll_a_"):] for k in n.metrics if k.startswith("nll_a_"))


def _by_language(n: Rec, merges: list[Rec]) -> RTable | None:
    """``native.nll_langs``: each expert, the base and every merged model on every language (does the merge keep
    both languages?), with the merged model's distance to the better expert there."""
    langs = nll_langs_of(n)
    if not langs:
        return None
    a, b = n.tags.get("model_a", "a"), n.tags.get("model_b", "b")
    rows = [[f"expert a ({a})", *[f3(n.m(f"nll_a_{x}"), 4) for x in langs], "", short(n.run_id)],
            [f"expert b ({b})", *[f3(n.m(f"nll_b_{x}"), 4) for x in langs], "", short(n.run_id)]]
    if all(f"nll_base_{x}" in n.metrics for x in langs):
        rows.append([f"base ({n.params.get('task_vector_base', 'native.base')})",
                     *[f3(n.m(f"nll_base_{x}"), 4) for x in langs], "", short(n.run_id)])
    for r in sorted(merges, key=lambda r: r.tags.get("merge", "")):
        if not all(f"nll_{x}" in r.metrics for x in langs):
            continue
        gap = [r.m(f"nll_{x}") - min(n.m(f"nll_a_{x}"), n.m(f"nll_b_{x}")) for x in langs]
        rows.append([r.tags.get("merge", ""), *[f3(r.m(f"nll_{x}"), 4) for x in langs],
                     ", ".join(f"{x} {g:+.3f}" for x, g in zip(langs, gap)), short(r.run_id)])
    return RTable(f"{n.tags.get('pair', '')}: NLL by language (native.nll_langs; nats/token)", ["model", *langs,
                  "merged - better expert", "run"], rows,
                  note="Each language's first native.nll_sentences FLORES sentences, scored by the host's tokenizer. "
                       "merged - better expert > 0: the merge is worse there than the better of the two experts.")


def native_pair(b: Build) -> Section:
    """6. The natively weight-mergeable cross-model pairs: coverage, weight diagnostics, interpolation, merges."""
    sec = Section("native_pair", "6. Natively weight-mergeable cross-model pairs")
    cross_native = [r for r in b.study.native if not is_checkpoint_pair(r)]
    if not cross_native:
        sec.missing.append("native pair: not measured (no cross-model pair shares a parameter space, or its native run is missing)")
    for n in cross_native:
        _native_pair_tables(sec, n, b.study.kind("merge"), b.study.curves.get(n.run_id) or [], b.study.kind("eval"))
    if cross_native:
        n = cross_native[0]
        sec.finding = (f"{n.tags.get('pair', '')}: LMC barrier {f3(n.m('lmc_barrier'))} nats/token, best merged NLL "
                       f"{f3(n.m('best_merged_nll'))} against the better endpoint (merge gain {f3(n.m('merge_gain'))}; run "
                       f"{short(n.run_id)}).")
    return sec


def _counts(rs: list[Rec]) -> tuple[int, int]:
    """(fusion helped, the OT plan beat its control) on the target's language, over runs (one per direction)."""
    return (sum(1 for x in rs if x.m("delta_target_lang") < 0), sum(1 for x in rs if x.m("ot_minus_rand_target_lang") < 0))


def _fusion_table(b: Build, sec: Section, runs: list[Rec]) -> None:
    cols = ["nll_target_lang", "delta_target_lang", "delta_donor_lang", "ot_minus_rand_target_lang",
            "ot_minus_rand_donor_lang", "fused_weight_cosine", "fused_relative_l2", "plan_row_max", "plan_entropy", "plan_cost_ratio"]
    heads = [{"fused_weight_cosine": "transport_weight_cosine", "fused_relative_l2": "transport_relative_l2"}.get(c, c) for c in cols]
    rows = [[direction(r), r.tags.get("alpha", f3(r.m("alpha"))), *[f3(r.m(c), 4) for c in cols], short(r.run_id)]
            for r in sorted(runs, key=lambda r: (direction(r), r.m("alpha")))]
    sec.tables.append(RTable("Fusion without adaptation: every direction and alpha", ["direction", "alpha", *heads, "run"], rows,
                             note="Negative delta_* = fusion reduced NLL (helped). ot_minus_rand_* < 0 = the OT plan beat the "
                                  "shuffled-plan control (same fusion, plan rows shuffled). transport_weight_cosine / "
                                  "transport_relative_l2: every fused tensor against the target's original, after the transport."))
    by_dir: dict[str, list[Rec]] = {}
    for r in runs:
        by_dir.setdefault(direction(r), []).append(r)
    head = [x for x in (transport_headline(v) for v in by_dir.values()) if x is not None]
    helped, beats = _counts(head)
    med = median(x.m("delta_target_lang") for x in head)
    top = min(head, key=lambda x: x.m("delta_target_lang")) if head else None
    at = ", ".join(sorted({x.tags["headline_alpha"] for x in head})) or "— (no run carries a headline_alpha tag)"
    sec.text.append(f"{len(by_dir)} directions fused. At the headline alpha {at} (merge.headline_alpha, fixed in the config, never "
                    f"chosen on the evaluation sentences), fusion improves the target on its own language in {helped}/{len(head)} "
                    f"directions (median delta {f3(med, 4)} nats/token) and the OT plan beats its shuffled-plan control on the "
                    f"target's language in {beats}/{len(head)}."
                    + (f" Largest gain at that alpha: {direction(top)}, delta {f3(top.m('delta_target_lang'), 4)} "
                       f"(run {short(top.run_id)})." if top else ""))
    per_alpha = {}
    for r in runs:
        per_alpha.setdefault(float(r.tags.get("alpha", r.m("alpha"))), []).append(r)
    sec.finding = (f"At the headline alpha {at}, fusion helps the target in {helped}/{len(head)} directions (median delta "
                   f"{f3(med, 4)} nats/token) and the OT plan beats its shuffled-plan control in {beats}/{len(head)}"
                   + (f" (largest gain: {direction(top)}, run {short(top.run_id)})." if top else "."))
    sec.text.append("Every alpha: " + "; ".join(f"alpha {a:g}: helped {_counts(v)[0]}/{len(v)}, beats its control {_counts(v)[1]}/{len(v)}"
                                               for a, v in sorted(per_alpha.items())) + ".")
    b.metrics.update({"transport_directions": float(len(by_dir)), "transport_helped": float(helped), "transport_beats_control": float(beats)})
    if head:
        sec.tables.append(role_table(head, at))
        b.csv["tables/transport_by_role.csv"] = sec.tables[-1].csv()
    ident = [r for r in runs if "plan_diagonal_share" in r.metrics]
    if ident:
        cols = ["plan_diagonal_share", "plan_control_diagonal_share", "plan_chance_diagonal_share",
                "plan_layer_diagonal_share", "plan_layer_diagonal_kept", "plan_layer_chance"]
        seen = {}
        for r in sorted(ident, key=lambda r: (direction(r), r.m("alpha"))):
            seen.setdefault(direction(r), r)  # the plans are the same in every alpha's run of a direction
        sec.tables.append(RTable("Same architecture: how near the plans are to the identity",
                                 ["direction", *cols, "run"],
                                 [[d, *[f3(r.m(c), 4) for c in cols], short(r.run_id)] for d, r in seen.items()],
                                 note="plan_diagonal_share: share of the rows of the same-layer neuron plans whose maximum is "
                                      "on the diagonal (1 = the identity matching; chance 1/width); the control's is the "
                                      "shuffled-plan control's rows. plan_layer_diagonal_share: target layers whose P_eff "
                                      "maximum is the same layer; _kept: whose kept donor layers include it."))
        r = next(iter(seen.values()))
        sec.text.append(f"Same-architecture plans ({len(seen)} directions): {f3(r.m('plan_diagonal_share'), 3)} of the "
                        f"same-layer rows peak on the diagonal (control {f3(r.m('plan_control_diagonal_share'), 3)}, chance "
                        f"{f3(r.m('plan_chance_diagonal_share'), 4)}); layer plan on the diagonal for "
                        f"{f3(r.m('plan_layer_diagonal_share'), 3)} of the target layers (run {short(r.run_id)}).")
    sec.figures.append(("transport_deltas", "transport-based cross-architecture merge: fusion deltas with the shuffled-plan control"))
    b.csv["tables/transport.csv"] = sec.tables[0].csv()
    b.console_tables.append(sec.tables[0])


def role_table(head: list[Rec], at: str) -> RTable:
    """Transport by role: the headline-alpha runs (one per direction) grouped by target model, then by donor model."""
    rows = []
    for role in ("target", "donor"):
        groups: dict[str, list[Rec]] = {}
        for r in head:
            groups.setdefault(r.tags.get(role, "?"), []).append(r)
        for model, rs in sorted(groups.items()):
            helped, beats = _counts(rs)
            rows.append([role, model, str(len(rs)), f3(float(np.mean([x.m("delta_target_lang") for x in rs])), 4),
                         f3(float(np.mean([x.m("ot_minus_rand_target_lang") for x in rs])), 4), f"{helped}/{len(rs)}", f"{beats}/{len(rs)}"])
    return RTable(f"Transport by role (headline alpha {at})", ["role", "model", "directions", "mean delta_target_lang",
                                                               "mean ot_minus_rand_target_lang", "helped", "beats control"], rows,
                  note="Every direction with the model as target (its own language, fused from each donor), then every direction "
                       "with the model as donor. helped: delta_target_lang < 0; beats control: ot_minus_rand_target_lang < 0.")


def _adapt_table(sec: Section, runs: list[Rec]) -> None:
    cols = ["nll_base_before", "nll_fused_before", "nll_baseline_after", "nll_fused_after", "fusion_effect_after_adapt",
            "rand_fusion_effect_after_adapt", "nll_donor_lang_fused_after"]
    rows = [[direction(r), r.tags.get("alpha", ""), *[f3(r.m(c), 4) for c in cols], short(r.run_id)]
            for r in sorted(runs, key=direction)]
    sec.tables.append(RTable("Post-fusion adaptation (residual-frozen)", ["direction", "alpha", *cols, "run"], rows,
                             note="fusion_effect_after_adapt = fused-then-adapted NLL minus the unfused model adapted the same way "
                                  "(negative = fusion helped); rand_ = the same for the random-plan-fused model (its control)."))
    helped = sum(1 for r in runs if r.m("fusion_effect_after_adapt") < 0)
    beats = [r for r in runs if np.isfinite(r.m("rand_fusion_effect_after_adapt"))]
    sec.text.append(f"After adaptation, fusion helps in {helped}/{len(runs)} directions"
                    + (f"; the OT-fused model beats the adapted random-plan control in "
                       f"{sum(1 for r in beats if r.m('fusion_effect_after_adapt') < r.m('rand_fusion_effect_after_adapt'))}/{len(beats)}."
                       if beats else "."))


def transport(b: Build) -> Section:
    """7. Transport fusion for every direction and alpha (with the shuffled-plan control), then adaptation."""
    sec = Section("transport", "7. Transport-based cross-architecture merging")
    runs, adapt_runs = b.study.kind("transport"), b.study.adapt
    if runs:
        _fusion_table(b, sec, runs)
    else:
        sec.missing.append("transport fusion: not measured (no kind=transport runs in this experiment)")
    if adapt_runs:
        _adapt_table(sec, adapt_runs)
    else:
        sec.missing.append("post-fusion adaptation: not measured (no kind=transport_adapt runs in this experiment)")
    return sec
