"""The native arm in the report: its columns of the pair rows and its table of the pair matrix (weight space), what it
says in the coverage table (the native and transplant routes), and its section: the natively weight-mergeable
cross-model pairs (weight diagnostics, interpolation, merges, lm-eval beside them)."""

from __future__ import annotations

import math
from typing import Any

from mergescope.analysis import claims
from mergescope.analysis.context import Analysis
from mergescope.analysis.pairs import new_row, put
from mergescope.analysis.records import Rec, is_checkpoint_pair
from mergescope.analysis.tables import RTable, Section, f3, short, text_note

__all__ = ["native_pair", "eval_columns", "native_pair_tables", "nll_langs_of", "NATIVE_QUANTITIES", "NATIVE_PAIR",
           "pair_rows", "pair_tables", "native_cell", "transplant_cell"]

NATIVE_PAIR = ["weight_cosine", "relative_l2", "norm_ratio", "weight_cosine_matrices", "lmc_barrier", "merge_gain"]

NATIVE_QUANTITIES = ("weight_cosine", "relative_l2", "norm_ratio", "weight_cosine_matrices", "relative_l2_matrices",
                     "norm_ratio_matrices", "nll_a", "lmc_midpoint_nll", "nll_t1", "lmc_barrier", "chosen_merged_nll", "merge_gain")


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


def native_runs(study) -> list[Rec]:
    """The native arm's runs (kind=measure, metric=native): its cross-model pairs' and the checkpoint pairs'."""
    return [r for r in study.kind("measure") if r.tags.get("metric") == "native"]


def pair_rows(an: Analysis, rows: dict[str, dict[str, Any]], others: dict[str, dict[str, Any]]) -> None:
    """Each pair's native run (without a vocabulary transplant: embeddings excluded where the vocabularies differ;
    else one with) and its weight diagnostics (``native_*``), its run with a transplant apart; the native arm's own
    pairs outside the rows (``native_pairs``) for the coverage table."""
    cross = [r for r in native_runs(an.study) if not is_checkpoint_pair(r)]
    native = {r.tags.get("pair"): r for r in sorted(cross, key=lambda r: r.tags.get("transplant") is None)}
    transplanted = {r.tags.get("pair"): r for r in cross if r.tags.get("transplant")}
    for p in rows.values():
        p["native"] = p["routes_run"] = native.get(p["pair"])
        p["routes_label"] = "native run"
        p["native_transplant"] = transplanted.get(p["pair"])
        for k in NATIVE_PAIR:
            put(p, f"native_{k}", p["native"], k)
    for n in cross:
        if not n.tags.get("transplant"):
            others[n.tags["pair"]] = new_row(n.tags["pair"], n.tags.get("model_a"), n.tags.get("model_b"),
                                             native=n, routes_run=n, routes_label="native run",
                                             native_transplant=None)


WEIGHT_COLUMNS = ("weight_cosine_matrices", "weight_cosine", "relative_l2", "norm_ratio", "lmc_barrier")
"""The pair matrix's weight-space columns: the weight matrices' cosine first (every shared tensor's, the norm gains
included, reads inflated in small models: initialised at 1, the gains carry much of the norm)."""


def _weight_table(pairs: list[dict[str, Any]]) -> RTable:
    rows = [[p["pair"], *[f3(p["values"].get(f"native_{k}")) for k in WEIGHT_COLUMNS],
             short(p["src"].get("native_weight_cosine"))] for p in pairs if p["src"].get("native_weight_cosine")]
    return RTable("Weight space per pair (the pairs with a native route)", ["pair", *WEIGHT_COLUMNS, "native run"], rows,
                  note="only pairs that share a parameter space (the coverage table): elsewhere the quantity does not "
                       "exist. weight_cosine_matrices: the weight matrices alone; weight_cosine: every shared tensor, "
                       "the norm gains included (near 1 in any two models, they inflate it: read the matrices'); "
                       "lmc_barrier: above the chord to the path's t = 1 end, a hybrid where the pair shares only part "
                       "of its tensors (section 6)")



def pair_tables(an: Analysis, sec: Section) -> None:
    """The weight-space table of the pair matrix (the pairs with a native route), or why it is empty."""
    pairs = an.pairs
    if any(p["src"].get("native_weight_cosine") for p in pairs):
        sec.tables.append(_weight_table(pairs))
    if pairs and not any(p.get("native") for p in pairs):
        sec.missing.append("weight-space columns: not measured (no cross-model pair shares a parameter space, or no native run)")
    elif pairs:
        sec.text.append("Weight-space columns are blank where the pair has no shared parameter space (see the coverage table): "
                        "the quantity does not exist there.")


def native_cell(an: Analysis, p: dict[str, Any]) -> str:
    return "measured" if p.get("native") is not None else "not measured (no native run)"


def transplant_cell(an: Analysis, p: dict[str, Any]) -> str:
    return _transplant_cell(p.get("native_transplant"))


def _transplant_cell(n) -> str:
    """The vocabulary-transplant route of a pair: its cost per transplanted side, the route's method against its control
    (bits per byte on the side's own language), from the pair's native run with ``native.transplant``."""
    if n is None:
        return "not measured (no native run with native.transplant: the native route excluded the embeddings)"
    tp = n.group("transplant")
    sides = [s for s in ("a", "b") if f"transplant_cost_bpb_{s}" in n.metrics]
    costs = "; ".join(f"{n.tags.get('model_' + s, s)} {n.m(f'transplant_cost_bpb_{s}'):+.3f} bits/byte by {tp.get('method', '?')} vs "
                      f"{n.m(f'transplant_control_cost_bpb_{s}'):+.3f} by the control" for s in sides)
    return f"measured ({tp.get('target', '')}; {costs or 'nothing transplanted'}; run {short(n.run_id)})"


def native_pair_tables(sec: Section, n: Rec, merges: list[Rec], curve: list[tuple[float, float]],
                        evals: list[Rec] = ()) -> None:
    """One cross-model native run: its coverage, weight diagnostics, merged models and interpolation curve."""
    pair = n.tags["pair"]
    excluded = n.group("coverage").get("excluded_names") or []
    reasons = n.group("excluded_reasons")
    sec.text.append(f"**{pair}** (run {short(n.run_id)}): shared parameter space covers "
                    f"{int(n.m('n_shared_tensors'))} tensors / {int(n.m('shared_params')):,} parameters; "
                    "excluded: " + (", ".join(f"{e} ({reasons.get(e, 'shape differs')})" for e in excluded) or "nothing") + ".")
    sec.text.append(vocabulary_text(n))
    tv = n.params.get("task_vectors")
    if tv:
        sec.text.append(f"Task vectors: {tv}.")
    sec.tables.append(RTable(f"{pair}: weight diagnostics and interpolation (run {short(n.run_id)})", ["quantity", "value"],
                             [[k, f3(n.m(k), 4)] for k in NATIVE_QUANTITIES if k in n.metrics],
                             note="t=0 is the host (model a) alone; t=1 replaces every shared tensor with the donor's. "
                                  + CHOSEN_NOTE + (f" Chosen here: {chosen_text(n)}." if chosen_text(n) else "")))
    mrows = []
    mine = sorted((r for r in merges if r.tags.get("pair") == pair and r.tags.get("transplant") == n.tags.get("transplant")),
                  key=lambda r: r.tags.get("merge", ""))
    ev_names, ev_cells = eval_columns(mine, list(evals))
    for r in mine:
        prm = {k: v for k, v in r.group("merge").items() if k not in ("name", "operator")}
        nll = f3(r.m("nll"), 4) + (f" ± {f3(r.m('nll_sd'), 4)} ({int(r.m('n_seeds'))} seeds)" if r.m("n_seeds") > 1 else "")
        same = " (the linear model: weights sum to 1, lambda 1)" if r.tags.get("same_as") == "linear" else ""
        mrows.append([r.tags.get("merge", "") + same, ", ".join(f"{k}={v}" for k, v in prm.items()), nll,
                      claims.cell(r, "merge_gain"), short(r.run_id), *(ev_cells[r.run_id] if ev_names else [])])
    if mrows:
        sec.tables.append(RTable(f"{pair}: merged models (kind=merge)", ["operator", "parameters", "nll", "merge_gain [95% CI]",
                                                                        "run", *(ev_names and [*ev_names, "eval run"])], mrows,
                                 note="nll over every token; merge_gain = the better endpoint's NLL minus the merge's, in "
                                      f"nats/token {claims.SCOPE_NOTE[claims.SCOPE['value']]}, with its paired 95% interval over "
                                      "the sentences' FLORES articles (a stochastic merge's seeds read as a distribution)"
                                      + ("; lm-eval columns: eval=lm_eval on the merged model (kind=eval runs); — = not evaluated"
                                         if ev_names else "")))
    if n.tags.get("transplant"):
        sec.tables.append(transplant_table(n))
    by_lang = _by_language(n, mine)
    if by_lang is not None:
        sec.tables.append(by_lang)
    if curve:
        sec.tables.append(RTable(f"{pair}: linear interpolation NLL((1-t) a + t b) (metric steps lmc_t / lmc_nll of run {short(n.run_id)})",
                                 ["t", *[f3(t, 2) for t, _ in curve]], [["nll", *[f3(v) for _, v in curve]]]))


CHOSEN_NOTE = ("merge_gain = better endpoint's NLL - NLL of the merged model chosen on native.select_split (the merge "
               "with the lowest NLL on that split's first native.nll_sentences sentences, disjoint from the reported ones), "
               "both on data.split; chosen_merged_nll is that merge's NLL. Every merge's own gain is in the merged-models table.")


def chosen_text(n: Rec) -> str:
    """Which merge a native run's merge_gain is of, and the split it was chosen on ("" when none was chosen)."""
    c = n.group("merge_chosen")
    return f"{c['merge']} (lowest NLL on {c.get('on')}, run {short(str(c.get('run', '')))})" if c.get("merge") else ""


def vocabulary_text(n: Rec) -> str:
    """What the native run did with the embeddings and head: merged after a vocabulary transplant, excluded (the
    vocabularies differ), or merged (one vocabulary)."""
    tp = n.group("transplant")
    if tp.get("done"):
        sides = ", ".join(f"{n.tags.get('model_' + s, s)}: {tp[f'{s}.n_new']} new tokens" for s in ("a", "b")
                          if f"{s}.n_new" in tp)
        return (f"Embeddings and head: merged like every other tensor, after a vocabulary transplant (native.transplant: "
                f"{tp.get('target')}; a new token's rows by {tp.get('method')}, k={tp.get('k')}; {sides}); the merged and "
                "interpolated models are scored with that tokenizer. The transplant's own cost is in the table below.")
    if tp:
        return f"Embeddings and head: merged (native.transplant: {tp.get('why')})."
    reasons = n.group("excluded_reasons")
    if any("vocabulary rows differ" in str(v) for v in reasons.values()):
        return ("Embeddings and head: excluded (the vocabularies differ; each merged model keeps model a's). "
                "native.transplant gives both sides one vocabulary first and merges them too.")
    return "Embeddings and head: merged (one vocabulary)."


def transplant_table(n: Rec) -> RTable:
    """The transplant's cost per transplanted side: bits per byte on its own language before, after (the method), after
    (the control), from the native run's metrics (each side's own kind=transplant run)."""
    tp = n.group("transplant")
    runs = n.group("transplant_runs")
    rows = []
    for s in ("a", "b"):
        if f"transplant_cost_bpb_{s}" not in n.metrics:
            continue
        rows.append([n.tags.get(f"model_{s}", s), f3(n.m(f"transplant_n_new_{s}"), 0),
                     f"{n.m(f'transplant_cost_bpb_{s}'):+.4f}", f"{n.m(f'transplant_control_cost_bpb_{s}'):+.4f}",
                     f"{n.m(f'transplant_cost_nll_{s}'):+.4f}", f"{n.m(f'transplant_control_cost_nll_{s}'):+.4f}",
                     short(str(runs.get(s, "")))])
    return RTable(f"{n.tags.get('pair', '')}: vocabulary transplant cost (each side on its own language; kind=transplant runs)",
                  ["model", "new tokens", f"cost {tp.get('method', '')} (bits/byte)", "cost control (bits/byte)",
                   f"cost {tp.get('method', '')} (nats/token)", "cost control (nats/token)", "run"], rows,
                  note="cost = after - before: the model with the target tokenizer against itself with its own; bits per "
                       "byte compare two tokenizers, nats per token do not (a token of one is not a token of the other). "
                       "The control's rule is the run's control tag (subword: the mean of the model's own pieces of the "
                       "token's text; mean: its mean row).")


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
        rows.append([r.tags.get("merge", ""), *[f3(r.m(f"nll_{x}"), 4) for x in langs],
                     "; ".join(f"{x} {_lang_gain(n, r, x)}" for x in langs), short(r.run_id)])
    return RTable(f"{n.tags.get('pair', '')}: NLL by language (native.nll_langs; nats/token)", ["model", *langs,
                  "gain over the better expert [95% CI]", "run"], rows,
                  note="Each language's first native.nll_sentences FLORES sentences, scored by the host's tokenizer (NLL "
                       "columns over every token). gain = the better of the two experts' NLL on the language minus the "
                       f"merge's (< 0: the merge is worse there), {claims.SCOPE_NOTE[claims.SCOPE['value']]}, with its "
                       "paired 95% interval over that language's FLORES articles; a run recorded before these intervals "
                       "were logged shows its gain over every token and no interval.")


def _lang_gain(n: Rec, r: Rec, lang: str) -> str:
    """A merge's gain over the better expert on one language: with its interval where its run logged one."""
    if claims.metric(f"merge_gain_{lang}") in r.metrics:
        return claims.cell(r, f"merge_gain_{lang}")
    gain = min(n.m(f"nll_a_{lang}"), n.m(f"nll_b_{lang}")) - r.m(f"nll_{lang}")
    return f"{gain:+.4f} (every token; no interval)"


def lmc_curve(study, run_id: str) -> list[tuple[float, float]]:
    """A native run's interpolation curve (metric steps ``lmc_t`` / ``lmc_nll``)."""
    ts, nll = study.metric_history(run_id, "lmc_t"), study.metric_history(run_id, "lmc_nll")
    return [(ts[k], nll[k]) for k in sorted(nll) if k in ts]


def unshared_tensors(n: Rec) -> int:
    """Model a's tensors the interpolation leaves as they are: the excluded ones, less those tied in both models to a
    shared tensor (``excluded_reasons``: "tied to ... in both models"), which follow it."""
    excluded = n.group("coverage").get("excluded_names")
    if excluded is None:  # a run without its coverage group: every excluded tensor counts
        return int(n.m("n_excluded_tensors")) if math.isfinite(n.m("n_excluded_tensors")) else 0
    reasons = n.group("excluded_reasons")
    return sum(1 for e in excluded if not str(reasons.get(e, "")).startswith("tied to "))


def barrier_text(n: Rec) -> str:
    """The LMC barrier as it can be read. Where the pair shares only part of its tensors (``n_excluded_tensors`` > 0:
    the embeddings of two vocabularies, say), the t = 1 end of the path is a hybrid, model a's unshared tensors with
    model b's shared ones, not model b: the barrier is the gap above a chord to that broken end, so the sentence leads
    with how far the path's midpoint and its end are from model a. A tensor tied to a shared one in both models (a
    tied head, counted once) moves with it, so it does not make the end a hybrid."""
    bar, a, mid, end = n.m("lmc_barrier"), n.m("nll_a"), n.m("lmc_midpoint_nll"), n.m("nll_t1")
    unshared = unshared_tensors(n)
    if unshared > 0 and all(math.isfinite(v) for v in (a, mid, end)):
        return (f"the path's t = 1 end is a hybrid (model a's {unshared} unshared tensors with model "
                f"b's shared ones), {end - a:+.3f} nats/token from model a, and its midpoint {mid - a:+.3f}: the LMC "
                f"barrier above the chord to that end ({f3(bar)}) is not a measure of mode connectivity between the two "
                "models")
    return f"LMC barrier {f3(bar)} nats/token"


def native_pair(an: Analysis, number: str) -> Section:
    """6. The natively weight-mergeable cross-model pairs: coverage, weight diagnostics, interpolation, merges."""
    sec = Section("native_pair", f"{number}. Natively weight-mergeable cross-model pairs")
    cross_native = [r for r in native_runs(an.study) if not is_checkpoint_pair(r)]
    if not cross_native:
        sec.missing.append("native pair: not measured (no cross-model pair shares a parameter space, or its native run is missing)")
    for n in cross_native:
        native_pair_tables(sec, n, an.study.kind("merge"), lmc_curve(an.study, n.run_id), an.study.kind("eval"))
    if cross_native:
        n = cross_native[0]
        said = text_note(getattr(an, "study", None), n.params.get("merge_chosen.run", ""), "host")
        if said:
            sec.text.append(f"Scored text (the host's language, data.split's first lines): {said}; every verdict of this "
                            "section is about that text.")
        chosen = chosen_text(n)
        sec.finding = (f"{n.tags.get('pair', '')}: {barrier_text(n)}" +
                       (f"; the merge chosen on a disjoint split, {chosen}, has NLL {f3(n.m('chosen_merged_nll'))} against "
                        f"the better endpoint (merge gain {claims.cell(n, 'merge_gain')}: {claims.verdict(n, 'merge_gain')})"
                        if chosen else
                        "; no merge was chosen (native.select_split unset: each merge's gain is in its table)") +
                       f" (run {short(n.run_id)}).")
    return sec
