"""The transport arm's comparisons, from per-sentence scores: what a run logs and what the report recomputes from the
run's ``scores/sentences.csv`` with the current rule (:mod:`mergescope.intervals`), so a better rule never reruns a job.

Arms of one alpha's run (``kind=transport``): ``base`` (the unfused target), ``ot`` (the OT fusion), ``rand``,
``rand1``, ... (the random-plan control's seeds), ``shrink`` (the shrink-only control), on ``target_lang`` and
``donor_lang``; ``ot`` and ``base`` also on ``select`` (the alpha-selection split). Arms of a post-fusion adaptation
run (``kind=transport_adapt``, stage ``fused``): ``ot_after``, ``rand_after``, ... (the adapted random-plan control's
seeds), ``damped_baseline_after``; its no-fusion baseline's ``baseline_after`` lives in the baseline's run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mergescope.evidence import compare
from mergescope.scoring.bpb import Scores

__all__ = ["ALPHA_DIFFERENCES", "alpha_comparisons", "seeds_of", "rejudge_alpha", "rejudge_adapt"]

ALPHA_DIFFERENCES = (("delta", "ot", "base"), ("rand_delta", "rand", "base"), ("ot_minus_rand", "ot", "rand"),
                     ("shrink_delta", "shrink", "base"), ("ot_minus_shrink", "ot", "shrink"))
"""(name, arm a, arm b) of each difference an alpha's run logs per language (``<name>_<lang>``); ``rand`` stands for
every seed of the random-plan control (a distribution: :mod:`mergescope.intervals`)."""

Docs = Mapping[str, tuple[Sequence[str] | None, str]]


def seeds_of(sc: Mapping[tuple[str, str], Scores], stem: str, lang: str) -> list[Scores]:
    """Every seed of a seeded arm on ``lang``: ``rand``, ``rand1``, ``rand2``, ... (seed 0 first)."""
    out = [sc[(stem, lang)]] if (stem, lang) in sc else []
    i = 1
    while (f"{stem}{i}", lang) in sc:
        out.append(sc[(f"{stem}{i}", lang)])
        i += 1
    return out


def _arm(sc, name: str, lang: str):
    if name == "rand":
        seeds = seeds_of(sc, "rand", lang)
        return seeds if len(seeds) > 1 else (seeds[0] if seeds else None)
    return sc.get((name, lang))


def alpha_comparisons(sc: Mapping[tuple[str, str], Scores], docs: Docs) -> dict[str, float]:
    """Every difference of one alpha's run with its paired interval, both scopes (:data:`ALPHA_DIFFERENCES` on each
    language, and ``select_delta_target_lang`` on the selection split where scored)."""
    out: dict[str, float] = {}
    if ("ot", "select") in sc and ("base", "select") in sc and "select" in docs:
        out.update(compare("select_delta_target_lang", sc[("ot", "select")], sc[("base", "select")], *docs["select"]))
    for lang in ("target_lang", "donor_lang"):
        if lang not in docs:
            continue
        for name, x, y in ALPHA_DIFFERENCES:
            a, b = _arm(sc, x, lang), _arm(sc, y, lang)
            if a is not None and b is not None:
                out.update(compare(f"{name}_{lang}", a, b, *docs[lang]))
    return out


def _docs(table: tuple[dict, dict], what: str) -> dict[str, tuple[Any, str]]:
    _, docs = table
    return {lang: (d, what if d is not None else "sentence") for lang, d in docs.items()}


def rejudge_alpha(study, r) -> dict[str, float] | None:
    """An alpha run's differences recomputed from its per-sentence table (None: a run recorded without one)."""
    table = study.score_table(r.run_id)
    if table is None:
        return None
    return alpha_comparisons(table[0], _docs(table, r.params.get("eval_resampled") or "article"))


def adapt_comparisons(sc: Mapping[tuple[str, str], Scores], base_after: Scores | None,
                      base_scores: Mapping[str, Scores], docs: Docs) -> dict[str, float]:
    """A post-fusion adaptation run's differences: each fused arm (OT, the random-plan control over its seeds) after
    adaptation against the adapted no-fusion baseline (``<p>fusion_effect_after_adapt``) and, where trained so, against
    the damped baseline; on the donor's language against the unfused target; OT against the random-plan control."""
    out: dict[str, float] = {}
    t, dn = docs.get("target_lang"), docs.get("donor_lang")
    arms = {"": _seeded(sc, "ot_after"), "rand_": _seeded(sc, "rand_after")}
    for p, arm in arms.items():
        if arm[0] is not None and base_after is not None and t is not None:
            out.update(compare(f"{p}fusion_effect_after_adapt", arm[0], base_after, *t))
        if arm[0] is not None and ("damped_baseline_after", "target_lang") in sc and t is not None:
            out.update(compare(f"{p}fusion_effect_vs_damped_after_adapt", arm[0],
                               sc[("damped_baseline_after", "target_lang")], *t))
        if arm[1] is not None and "donor_lang" in base_scores and dn is not None:
            out.update(compare(f"{p}delta_donor_lang_after_adapt", arm[1], base_scores["donor_lang"], *dn))
    if arms[""][0] is not None and arms["rand_"][0] is not None and t is not None:
        out.update(compare("ot_minus_rand_after_adapt", arms[""][0], arms["rand_"][0], *t))
    if arms[""][1] is not None and arms["rand_"][1] is not None and dn is not None:
        out.update(compare("ot_minus_rand_donor_lang_after_adapt", arms[""][1], arms["rand_"][1], *dn))
    return out


def _seeded(sc, stem: str) -> tuple[Any, Any]:
    """An arm on the target's and the donor's language: one Scores, or the list of its seeds (``<stem>``,
    ``<stem>1``, ...)."""
    out = []
    for lang in ("target_lang", "donor_lang"):
        seeds = seeds_of(sc, stem, lang)
        out.append(None if not seeds else seeds[0] if len(seeds) == 1 else seeds)
    return out[0], out[1]


def rejudge_adapt(study, r) -> dict[str, float] | None:
    """A fused-then-adapted run's differences recomputed from its table, its baseline's and its direction's unfused
    target's (the headline alpha run's ``base`` arm)."""
    if r.tags.get("stage") == "baseline":
        return None
    table = study.score_table(r.run_id)
    base_run = r.params.get("baseline_run")
    base = study.score_table(base_run) if base_run else None
    if table is None:
        return None
    sc, _ = table
    docs = _docs(table, "article")
    base_after = None if base is None else base[0].get(("baseline_after", "target_lang"))
    alpha_run = next((x for x in study.kind("transport") if x.tags.get("direction") == r.tags.get("direction")
                      and x.tags.get("transport_variant") == r.tags.get("transport_variant")), None)
    alpha_table = None if alpha_run is None else study.score_table(alpha_run.run_id)
    base_scores = {} if alpha_table is None else {lang: s for (arm, lang), s in alpha_table[0].items() if arm == "base"}
    return adapt_comparisons(sc, base_after, base_scores, docs)
