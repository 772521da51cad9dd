"""Merged models of a native pair: one run per merged model (``task=merge``, kind=merge, route=native),
with its NLL on the host's language and its gain over the better endpoint."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
from omegaconf import DictConfig, OmegaConf

from mergescope.config import plain_copy, to_plain
from mergescope.errors import MergescopeError
from mergescope.merge import check_base, merge_state_dicts, mergekit_yaml, resolve_preset, stochastic
from mergescope.merge.presets import TRANSPORT_HINT, preset_config  # noqa: F401 (re-exported)
from mergescope.scoring.bpb import Scores
from mergescope.evidence import sentence_csv
from mergescope.native.comparisons import merge_comparisons
from mergescope.documents import documents
from mergescope.native.pair import (Loaded, base_entry, check_pair, host_scores, lang_endpoints, lang_gains, lang_sentences,
                                    nll_documents, nll_langs, nll_sentences, no_base_reason, outcome_langs, same_run,
                                    select_sentences)
from mergescope.native.settings import NativeSettings
from mergescope.native.stats import GRAM_RULE, STATS_KEYS, check_stats, pair_stats
from mergescope.runs import JobResult, JobSpec, pair_tags, pair_text, run_once

MERGE_KEYS = ["pair", "merge", "data", "native.base", "native.nll_sentences", "native.merge_seeds", "native.select_split",
              "represent.max_length"]
EVIDENCE = 2
"""In every merge's and native run's identity: 1 = per-sentence scores kept, merge_gain with its paired interval and the
first token apart (runs recorded before have none, so they run again)."""
LANG_GAINS = 1
"""In the identity of a merge (and native) run scored on ``native.nll_langs``: 1 = the merge's gain over the better
expert on each of those languages with its paired interval (``merge_gain_<lang>``), their per-sentence scores kept."""

def outcome_part(cfg: DictConfig) -> dict[str, str]:
    """``native.outcome`` in a merge's identity when it is not the host's language alone (unset: earlier hashes kept)."""
    return {"outcome": "both"} if len(outcome_langs(cfg)) > 1 else {}


def outcome_tags(cfg: DictConfig) -> dict[str, str]:
    """The run tags of a merge's or native run's outcome: ``outcome`` (both) and ``base`` (a pretrained base given as a
    model entry: the family of a fine-tune pair)."""
    from mergescope.runs import model_label

    be = base_entry(cfg)
    fam = {"base": model_label(be)} if be is not None and not same_run(cfg) else {}
    return {**({"outcome": "both"} if len(outcome_langs(cfg)) > 1 else {}), **fam}


def with_mix(merge_cfg: DictConfig, mix: float) -> DictConfig:
    """Set the weight of model b: ``t`` for interpolating operators, ``weights`` = [1-w, w] otherwise; nothing for an
    operator registered ``mix=False`` (no mix weight: nearswap's ``t`` is a distance)."""
    m = plain_copy(merge_cfg)
    entry, _ = resolve_preset(m)
    if entry.meta.get("mix") is False:
        return m
    if "t" in entry.params:
        m.t = float(mix)
    elif "weights" in entry.params:
        m.weights = [1.0 - float(mix), float(mix)]
    return m


def check_merge(cfg: DictConfig):
    if cfg.get("merge") is None:
        raise MergescopeError("task=merge needs an operator: add merge=<name> (see conf/merge/)")
    if cfg.merge.get("name") in ("transport", "transport_released"):
        raise MergescopeError(f"task=merge merge={cfg.merge.get('name')}: {TRANSPORT_HINT}")
    entry, kwargs = resolve_preset(cfg.merge, n_models=2)  # a pair merges two models: one weight per model
    check_base(entry, base_entry(cfg) is not None, no_base_reason(cfg))
    if entry.meta.get("needs_stats"):
        check_stats(cfg)
    return entry, kwargs


def merge_keys(entry) -> list[str]:
    """The identity keys of a merge run: a data-aware operator's also name the split and count it read."""
    return MERGE_KEYS + (STATS_KEYS if entry.meta.get("needs_stats") else [])


def same_as_linear(entry, kwargs: dict) -> bool:
    """Task arithmetic with lambda 1 and weights summing to 1 is exactly the linear average:
    base + sum_i w_i (theta_i - base) = sum_i w_i theta_i. It is the same model, not another operator."""
    if entry.name not in ("task_arithmetic", "generalized_task_arithmetic") or kwargs.get("normalize"):
        return False
    if kwargs.get("sparsification", "none") != "none" or kwargs.get("consensus", "none") != "none":
        return False
    w = kwargs.get("weights")
    return float(kwargs.get("lambda_", 1.0)) == 1.0 and w is not None and abs(sum(w) - 1.0) < 1e-12


def _merged_nll(cfg: DictConfig, pair: Loaded, entry, kwargs: dict, sentences, job,
                kept: list[Scores] | None = None, kept_langs: dict[str, list[Scores]] | None = None) -> dict[str, float]:
    """NLL of the merged model; for a stochastic operator the mean and sd over ``native.merge_seeds`` seeds
    (seed, seed+1, ...), each seed's NLL a metric step. ``val_nll`` (``val_nll_rest``: the first token apart, what the
    native run chooses its operator on): the same on ``native.select_split``, when that split shares no line with the
    scored one. ``kept``: each seed's per-sentence scores on the host's sentences are appended to it; ``kept_langs``:
    on each language of ``native.nll_langs``, under the language."""
    n = NativeSettings.from_cfg(cfg).merge_seeds if stochastic(kwargs) else 1
    texts = {lang: lang_sentences(cfg, lang) for lang in nll_langs(cfg)}  # native.nll_langs: the other languages
    val = select_sentences(cfg)
    stats, read = pair_stats(cfg, pair, entry)
    nlls, vals, by_lang = [], [], {lang: [] for lang in texts}
    for i in range(n):
        kw = {**kwargs, "seed": int(kwargs["seed"]) + i} if stochastic(kwargs) else kwargs
        for name in pair.coverage.shared:  # tensor by tensor into the host: no second whole model in memory
            pair.set_shared(merge_state_dicts(entry, kw, [pair.sd_a, pair.sd_b], pair.sd_base, [name], cfg.device, stats))
        what = f"nll {cfg.merge.name}" + (f" seed {kw['seed']}" if n > 1 else "")
        sc = host_scores(cfg, pair, sentences, what)
        nlls.append(sc.nats_per_token)
        if kept is not None:
            kept.append(sc)
        for lang, t in texts.items():  # the host's own sentences again: the same scores, not recomputed
            lsc = sc if tuple(t) == tuple(sentences) else host_scores(cfg, pair, t, f"{what} {lang}")
            by_lang[lang].append(lsc.nats_per_token)
            if kept_langs is not None:
                kept_langs.setdefault(lang, []).append(lsc)
        if val is not None:
            vals.append(host_scores(cfg, pair, val, f"{what} {NativeSettings.from_cfg(cfg).select_split}"))
        pair.restore()
        if n > 1:
            job.log_metrics({"nll_by_seed": nlls[-1]}, step=i)
    a = np.asarray(nlls, dtype=np.float64)
    return {"nll": float(a.mean()), "nll_sd": float(a.std(ddof=1)) if n > 1 else 0.0, "n_seeds": float(n),
            **{f"nll_{lang}": float(np.mean(v)) for lang, v in by_lang.items()}, **read,
            **({"val_nll": float(np.mean([v.nats_per_token for v in vals])),
                "val_nll_rest": float(np.mean([v.scope("rest").nats_per_token for v in vals])),
                "n_val_sentences": float(len(val))} if val is not None else {})}


def _endpoints(cfg: DictConfig, loaded: Loaded, sentences) -> tuple[Scores, Scores]:
    s0 = host_scores(cfg, loaded, sentences, "nll a")
    loaded.interpolate(1.0)
    s1 = host_scores(cfg, loaded, sentences, "nll t=1")
    loaded.restore()
    return s0, s1


def mergekit_text(cfg: DictConfig, pair: Loaded, entry, kwargs: dict) -> str:
    """The equivalent mergekit YAML of this merge (logged as ``merge/mergekit.yaml``), departures as comments."""
    from mergescope import models

    def ref(r) -> str:
        return r.location if r.local or not r.revision else f"{r.location}@{r.revision}"

    be = base_entry(cfg) if pair.sd_base is not None else None
    base = ref(models.resolve(be)) if be is not None else None
    notes = [f"model {side} is a GGUF file, which mergekit does not read" for side, r in (("a", pair.ref_a), ("b", pair.ref_b))
             if getattr(r, "gguf_file", None)]
    if pair.coverage.excluded:
        notes.append(f"mergescope merges the {len(pair.coverage.shared)} shared tensors into model a and keeps a's other "
                     f"{len(pair.coverage.excluded)}; mergekit needs every tensor in every model")
    if (tp := getattr(pair, "transplant", None)) and tp.get("done"):
        notes.append(f"mergescope first gave both models one vocabulary ({tp['target']}, a new token's rows by {tp['method']}); "
                     "mergekit's tokenizer_source copies a missing token's row from a model that holds it")
    seeds = NativeSettings.from_cfg(cfg).merge_seeds
    if stochastic(kwargs) and seeds > 1:
        notes.append(f"mergescope's NLL is the mean over {seeds} seeds; this YAML is one merge")
    return mergekit_yaml(entry, kwargs, [ref(pair.ref_a), ref(pair.ref_b)], base,
                         dtype=dt if (dt := models.merge_dtype(cfg.pair.a.get("dtype"))) in ("float32", "float64") else "float32",
                         extra_notes=notes)


def run_merge(cfg: DictConfig, overrides: list[str] | None = None, loaded: Loaded | None = None,
              endpoints: tuple[Scores, Scores] | None = None, lang_ends: dict[str, float] | None = None,
              lang_scores: dict[tuple[str, str], Scores] | None = None) -> JobResult:
    """One merged model's NLL on the host's language (and on every language of ``native.nll_langs``, beside each
    expert's and the base's there: ``lang_ends``, with the experts' per-sentence scores ``lang_scores``, computed when
    not given; the merge's gain over the better expert on each with its interval): its own run (kind=merge,
    route=native).
    With ``+merge.models=[...]`` (or ``merge=mergekit merge.config=...``) it merges those models instead of the pair
    (:mod:`mergescope.native.multi`)."""
    from mergescope.native.multi import is_multi, run_merge_n

    if is_multi(cfg):
        return run_merge_n(cfg, overrides)
    refs = check_pair(cfg)
    entry, kwargs = check_merge(cfg)
    langs = nll_langs(cfg)

    def body(job) -> dict[str, float]:
        pair = loaded or Loaded(cfg, need_base=entry.meta.get("needs_base", False) or bool(langs))
        sentences = nll_sentences(cfg)
        s0, s1 = endpoints if endpoints is not None else _endpoints(cfg, pair, sentences)
        nll0, nll1 = s0.nats_per_token, s1.nats_per_token
        end_scores: dict[tuple[str, str], Scores] = {}
        if lang_ends is not None and lang_scores is not None:
            ends, end_scores = lang_ends, lang_scores
        else:
            ends = lang_endpoints(cfg, pair, kept=end_scores)
        merged: list[Scores] = []
        merged_langs: dict[str, list[Scores]] = {}
        res = _merged_nll(cfg, pair, entry, kwargs, sentences, job, merged, merged_langs)
        docs, what = nll_documents(cfg)
        # merge_gain = the better endpoint minus the merge (seeds of a stochastic merge: the interval includes them)
        gain = {**merge_comparisons(s0, s1, merged, docs, what), **lang_gains(cfg, end_scores, merged_langs)}
        tables = {("a", "host"): s0, ("t1", "host"): s1, **{(f"merged_seed{i}", "host"): m for i, m in enumerate(merged)}}
        groups = {"host": docs}
        for lang, ms in merged_langs.items():  # each language's rows: the two experts and each seed's merge
            tables.update({(who, lang): end_scores[(who, lang)] for who in ("a", "b") if (who, lang) in end_scores})
            tables.update({(f"merged_seed{i}", lang): m for i, m in enumerate(ms)})
            groups[lang] = documents(cfg.data, lang, len(ms[0].nll))[0]
        job.log_text(sentence_csv(tables, groups), "scores/sentences.csv")
        if pair.transplant is not None:
            job.log_params({"transplant": pair.transplant})
        job.log_text(mergekit_text(cfg, pair, entry, kwargs), "merge/mergekit.yaml")
        if cfg.get("save"):  # the merged model (seed 0) as a standard folder under paths.merged/<run id>/
            from mergescope.native.save import save_pair

            job.log_params({"saved_to": save_pair(cfg, pair, entry, kwargs, job.run_id)})
        return {**res, **ends, "nll_a": nll0, "nll_t1": nll1, **gain, "merge_gain": min(nll0, nll1) - res["nll"],
                "same_as_linear": float(same_as_linear(entry, kwargs)),
                "n_shared_tensors": float(len(pair.coverage.shared)), "shared_params": float(pair.coverage.shared_params),
                "n_sentences": float(len(sentences))}

    ts = NativeSettings.from_cfg(cfg).transplant_settings()
    tags = {"kind": "merge", "route": "native", "merge": cfg.merge.name, "operator": entry.name, **pair_tags(cfg),
            "seed": kwargs.get("seed", cfg.seed), "same_as": "linear" if same_as_linear(entry, kwargs) else None,
            "transplant": None if ts is None else f"{ts.tokenizer}:{ts.method}", **outcome_tags(cfg)}
    extra = {"evidence": EVIDENCE, **({"nll_langs": langs, "lang_gains": LANG_GAINS} if langs else {}),
             **({"save": True} if cfg.get("save") else {}),
             **outcome_part(cfg),
             **({"transplant": asdict(ts)} if ts is not None else {}),
             **({"gram": GRAM_RULE} if entry.meta.get("needs_stats") == "gram" else {})}
    res = run_once(cfg, JobSpec(f"merge {cfg.merge.name} {pair_text(cfg)}", tags, task="merge", keys=merge_keys(entry),
                                reads=refs, extra=extra or None), body, overrides)  # unset: every earlier hash unchanged
    if cfg.get("eval") is not None and str(cfg.eval.get("name")) == "lm_eval":  # lm-eval on the merged model, own run
        from mergescope.native.save import pair_lm_eval

        pair_lm_eval(cfg, loaded, entry, kwargs, res, overrides, refs)
    return res


def merge_configs(cfg: DictConfig) -> list[DictConfig]:
    """The merge jobs of a native pair: every preset in native.merges at every mix weight; base-requiring
    presets are left out (with the reason logged) when the pair has no common base."""
    out = []
    plain = to_plain(cfg)  # resolved once: each merge's config is this plus its preset (a study relaunch builds many)
    has_base = base_entry(cfg) is not None
    ns = NativeSettings.from_cfg(cfg)
    for name in ns.merges:
        preset = preset_config(str(name))
        entry, _ = resolve_preset(preset)
        if entry.meta.get("needs_base") and not has_base:
            continue
        for mix in ns.mix:
            c = OmegaConf.create({**plain, "merge": to_plain(with_mix(preset, float(mix))), "task": {"name": "merge"}})
            out.append(c)
    return out
