"""The study's headline numbers beside the seed reports' (``../shared/spec``): the same quantity, measured here, next
to what each report states, with the conditions that differ. Built only from this study's runs; a row whose runs the
study does not have says so."""

from __future__ import annotations

import math

from mergescope.analysis import claims
from mergescope.analysis.context import Analysis
from mergescope.analysis.records import Rec
from mergescope.analysis.tables import RTable, Section, median

__all__ = ["beside_the_seed", "SEED"]

SEED = {  # what the seed reports state (file in ../shared/spec, the sentence)
    "cka": ("0.488-0.800 (median 0.587), 10 pairs of ~1B models, each on its own language, 1012 sentences",
            "crossarch-1b-diagnostics-report.txt, finding 1"),
    "shuffled": ("0.024-0.069", "crossarch-1b-diagnostics-report.txt, finding 1"),
    "retrieval": ("up to 0.949 (chance 0.0020)", "crossarch-1b-diagnostics-report.txt, finding 1"),
    "transport": ("helps 2/20 directions, OT beats its shuffled plan 12/20 (median delta +0.0021)",
                  "crossarch-1b-diagnostics-report.txt, finding 3"),
    "adapt": ("intersection at a small ratio helps (Qwen2.5-3B 0.5459 -> 0.5716 on benchmarks); near-balanced mixing "
              "collapses", "dimensional-adaptation-merging-paper.txt, sections 5-6"),
    "gpa": ("GPA 0.91-0.93 vs pairwise maps 0.82-0.85 (pools of 32, final layer)", "five-architectures-shared-space-summary.txt"),
}


def _cka(recs: list[Rec]) -> str:
    if not recs:
        return "not measured (no CKA runs)"
    mm = [r.m("cka") for r in recs]
    n = sorted({int(r.m("n_sentences")) for r in recs if math.isfinite(r.m("n_sentences"))})
    cc = [r.m("cka_calibrated") for r in recs if math.isfinite(r.m("cka_calibrated"))]
    cal = (f"; calibrated {min(cc):.3f}-{max(cc):.3f} (median {median(cc):.3f}), above its permutation null for "
           f"{sum(1 for c in cc if c > 0)}/{len(recs)}" if cc else "; not calibrated")
    hw = [(r.m("cka_ci_high") - r.m("cka_ci_low")) / 2 for r in recs
          if math.isfinite(r.m("cka_ci_high")) and math.isfinite(r.m("cka_ci_low"))]
    half = f"; 95% jackknife half-width {min(hw):.3f}-{max(hw):.3f}" if hw else ""
    return (f"matched {min(mm):.3f}-{max(mm):.3f} (median {median(mm):.3f}) raw, {len(recs)} pairs"
            + (f", n = {'/'.join(map(str, n))}" if n else "") + half + cal)


def _shuffled(recs: list[Rec]) -> str:
    ss = [r.m("cka_shuffled") for r in recs]
    if not ss:
        return "not measured"
    seeds = sorted({int(r.m("control_seeds")) for r in recs if math.isfinite(r.m("control_seeds"))})
    sd = [r.m("cka_shuffled_sd") for r in recs if math.isfinite(r.m("cka_shuffled_sd"))]
    over = (f" (mean over {'/'.join(map(str, seeds))} seeds" + (f"; sd over seeds up to {max(sd):.3f})" if sd and max(seeds) > 1 else ")")
            if seeds else "")
    return f"{min(ss):.3f}-{max(ss):.3f}{over}"


def _retrieval(recs: list[Rec]) -> str:
    have = [r for r in recs if math.isfinite(r.m("retrieval_p1"))]
    if not have:
        return "not measured (no retrieval runs)"
    top = max(have, key=lambda r: r.m("retrieval_p1"))
    return f"up to {top.m('retrieval_p1'):.3f} (chance {top.m('retrieval_chance'):.4f}; {top.tags.get('pair')})"


def _transport(an: Analysis) -> str:
    n = int(an.metrics.get("transport_directions", 0))
    if not n:
        return "not measured (no transport runs)"
    return (f"helps {int(an.metrics['transport_helped'])}/{n} directions, OT beats its shuffled plan "
            f"{int(an.metrics['transport_beats_control'])}/{n}, its shrink-only control {int(an.metrics.get('transport_beats_shrink', 0))}/{n}"
            " (each counted only where its paired 95% interval over FLORES articles excludes 0, the first token apart; "
            "no post-fusion adaptation unless the transport section shows one)")


def _adapt(an: Analysis) -> str:
    best = [r for r in an.study.kind("adapt") if r.tags.get("ratio") == "best"]
    if not best:
        return "not measured (no adapt runs)"
    return "; ".join(f"{r.tags.get('protocol', r.tags.get('operator', '?'))} {r.tags.get('small')} ~ {r.tags.get('large')}: ratio "
                     f"{r.m('best_ratio'):g} chosen on dev, {claims.cell(r, 'gain_vs_small')} nats/token on test over the small "
                     f"model ({claims.verdict(r, 'gain_vs_small')})"
                     for r in best)


def _gpa(an: Analysis) -> str:
    sp = [r for r in an.study.kind("shared_space") if math.isfinite(r.m("gpa_p1_32"))]
    if not sp:
        return "not measured (no shared_space runs)"
    return "; ".join(f"GPA {r.m('gpa_p1_32'):.3f} vs pairwise {r.m('pairwise_p1_32'):.3f} on {r.tags.get('data')}" for r in sp)


def beside_the_seed(an: Analysis, number: str) -> Section | None:
    """The study's headline numbers beside the seed reports' (None when the study has no cross-model pairs)."""
    if not an.pairs:
        return None
    sec = Section("beside_seed", f"{number}. Beside the seed reports' numbers")
    own = [p["recs"]["cka"] for p in an.pairs if "cka" in p["recs"]]
    one = [r for r in an.study.one_language if r.tags.get("metric") == "cka"]
    rows = [["matched last-layer CKA, each model on its own language", _cka(own), *SEED["cka"]]]
    if one:
        rows.append(["matched last-layer CKA, every model on one language", _cka(one), "(the shared-space paper's protocol; "
                     "no CKA figure in its summary)", SEED["gpa"][1]])
    rows += [["shuffled-control CKA", _shuffled(own), *SEED["shuffled"]],
             ["retrieval P@1 after a fitted linear map", _retrieval([p["recs"]["retrieval"] for p in an.pairs if "retrieval" in p["recs"]]),
              *SEED["retrieval"]],
             ["transport fusion at the headline alpha", _transport(an), *SEED["transport"]],
             ["dimensional adaptation", _adapt(an), *SEED["adapt"]],
             ["shared space: held-out retrieval, GPA vs pairwise", _gpa(an), *SEED["gpa"]]]
    sec.tables.append(RTable("This study beside the seed reports", ["quantity", "this study", "the seed report", "source"], rows,
                             note="The seed's numbers are quoted from ../shared/spec, never computed here; their models, sizes "
                                  "and sentence counts differ from this study's (its config and section 1), and the seed counts "
                                  "a raw difference as a win where this study asks for an interval that excludes 0. Raw CKA "
                                  "depends on n and the widths (its shuffled control falls as n grows); the calibrated value "
                                  "(against its permutation null) is comparable across them."))
    an.csv["tables/beside_the_seed.csv"] = sec.tables[-1].csv()
    return sec
