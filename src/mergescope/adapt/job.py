"""``task=adapt``: one protocol on one pair of scales (``adapt=expand``: union; ``adapt=truncate``: intersection).

Every scored model is its own run (kind=adapt, route=adapt, tags operator / mode / ratio / control /
protocol): the two anchors (ratio 0 and 1), every ratio of the protocol's grid, and at the chosen ratio (or at
every ratio, ``adaptation.at=grid``) the two controls. Intersection also runs the comparison operators of the
merge registry in the same small space (kind=merge, route=adapt; the small model is the base, so the donor's
task vector is T(large) - small). Then one summary run (kind=adapt, ratio=best): the ratio chosen on the
validation split and its numbers on the disjoint test split. Before it, the two source models are scored as
themselves (kind=adapt, control=source; one run per model, shared by both protocols of the pair) and the summary
logs the pair's competence overlap from their task profiles (:mod:`.overlap`) and both models' sizes. Bad input is
refused before any run exists.

The arm's task handlers are here, as every arm's are in its ``job.py``: :func:`run_adapt` (task=adapt) and
:func:`run_expansion` (task=expansion, the function check of Expand; its work in :mod:`mergescope.adapt.kept`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
from omegaconf import DictConfig

from mergescope import models
from mergescope.adapt.evaluate import attention_diagnostics, load_texts, score
from mergescope.adapt.kept import run_expansion  # task=expansion (a handler of this arm; see the module doc)
from mergescope.adapt.overlap import Overlap, competence_overlap, task_profile
from mergescope.adapt.setup import Loaded, Setup, check_adapt
from mergescope.scoring.bpb import Scores
from mergescope.config import to_plain
from mergescope.evidence import compare, compare_strata, read_all_scores, sentence_csv, strata_mean
from mergescope.merge import merge_state_dicts, resolve_preset
from mergescope.merge.presets import preset_config
from mergescope.progress import console
from mergescope.runs import JobResult, JobSpec, pair_tags, run_once

CHILD_KEYS = ["pair", "adapt", "data", "represent.max_length", "adaptation.val_split", "adaptation.test_split",
              "adaptation.langs", "adaptation.nll_sentences", "adaptation.sample", "adaptation.diag_sentences", "save"]
# A source model scored as itself: neither the operator nor the pair's order changes it, so both protocols of a
# pair share its run (the pair's models, their order by size and the languages are in the hash).
SOURCE_KEYS = ["data", "represent.max_length", "adaptation.val_split", "adaptation.test_split",
               "adaptation.nll_sentences", "adaptation.sample"]
SIDES = ("small", "large")
EVIDENCE = 1
"""In every scored adapt run's identity: 1 = per-sentence scores kept (``scores/sentences.csv``), the first token apart
and the summary's differences with their paired intervals (runs recorded before have none, so they run again)."""
SUMMARY_VERSION = 4
"""In the summary run's identity (what it computes from its children): 2 = the noise control over its seeds, the
seesaw per task with intervals; 3 = the ratio chosen on the validation NLL without each sentence's first token; 4 =
every grid ratio scored on the test split against the better end (``grid_gain.<ratio>_rest``, the route forecast's
rows)."""


__all__ = ["run_adapt", "run_expansion", "run_point", "run_source"]

def _score(cfg: DictConfig, loaded: Loaded, job, only: str | None = None) -> dict[str, float]:
    ends = loaded.ends
    kept: dict = {}
    texts = [t for t in loaded.texts if only is None or t.split == only]
    values = score(ends.host, ends.tokenizer, texts, cfg.represent.batch_tokens, int(cfg.represent.max_length), kept)
    log_scores(job, texts, kept)
    n = loaded.setup.settings.diag_sentences or 0
    if n:
        diag = attention_diagnostics(ends.host, ends.tokenizer, loaded.texts[0].sentences[:n], int(cfg.represent.max_length))
        for i, (e, ea, r) in enumerate(zip(diag["attn_entropy"], diag["attn_entropy_all"], diag["resid_norm"])):
            job.log_metrics({k: v for k, v in (("attn_entropy", e), ("attn_entropy_all", ea), ("resid_norm", r))
                             if v == v}, step=i)
        live = [e for e in diag["attn_entropy"] if e == e]  # layers with a contributing head
        values.update({"attn_entropy_mean": sum(live) / len(live) if live else float("nan"),
                       "attn_entropy_all_heads_mean": sum(diag["attn_entropy_all"]) / len(diag["attn_entropy_all"]),
                       "resid_norm_final": diag["resid_norm"][-1]})
    s = loaded.setup
    if s.gqa_mismatched is not None:  # Truncate's prefix breaks the GQA pairing of some query heads (counted, logged)
        values.update({"gqa_mismatched_heads": float(s.gqa_mismatched), "gqa_query_heads": float(s.shapes[0].heads)})
    if cfg.get("save"):
        from mergescope.scoring.save import save_model

        job.log_params({"saved_to": save_model(cfg, ends.host, ends.tokenizer, job.run_id)})
    return values


def log_scores(job, texts, kept: dict) -> None:
    """Every scored sentence of every split and language (``scores/sentences.csv``, arm ``model``, language
    ``<split>.<lang>``): what the summary's paired intervals are computed from."""
    job.log_text(sentence_csv({("model", t.key): kept[t.key] for t in texts}, {t.key: t.documents for t in texts}),
                 "scores/sentences.csv")


def _tags(cfg: DictConfig, setup: Setup, ratio: str, control: str, kind: str = "adapt") -> dict[str, Any]:
    return {"kind": kind, "route": "adapt", "operator": setup.operator.name, "mode": setup.mode, "ratio": ratio,
            "control": control, "protocol": setup.protocol, "small": setup.small_label, "large": setup.large_label,
            "merge_dtype": setup.dtype,
            **pair_tags(cfg), "seed": setup.settings.control_seed}


def run_point(cfg: DictConfig, setup: Setup, loaded: Loaded, ratio: float, control: str, overrides,
              seed: int | None = None, only: str | None = None) -> JobResult:
    """One scored model: the merge (``control='none'``) or a control at ``ratio`` (the noise control: of ``seed``,
    by default ``adaptation.control_seed``); ``only='val'``: scored on the validation split alone (a grid ratio of
    ``adaptation.grid_scored=val``: its own job)."""
    seed = setup.settings.control_seed if seed is None else int(seed)

    def body(job) -> dict[str, float]:
        loaded.ensure()
        loaded.ends.set(ratio, control, seed)
        values = _score(cfg, loaded, job, only)
        loaded.ends.set(0.0)
        return {**values, "ratio": float(ratio)}

    name = f"adapt {setup.protocol} {control} r={ratio:g} {setup.small_label} x {setup.large_label}" + (
        f" ({only} only)" if only else "")
    extra = {"ratio": float(ratio), "control": control, "seed": seed if control == "noise" else None, "evidence": EVIDENCE,
             **({"scored": only} if only else {})}
    tags = {**_tags(cfg, setup, f"{ratio:g}", control), "seed": seed, **({"scored": only} if only else {})}
    spec = JobSpec(name + (f" seed {seed}" if control == "noise" else ""), tags, task="adapt", keys=CHILD_KEYS,
                   reads=setup.refs, extra=extra)
    return run_once(cfg, spec, body, overrides)


def control_seeds(setup: Setup, control: str) -> list[int]:
    """The seeds a control runs with: ``adaptation.noise_seeds`` of them from ``control_seed`` for the noise control
    (its direction is random), the one ``control_seed`` for the deterministic scaling control."""
    st = setup.settings
    return [st.control_seed + i for i in range(st.noise_seeds if control == "noise" else 1)]


def compare_preset(name: str, ratio: float) -> dict[str, Any]:
    """A merge preset of the registry, set to give the donor weight ``ratio`` against the base (the anchor)."""
    p = dict(to_plain(preset_config(name)))
    entry, _ = resolve_preset(p)
    if "t" in entry.params:
        p["t"] = float(ratio)
    else:
        p.update(weights=[float(ratio)], normalize=False)
    return p


def run_compare(cfg: DictConfig, setup: Setup, loaded: Loaded, name: str, ratio: float, overrides) -> JobResult:
    """A comparison operator in the small space (intersection): base = small, donor = T(large)."""
    preset = compare_preset(name, ratio)

    def body(job) -> dict[str, float]:
        loaded.ensure()
        entry, kwargs = resolve_preset(preset)
        ends = loaded.ends
        anchor = dict(ends.lo())
        sds, base = ([anchor, dict(ends.hi)], None) if "t" in kwargs else ([dict(ends.hi)], anchor)
        ends.write(iter(merge_state_dicts(entry, kwargs, sds, base, list(anchor), cfg.device).items()))
        values = _score(cfg, loaded, job)
        ends.set(0.0)
        return {**values, "ratio": float(ratio)}

    tags = {**_tags(cfg, setup, f"{ratio:g}", "none", kind="merge"), "merge": name}
    return run_once(cfg, JobSpec(f"adapt-merge {name} r={ratio:g} {setup.small_label} x {setup.large_label}", tags,
                                 task="adapt_merge", keys=CHILD_KEYS, reads=setup.refs, extra={"preset": preset, "evidence": EVIDENCE}), body, overrides)


def _source_model(cfg: DictConfig, setup: Setup, loaded: Loaded, side: str):
    """(model, tokenizer, host): the protocol's host, already loaded, at its end when that end IS the model (union:
    ratio 1 = large, intersection: ratio 0 = small; (1-r) lo + r hi is exactly one end there), else the model loaded
    alone (a job whose points were all reused does not load the pair for it)."""
    if loaded.ends is not None and side == ("large" if setup.protocol == "union" else "small"):
        loaded.ends.set(1.0 if side == "large" else 0.0)
        return loaded.ends.host, loaded.ends.tokenizer, True
    entry, ref = (setup.small, setup.refs[0]) if side == "small" else (setup.large, setup.refs[1])
    m = models.load(entry, cfg.device, ref=ref, quiet=True, dtype=models.merge_dtype(entry.get("dtype")))
    return m.model, m.tokenizer, False


def run_source(cfg: DictConfig, setup: Setup, loaded: Loaded, side: str, overrides) -> JobResult:
    """One source model (``side`` small or large) scored as itself on the job's texts, with its parameter count:
    the two profiles the competence overlap is read from (ratio 1 of intersection is T(large), not the large model,
    and ratio 0 of union is E(small), not the small one). Both protocols of a pair share the two runs."""

    def body(job) -> dict[str, float]:
        model, tok, host = _source_model(cfg, setup, loaded, side)
        st = setup.settings
        texts = load_texts(cfg.data, setup.langs, st.splits, st.nll_sentences, st.sample)
        kept: dict = {}
        values = score(model, tok, texts, cfg.represent.batch_tokens, int(cfg.represent.max_length), kept)
        log_scores(job, texts, kept)
        n_params = float(models.true_config(model)["n_params"])
        if host:
            loaded.ends.set(0.0)
        return {**values, "n_params": n_params}

    tags = {"kind": "adapt", "route": "adapt", "ratio": "source", "control": "source", "protocol": "source",
            "source": side, "small": setup.small_label, "large": setup.large_label,
            "pair": f"{setup.small_label}__{setup.large_label}"}  # by size, whichever protocol scored it first
    return run_once(cfg, JobSpec(f"adapt source {side} {setup.small_label} x {setup.large_label}", tags, task="adapt_source",
                                 keys=SOURCE_KEYS, reads=setup.refs, extra={"side": side, "langs": setup.langs, "evidence": EVIDENCE}), body, overrides)


def overlap_of(sources: dict[str, JobResult]) -> Overlap:
    """The pair's competence overlap from the two source models' test-split task profiles."""
    return competence_overlap(task_profile(sources["small"].metrics), task_profile(sources["large"].metrics))


def size_values(setup: Setup, sources: dict[str, JobResult]) -> dict[str, float]:
    """Both models' parameter counts (as loaded), hidden sizes and depths: the size gap of the pair."""
    out = {}
    for side, shape in zip(SIDES, setup.shapes):
        out.update({f"n_params_{side}": sources[side].metrics["n_params"], f"hidden_{side}": float(shape.hidden),
                    f"layers_{side}": float(shape.layers)})
    return out


def best_ratio(points: dict[float, JobResult], grid: list[float]) -> float:
    """The grid ratio with the lowest validation NLL, the first token apart as every comparison reads it (anchors
    excluded; a run recorded without ``val_nll_rest``: over every token)."""
    return min(grid, key=lambda r: points[r].metrics.get("val_nll_rest", points[r].metrics["val_nll"]))


def _summary(cfg, setup, points, controls, compares, best, sources, overrides) -> JobResult:
    overlap = overlap_of(sources)

    def body(job) -> dict[str, float]:
        runs = {**{f"ratio:{r:g}": res.run_id for r, res in points.items()},
                **{f"{k}:{r:g}" + (f":seed{i}" if len(rs) > 1 else ""): x.run_id
                   for (k, r), rs in controls.items() for i, x in enumerate(rs)},
                **{f"{k}:{r:g}": res.run_id for (k, r), res in compares.items()},
                **{f"source:{side}": res.run_id for side, res in sources.items()}}
        job.log_params({"runs": runs})
        lo, hi, b = points[0.0].metrics, points[1.0].metrics, points[best].metrics
        out = {"best_ratio": best, "best_val_nll": b["val_nll"], "best_val_nll_rest": b.get("val_nll_rest", float("nan")),
               "best_test_nll": b["test_nll"],
               "best_test_bpb": b["test_bpb"], "test_nll_r0": lo["test_nll"], "test_nll_r1": hi["test_nll"],
               "gain_vs_small": lo["test_nll"] - b["test_nll"],  # ratio 0 is the small model (or E(small))
               "gain_vs_better_end": min(lo["test_nll"], hi["test_nll"]) - b["test_nll"]}
        for (kind, r), rs in controls.items():
            if r == best:  # a control of several seeds: their mean, and their spread
                vals = [x.metrics["test_nll"] for x in rs]
                out[f"test_nll_{kind}"] = float(np.mean(vals))
                if len(vals) > 1:
                    out[f"test_nll_{kind}_sd"] = float(np.std(vals, ddof=1))
                    out[f"{kind}_seeds"] = float(len(vals))
        for (name, r), res in compares.items():
            if r == best:
                out[f"test_nll_{name}"] = res.metrics["test_nll"]
        st = setup.settings
        texts = load_texts(cfg.data, setup.langs, st.splits, st.nll_sentences, st.sample)
        out.update(summary_intervals(cfg, points, controls, compares, best,
                                     {t.key: t.domains for t in texts if t.split == "test"}))
        return {**out, **overlap.metrics(), **size_values(setup, sources)}

    children = [*points.values(), *(x for rs in controls.values() for x in rs), *compares.values(), *sources.values()]
    tags = {**_tags(cfg, setup, "best", "none"), "competence": overlap.competence,
            "small_better_tasks": ",".join(overlap.small_better) or "none"}
    return run_once(cfg, JobSpec(f"adapt {setup.protocol} best {setup.small_label} x {setup.large_label}", tags,
                                 task="adapt_summary", keys=CHILD_KEYS, reads=setup.refs,
                                 extra={"children": sorted(r.cfg_hash for r in children),
                                        "summary": SUMMARY_VERSION}), body, overrides)


def seesaw_intervals(b: dict, ends: dict[str, dict], docs: dict, domains: dict | None) -> dict[str, float]:
    """The seesaw per task with its paired intervals: for each language (``<lang>``) and each FLORES domain (pooled over
    the languages, an article drawn in every language at once), ``seesaw_vs_<end>.<task>`` = the chosen model's test
    NLL minus the end's (``r0``, ``r1``; negative = the merge is better on that task), in both scopes."""
    out: dict[str, float] = {}
    tasks: dict[str, list[tuple[str, np.ndarray | None]]] = {k.split(".", 1)[1]: [(k, None)] for k in b}
    for k, doms in (domains or {}).items():
        if k in b and doms is not None and len(doms) == len(b[k].nll):
            for dom in sorted(set(doms)):
                tasks.setdefault(dom, []).append((k, np.array([d == dom for d in doms])))
    for task, parts in tasks.items():
        pick = lambda arm: Scores.concat([arm[k] if m is None else arm[k].select(m) for k, m in parts])  # noqa: E731
        groups = None if any(docs.get(k) is None for k, _ in parts) else [
            d for k, m in parts for d, keep in zip(docs[k], m if m is not None else [True] * len(docs[k])) if keep]
        for end, arm in ends.items():
            out.update(compare(f"seesaw_vs_{end}.{task}", pick(b), pick(arm), groups, "article" if groups else "sentence"))
    return out


def summary_intervals(cfg, points, controls, compares, best: float, domains: dict | None = None,
                      table=None) -> dict[str, float]:
    """The summary's comparisons on the test split with their paired intervals (both scopes; a mean over languages
    with a FLORES article drawn in every language at once), from the runs' per-sentence tables: ``gain_vs_small``
    (ratio 0 minus the chosen ratio), ``gain_vs_better_end`` (the better end in each scope minus it), and for every
    control and comparison operator at the chosen ratio ``best_minus_<name>`` (negative = the merge beats it; a control
    of several seeds is their mean, a distribution: the interval also covers its seeds' prediction interval), and for
    every grid ratio the test split scored ``grid_gain.<ratio>_rest`` (the better end without first tokens minus that
    ratio's merge: each one merge of the route benchmark, :mod:`mergescope.advise.bench`). Runs
    recorded without the tables give nothing (the summary's differences then carry no interval). ``table``: a run id
    -> its parsed table (the report's reader); the runs' artifacts through ``cfg`` by default."""
    def test_of(run):
        got = table(run.run_id) if table is not None else read_all_scores(cfg, run.run_id)
        if got is None:
            return None, None
        scores, docs = got
        keys = [lang for (arm, lang) in scores if arm == "model" and lang.startswith("test.")]
        return {k: scores[("model", k)] for k in keys}, {k: docs[k] for k in keys}

    b, docs = test_of(points[best])
    lo, _ = test_of(points[0.0])
    hi, _ = test_of(points[1.0])
    if b is None or lo is None or hi is None:
        return {}
    what = "article" if all(d is not None for d in docs.values()) else "sentence"
    out = compare_strata("gain_vs_small", lo, b, docs, what)
    out.update(seesaw_intervals(b, {"r0": lo, "r1": hi}, docs, domains))
    for scope in ("all", "rest"):  # the better end chosen in each scope on its own
        better = min((lo, hi), key=lambda e: strata_mean(e, scope))
        out.update(compare_strata("gain_vs_better_end", better, b, docs, what, scopes=(scope,)))
    better = min((lo, hi), key=lambda e: strata_mean(e, "rest"))
    for r in sorted(x for x in points if 0.0 < x < 1.0):  # every ratio the test split scored: one merge each
        pt, _ = test_of(points[r]) if r != best else (b, None)
        if pt is not None and set(pt) == set(b):
            out.update(compare_strata(f"grid_gain.{r:g}", better, pt, docs, what, scopes=("rest",)))
    for (name, r), rs in [*controls.items(), *((k, [v]) for k, v in compares.items())]:
        others = [test_of(x)[0] for x in rs] if r == best else [None]
        if all(o is not None for o in others):
            out.update(compare_strata(f"best_minus_{name}", b, others, docs, what))
    return out


def _at(setup: Setup, grid: list[float], best: float) -> list[float]:
    return grid if setup.settings.at == "grid" else [best]


def run_adapt(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    setup = check_adapt(cfg)
    loaded = Loaded(cfg, setup)
    grid = setup.grid
    points = {}
    val_only = setup.settings.grid_scored == "val"  # the interior ratios on the validation split: what the choice reads
    for r in sorted({0.0, 1.0, *grid}):
        points[r] = run_point(cfg, setup, loaded, r, "none", overrides, only="val" if val_only and 0 < r < 1 else None)
        console.print(f"  {setup.protocol} ratio {r:g}: val {points[r].metrics['val_nll']:.4f} "
                      f"test {points[r].metrics.get('test_nll', float('nan')):.4f}{' (done before)' if points[r].skipped else ''}")
    best = best_ratio(points, grid)
    if val_only:  # the chosen ratio scored on both splits (its test numbers are the arm's)
        points[best] = run_point(cfg, setup, loaded, best, "none", overrides)
    controls = {(k, r): [run_point(cfg, setup, loaded, r, k, overrides, seed) for seed in control_seeds(setup, k)]
                for r in _at(setup, grid, best) for k in setup.settings.controls}
    compares = {}
    if setup.protocol == "intersection":
        compares = {(n, r): run_compare(cfg, setup, loaded, str(n), r, overrides)
                    for r in _at(setup, grid, best) for n in setup.settings.compare}
    sources = {side: run_source(cfg, setup, loaded, side, overrides) for side in SIDES}
    result = _summary(cfg, setup, points, controls, compares, best, sources, overrides)
    m = result.metrics
    console.print(f"  competence overlap: {m.get('overlap_frac_large_better', float('nan')):.2f} of the tasks better on "
                  f"the large model, small-better margin {m.get('small_better_margin', float('nan')):.4f}")
    if str(cfg.eval.name) == "lm_eval":
        from mergescope.scoring.lmeval import run_lm_eval

        run_lm_eval(cfg, setup, loaded, best, points[best].run_id, overrides)
    return result


def rejudge_summary(study, r) -> dict[str, float] | None:
    """A summary run's comparisons recomputed from its children's per-sentence tables (the runs its param ``runs``
    names) with the current rule: the gains, every control and comparison at the chosen ratio, the seesaw per
    language (per FLORES domain: as the job logged it, the domains being read from the data). None for a point run."""
    if r.tags.get("ratio") != "best":
        return None
    runs = {k[len("runs."):]: str(v) for k, v in r.params.items() if k.startswith("runs.")}
    if not runs or not np.isfinite(r.m("best_ratio")):
        return None
    best = float(r.m("best_ratio"))
    proxy = lambda rid: SimpleNamespace(run_id=rid)  # noqa: E731
    points = {float(k.split(":")[1]): proxy(v) for k, v in runs.items() if k.startswith("ratio:")}
    others: dict[tuple[str, float], list] = {}
    for k, v in runs.items():
        parts = k.split(":")
        if parts[0] not in ("ratio", "source") and len(parts) >= 2:
            others.setdefault((parts[0], float(parts[1])), []).append(proxy(v))
    if not {0.0, 1.0, best} <= set(points):
        return None
    return summary_intervals(None, points, others, {}, best, None, table=study.score_table)
