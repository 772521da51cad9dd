"""task=transport: one direction (target <- donor) of transport-based fusion, with its control.

Logged per alpha, one run each (kind=transport, route=transport): NLL of the fused target on its
own language and on the donor's language (with the target's own tokenizer), deltas against the
unfused target, the same through the random-plan control, the fused tensors' cosine and relative
L2 to the target's originals, and plan diagnostics. Every alpha is reported; each run is tagged
with ``merge.headline_alpha``, the one alpha the report's headline numbers are read at (never the
alpha that did best on the evaluation sentences). The plans are fitted once per direction and
reused by every alpha and by the control. Then, when ``merge.adapt.enabled``, the residual-frozen
adaptation run (kind=transport_adapt) of the fused model and of its random-plan control, against
their no-fusion baseline (its own run, one per target, shared by every donor).

Evaluation, probe and adaptation sentences are disjoint from the evaluation (:func:`texts`); the
line ranges used are logged as params ``text.eval``, ``text.probes`` and ``text.adapt``.

Which side is the target: ``merge.target`` = a | b; the other side is the donor. The settings are
validated once (:class:`~mergescope.transport.settings.TransportSettings`) and passed down.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from mergescope import models
from mergescope.scoring.bpb import Scores
from mergescope.config import hash_parts, plain_copy, to_plain
from mergescope.documents import documents
from mergescope.errors import MergescopeError
from mergescope.evidence import sentence_csv
from mergescope import precision
from mergescope.progress import console
from mergescope.runs import JobResult, JobSpec, finished, model_parts, run_once, would_run
from mergescope.tracking import Job, Tracker
from mergescope.transport import fusion as fus
from mergescope.transport import interfaces as itf
from mergescope.transport import released as rel
from mergescope.transport.adaptation import ADAPT_CONTROLS, adapt_direction
from mergescope.transport.comparisons import alpha_comparisons, seeds_of
from mergescope.transport.direction import Direction, Fitted, Host
from mergescope.transport.identity import (BASELINE_KEYS, EVIDENCE, TRANSPORT_KEYS, at_adapt_alpha, baseline_hash, digest,  # noqa: F401
                                           job_hash, probe_compute, sides)
from mergescope.transport.settings import TransportSettings, merge_node, probe_data
from mergescope.transport.texts import Texts, probe_cached, probe_path, texts  # noqa: F401 (re-exported)



def check(cfg: DictConfig) -> tuple[DictConfig, TransportSettings]:
    """Every setting and the pair validated before any run exists. Returns the job config (``merge``
    set to the transport settings node, resolved: what the hashes read) and the settings."""
    settings = TransportSettings.from_cfg(cfg)
    for ref in models.resolve_pair(cfg.pair):  # non-finite weights refused before any run (each checkpoint read once)
        models.check_weights(ref, cfg.paths.get("cache"))
    job = plain_copy(cfg)
    with open_dict(job):
        job.merge = plain_copy(merge_node(cfg))
        if job.merge.get("probe_set") == "flores200":  # the default is left out: the hashes of earlier runs still hold
            job.merge.pop("probe_set")
        if job.merge.get("scale_match") == "none" and settings.released is None:  # likewise
            job.merge.pop("scale_match")
        if not job.merge.get("select_sentences"):  # likewise (no selection split)
            job.merge.pop("select_sentences", None)
        if str(job.merge.get("test_at") or "every") == "every":  # likewise (every alpha tested)
            job.merge.pop("test_at", None)
        else:  # the selected alpha is the headline: merge.headline_alpha does not change the run
            job.merge.headline_alpha = None
        ad = job.merge.get("adapt") or {}
        if ad.get("mode", "residual_frozen") == "residual_frozen":  # mergescope's adaptation: the released SFT's keys left out
            for k in ("mode", "freeze", "train_alpha", "warmup_ratio"):
                ad.pop(k, None)
    return job, settings


def _alpha_cfg(cfg: DictConfig, alpha: float) -> DictConfig:
    """One alpha's run config (logged, and hashed with TRANSPORT_KEYS): that alpha alone, no adaptation.
    The study's headline alpha is not part of it (it is hashed and tagged apart, see :func:`_hash`)."""
    c = plain_copy(cfg)
    with open_dict(c):
        c.merge.alphas = [float(alpha)]
        c.merge.headline_alpha = None
        c.merge.adapt = {"enabled": False}
    return c


def _alpha_hashes(cfg: DictConfig, alphas, reads: list[Any], **extra: Any) -> dict[float, str]:
    """Each alpha's ``job_hash("transport", _alpha_cfg(cfg, alpha), TRANSPORT_KEYS, reads, **extra)``, from one plain
    copy of the hashed sections (a config per alpha cost a cached relaunch 25 ms each, 60 of them); the same hashes
    (tests/test_transport.py)."""
    parts = {k: to_plain(OmegaConf.select(cfg, k)) for k in TRANSPORT_KEYS}
    read = model_parts([models.resolve(e) for e in reads])
    out = {}
    for a in alphas:
        merge = {**parts["merge"], "alphas": [float(a)], "headline_alpha": None, "adapt": {"enabled": False}}
        out[a] = hash_parts("transport", {**parts, "merge": merge, **read, "evidence": EVIDENCE, **extra, **precision.identity(cfg),
                                          **probe_compute(cfg)})
    return out


def run_transport(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    cfg, s = check(cfg)
    target, donor = sides(cfg)
    d = Direction(cfg, s, overrides, target, donor, texts(cfg, s, str(target.lang), str(donor.lang)))
    tracker = Tracker(cfg)
    reads = [target, donor]
    saving = {"save": True} if cfg.get("save") else {}  # save=true: each alpha's fused model written (its own runs)
    adapt_hash = job_hash("transport_adapt", at_adapt_alpha(cfg), TRANSPORT_KEYS, reads, adapt_controls=ADAPT_CONTROLS) if s.adapt else None
    adapt_done = finished(cfg, tracker, adapt_hash) if adapt_hash else None
    more = _more_adaptations(d, tracker, reads)
    lm_eval = cfg.get("eval") is not None and str(cfg.eval.get("name")) == "lm_eval"
    if lm_eval:
        from mergescope.scoring.lmeval import check_lm_eval

        if s.test_at == "selected":
            raise MergescopeError("eval=lm_eval scores every alpha of the grid: use merge.test_at=every with it")
        check_lm_eval()  # before any plan is fitted
    fitted: list[Fitted] = []

    def fit() -> Fitted:  # once per direction, only when something runs
        if not fitted:
            fitted.append(_fit(d))
        return fitted[0]

    if s.test_at == "selected":
        if more:
            raise MergescopeError("merge.adapt.more_alphas adapts fused models of the alpha grid: use merge.test_at=every "
                                  "with it (test_at=selected fuses at the chosen alpha alone)")
        return _run_selected(d, tracker, reads, saving, fit, adapt_hash, adapt_done)
    hashes = _alpha_hashes(cfg, s.alphas, reads, headline_alpha=s.headline_alpha, **saving)
    done = {a: finished(cfg, tracker, h) for a, h in hashes.items()}
    if (all(r is not None for r in done.values()) and (s.adapt is None or adapt_done is not None)
            and all(r is not None for _, _, r in more)):
        if s.adapt is not None:  # the reused adaptation's no-fusion baseline is one of the study's runs too
            finished(cfg, tracker, baseline_hash(cfg, d.texts.adapt_t))
        for da, _, _ in more:
            finished(da.cfg, tracker, baseline_hash(da.cfg, d.texts.adapt_t))
        if lm_eval:
            _lm_evals(d, done, fit)
        return _summary(done, adapt_done, s.headline_alpha, skipped=True)
    would_run()  # a study's done-check pass (runs.only_if_done) stops here: this direction has work to do
    f = fit()
    results = {a: r if r is not None else _alpha_run(d, f, a, hashes[a]) for a, r in done.items()}
    if s.adapt and adapt_done is None:
        known = results.get(s.adapt.alpha)  # the fused model's NLL, when adapt.alpha is on the grid
        adapt_done = adapt_direction(d, f, adapt_hash, known.metrics.get("nll_target_lang") if known is not None else None)
    for da, h, r in more:  # the same plans, the fused model adapted at each further alpha
        if r is None:
            known = results.get(da.s.adapt.alpha)
            adapt_direction(da, f, h, known.metrics.get("nll_target_lang") if known is not None else None)
    if lm_eval:
        _lm_evals(d, results, fit)
    return _summary(results, adapt_done, s.headline_alpha, skipped=False)


def _more_adaptations(d: Direction, tracker: Tracker, reads: list[Any]) -> list[tuple[Direction, str, JobResult | None]]:
    """``merge.adapt.more_alphas``: per further alpha, the direction as that adaptation's own job sees it (its config
    with ``merge.adapt.alpha`` set, identified exactly as a job run with that alpha alone), its hash and its finished
    run (None: to run)."""
    if d.s.adapt is None or not d.s.adapt.more_alphas:
        return []
    out = []
    for a in d.s.adapt.more_alphas:
        cfg_a = at_adapt_alpha(d.cfg, a)
        s_a = dataclasses.replace(d.s, adapt=dataclasses.replace(d.s.adapt, alpha=a, more_alphas=()))
        da = Direction(cfg_a, s_a, [*(d.overrides or []), f"merge.adapt.alpha={a:g}"], d.target, d.donor, d.texts)
        h = job_hash("transport_adapt", cfg_a, TRANSPORT_KEYS, reads, adapt_controls=ADAPT_CONTROLS)
        out.append((da, h, finished(cfg_a, tracker, h)))
    return out


def _selected_cfg(cfg: DictConfig) -> DictConfig:
    """The run config of a direction tested at its selected alpha: the whole grid (what the choice is made over), no
    adaptation (its own run)."""
    c = plain_copy(cfg)
    with open_dict(c):
        c.merge.headline_alpha = None
        c.merge.adapt = {"enabled": False}
    return c


def select_alpha(base: Scores, curve: dict[float, Scores]) -> float:
    """The alpha of the grid whose OT fusion has the lowest NLL on the selection split, the first token apart (the
    smaller alpha on a tie); chosen before any evaluation sentence is scored."""
    return min(curve, key=lambda a: (curve[a].rest().nats_per_token, a))


def _run_selected(d: Direction, tracker: Tracker, reads: list[Any], saving: dict, fit, adapt_hash, adapt_done) -> JobResult:
    """``merge.test_at=selected``: ONE run per direction. The OT fusion at every alpha of the grid is scored on the
    selection split alone (``select_curve_nll[_rest]_at_<alpha>``); the alpha with the lowest NLL there (first token
    apart) is the run's alpha and headline, and only it is scored on the evaluation sentences, with the random-plan
    control over every seed and the shrink-only control, as an alpha run of ``test_at=every`` is."""
    cfg, s = d.cfg, d.s
    run_cfg = _selected_cfg(cfg)
    h = job_hash("transport", run_cfg, TRANSPORT_KEYS, reads, **saving, test_at="selected")
    done = finished(cfg, tracker, h)
    if done is not None and (s.adapt is None or adapt_done is not None):
        if s.adapt is not None:
            finished(cfg, tracker, baseline_hash(cfg, d.texts.adapt_t))
        return _summary({float(done.metrics.get("alpha", math.nan)): done}, adapt_done, float(done.metrics.get("alpha", math.nan)),
                        skipped=True)
    would_run()
    f = fit()
    if done is None:
        curve: dict[float, Scores] = {}
        for a in s.alphas:
            f.host.set(f.fusion.weights(a, control=False))
            curve[a] = f.host.scores(d.texts.select_t, f"fused a={a:g} selection split")
        f.host.set(f.fusion.original)
        chosen = select_alpha(f.base_scores["select"], curve)
        extra = {"alpha_selected": chosen, "n_grid": float(len(curve))}
        for a, sc in curve.items():
            extra[f"select_curve_nll_at_{a:g}"] = sc.nats_per_token
            extra[f"select_curve_nll_rest_at_{a:g}"] = sc.rest().nats_per_token
        done = _alpha_run(d, f, chosen, h, run_cfg=run_cfg, extra=extra, known_select=curve[chosen])
    if s.adapt and adapt_done is None:
        adapt_done = adapt_direction(d, f, adapt_hash, None)
    return _summary({float(done.metrics["alpha"]): done}, adapt_done, float(done.metrics["alpha"]), skipped=False)


def _lm_evals(d: Direction, results: dict[float, JobResult], fit) -> None:
    """``eval=lm_eval``: each alpha's fused target scored by lm-evaluation-harness in memory on both languages, one
    kind=eval run (route=transport) tagged ``merge_run`` = that alpha's transport run; its identity is that run's. The
    plans are fitted only when an eval has to run (a reused transport run and its eval fit nothing)."""
    from mergescope.scoring.eval_run import run_lm_eval

    refs = [models.resolve(d.target), models.resolve(d.donor)]
    langs = list(dict.fromkeys([str(d.target.lang), str(d.donor.lang)]))
    for a, r in sorted(results.items()):
        def merged(a=a):
            f = fit()
            f.host.set(f.fusion.weights(a, control=False))
            return f.host.model, f.host.tok

        tags = {k: v for k, v in d.tags("eval", alpha=a).items() if k not in ("kind", "seed")}
        tags["route"] = "transport"
        run_lm_eval(_alpha_cfg(d.cfg, a), merged, langs, r, d.overrides, refs, tags,
                           restore=lambda: fit().host.set(fit().fusion.original))


def _fit(d: Direction) -> Fitted:
    """Probe the donor (cached) and let it go, then load and probe the target, fit every plan once, fuse from the
    donor's weights streamed tensor by tensor from its files, and measure the unfused target. The two models are
    never in memory together (a 1B direction held both in float32: 11 GiB before its own tensors); where the donor
    cannot be streamed (no safetensors names to serve every tensor) its loaded state dict is kept as before."""
    from mergescope.stream import streamed_state

    cfg, s, progress = d.cfg, d.s, bool(d.cfg.progress)
    dtype_d = models.merge_dtype(d.donor.get("dtype"))
    donor = models.load(d.donor, cfg.device, dtype=dtype_d)
    d_ad = itf.adapter_for(donor.true_config["model_type"])
    if s.released is not None:
        d_lay = rel.layout(donor.model, donor.true_config["model_type"])
        dp = _released_probe(cfg, s, donor, d.texts.probe_d, str(d.donor.lang), d_lay)
    else:
        dp = probe_cached(cfg, donor, d.texts.probe_d, str(d.donor.lang), d_ad)
    donor_true = donor.true_config
    streamed = None if donor.ref.gguf_file else streamed_state(donor.ref, dtype_d, model=donor.model,
                                                               cache_root=cfg.paths.get("cache"))
    donor_sd = streamed[0] if streamed is not None else {k: v.detach() for k, v in donor.model.state_dict().items()}
    del donor, streamed
    host = Host(cfg, d.target)
    t_ad = itf.adapter_for(host.true["model_type"])
    if s.released is not None:
        t_lay = rel.layout(host.model, host.true["model_type"])
        tp = _released_probe(cfg, s, host.lm, d.texts.probe_t, str(d.target.lang), t_lay)
        console.print(f"[bold]transport[/] {d.label}: fitting the released method's plans ({s.variant()}) on "
                      f"{len(d.texts.probe_t)} probe sentences")
        rf = rel.fit(host.model, donor_sd, tp, dp, t_lay, d_lay, s, progress=progress)
        del donor_sd
        fusion = rf.fusion
        layer_table = {"weights": {k: v.round(6).tolist() for k, v in rf.weights.items()},
                       "layer_costs": {k: v.round(6).tolist() for k, v in rf.layer_costs.items()}}
        w = next(iter(rf.weights.values()))
        stats = {**_plan_stats(rf.infos, fusion, _layer_diagonal(w, w)),
                 **{f"top_k_effective.{x}": float(min(s.top_k, rel.view(tp, t_lay, t_lay.modules[x].post, 0).shape[1]))
                    for x in rel.SUBLAYER_ROLES[s.released.sublayers] if x in t_lay.modules}}
    else:
        tp = probe_cached(cfg, host.lm, d.texts.probe_t, str(d.target.lang), t_ad)
        console.print(f"[bold]transport[/] {d.label}: fitting plans on {len(d.texts.probe_t)} probe sentences")
        align = fus.align_layers(tp, dp, s, progress=progress)
        fusion = fus.fuse(host.model, donor_sd, tp, dp, t_ad, d_ad, align, s, progress=progress)
        del donor_sd
        layer_table = {"kept": align.kept.round(6).tolist(), "plan": align.plan.round(6).tolist(),
                       "cost_pre": align.cost_pre.round(6).tolist(), "cost_post": align.cost_post.round(6).tolist()}
        stats = {**_plan_stats([*align.infos, *fusion.infos], fusion, layer_diagonal(align)), **top_k_effective(tp, s.top_k, d.label)}
    base = {"target_lang": host.scores(d.eval_t, "nll target"), "donor_lang": host.scores(d.eval_d, "nll donor lang")}
    if d.texts.select_t:
        base["select"] = host.scores(d.texts.select_t, "nll target (alpha selection)")
    return Fitted(host, donor_true, fusion, stats, layer_table, base["target_lang"].nats_per_token,
                   base["donor_lang"].nats_per_token, len(d.texts.probe_t),
                   base["select"].nats_per_token if "select" in base else None, base, eval_documents(d))


def eval_documents(d: Direction) -> dict[str, tuple[list[str] | None, str]]:
    """The documents (FLORES articles) of the evaluation sentences of both languages, what a paired interval resamples;
    the selection split's are those of the probe split's lines after the probes."""
    n = len(d.eval_t)
    out = {"target_lang": documents(d.cfg.data, str(d.target.lang), n),
           "donor_lang": documents(d.cfg.data, str(d.donor.lang), n)}
    if d.texts.select_t:
        out["select"] = documents(probe_data(d.cfg, d.s), str(d.target.lang), len(d.texts.select_t),
                                      d.texts.select_start)
    return out


def _released_probe(cfg: DictConfig, s: TransportSettings, lm: models.LoadedModel, sentences: tuple[str, ...], lang: str,
                    lay: rel.Layout) -> fus.Probe:
    """The released method's probe: the sites its modules read, pooled as ``merge.released.pooling`` says (cached
    apart from mergescope's probes: the sites and the pooling are in the key)."""
    ad = lay.adapter(rel.SUBLAYER_ROLES[s.released.sublayers])
    skip = s.released.pooling == "skip_leading_special"
    extra = {"sites": sorted(f"{k}={p}:{side}" for k, (p, side) in ad.sites.items()), "skip_special": skip}
    if s.released.probe_dtype == "bfloat16":  # the released probes: a bfloat16 copy run and pooled in bfloat16
        native = precision.bf16_native(str(cfg.get("device") or "cpu"))
        lm16 = dataclasses.replace(lm, model=precision.bfloat16_copy(lm.model, native))
        try:
            return probe_cached(cfg, lm16, sentences, lang, ad, skip_leading_special=skip,
                                 extra={**extra, "pool": "bfloat16" if native else "bfloat16-emulated"},
                                 pool_dtype=torch.bfloat16)
        finally:
            del lm16
    return probe_cached(cfg, lm, sentences, lang, ad, skip_leading_special=skip, extra=extra)


def top_k_effective(tp: fus.Probe, top_k: int, label: str) -> dict[str, float]:
    """The number of target neurons actually fused per interface: merge.top_k, clamped to the interface's width
    (the default 128 is wider than the zoo's hidden size); a line is printed when it is clamped."""
    widths = {iface: int(mags[0].shape[0]) for iface, mags in tp.magnitude.items()}
    out = {f"top_k_effective.{iface}": float(min(top_k, w)) for iface, w in widths.items()}
    clamped = sorted(i for i, w in widths.items() if w < top_k)
    said = (top_k, tuple((i, widths[i]) for i in clamped))
    if clamped and said not in _CLAMP_SAID:  # once per process and width set, not once per direction and alpha
        _CLAMP_SAID.add(said)
        console.print(f"  {label}: merge.top_k={top_k} is wider than {', '.join(f'{i} ({widths[i]})' for i in clamped)}; "
                      "every neuron of those interfaces is fused (logged as top_k_effective.<interface>; said once)")
    return out


_CLAMP_SAID: set = set()


def _plan_stats(infos: list, fusion: fus.Fusion, layer_diag: dict[str, float]) -> dict[str, float]:
    """Plan diagnostics and the transported term's size (the same in every alpha's run); says so when plans needed
    the log-domain solver."""
    fallbacks = sum(1 for i in infos if i.solver not in ("sinkhorn", "released_sinkhorn", "ot.batch"))
    if fallbacks:
        console.print(f"[yellow]{fallbacks} of {len(infos)} plans needed the log-domain Sinkhorn "
                      "(plain Sinkhorn did not meet the marginals); those plans are the log-domain solver's[/]")
    diag = fusion.diagnostics
    return {
        "plan_row_max": diag.get("row_max", math.nan),
        "plan_uniform_row_max": diag.get("uniform_row_max", math.nan),
        "plan_entropy": diag.get("row_entropy", math.nan),
        "plan_cost_ratio": diag.get("cost_ratio", math.nan),
        "plan_max_marginal_error": max(i.marginal_error for i in infos),
        "plan_log_domain_fallbacks": float(fallbacks),
        "plan_uniform_entropy": diag.get("uniform_entropy", math.nan),
        "plan_entropy_gap": diag.get("entropy_gap", math.nan),
        "plan_rowmax_over_uniform": diag.get("rowmax_over_uniform", math.nan),
        **({"scale_match_ratio": diag["scale_match_ratio"]} if "scale_match_ratio" in diag else {}),
        **fusion.transported_stats(),
        "n_plans": float(len(infos)),
        "n_fused_tensors": float(len(fusion.original)),
        "fused_params": float(sum(w.numel() for w in fusion.original.values())),
        "masked_params": float(sum(int(fusion.masks[n].sum()) * (w.numel() // len(fusion.masks[n])) for n, w in fusion.original.items())),
        **{f"plan_{k}": v for k, v in diag.items() if k.split("_")[0] in ("row", "cost", "diagonal", "control", "chance",
                                                                         "rowmax", "entropy", "uniform")},
        **layer_diag,
    }


def layer_diagonal(align: fus.LayerAlignment) -> dict[str, float]:
    """Two models of one depth: the share of target layers whose P_eff row maximum is the same layer
    (``plan_layer_diagonal_share``; 1/L = chance) and whose kept donor layers include it (``plan_layer_diagonal_kept``)."""
    return _layer_diagonal(align.plan, align.kept)


def _layer_diagonal(P, kept) -> dict[str, float]:
    P, kept = np.asarray(P), np.asarray(kept)
    if P.shape[0] != P.shape[1]:
        return {}
    idx = np.arange(P.shape[0])
    return {"plan_layer_diagonal_share": float(np.mean(P.argmax(1) == idx)),
            "plan_layer_diagonal_kept": float(np.mean(kept[idx, idx] > 0)), "plan_layer_chance": 1.0 / P.shape[0]}


def _alpha_run(d: Direction, f: Fitted, a: float, h: str, run_cfg: DictConfig | None = None, extra: dict | None = None,
               known_select: Scores | None = None) -> JobResult:
    """One alpha's run: the fused target and the random-plan control, each on both languages, with the fused
    tensors' weight-space distance to the target's originals (aggregate metrics, per tensor as an artifact). A direction
    tested at its selected alpha passes its run config (the grid), the selection curve (``extra``) and the chosen
    alpha's selection-split scores (``known_select``: not scored twice)."""
    host = f.host

    def body(job: Job) -> dict[str, float]:
        base = f.base_scores
        values = {"alpha": a, **(extra or {}), **_named(base["target_lang"], "base_", "target_lang"),
                  **_named(base["donor_lang"], "base_", "donor_lang")}
        per_tensor = {}
        sc: dict[tuple[str, str], Scores] = {("base", k): v for k, v in base.items()}
        # the OT plan, the random-plan control, and the shrink-only control (the same alpha and mask, T = 0)
        for ctl, shrink, prefix in ((False, False, ""), (True, False, "rand_"), (False, True, "shrink_")):
            host.set(f.fusion.weights(a, control=ctl, shrink=shrink))
            arm = prefix.rstrip("_") or "ot"
            for lang, sents, what in (("target_lang", d.eval_t, "target"), ("donor_lang", d.eval_d, "donor lang")):
                sc[(arm, lang)] = host.scores(sents, f"{prefix}fused a={a:g} {what}")
                values.update(_named(sc[(arm, lang)], prefix, lang))
            if not prefix and d.texts.select_t:  # the alpha-selection split: the OT fusion only (what is chosen)
                sc[("ot", "select")] = known_select or host.scores(d.texts.select_t, f"fused a={a:g} selection split")
                values["select_nll_target_lang"] = sc[("ot", "select")].nats_per_token
                values["select_nll_rest_target_lang"] = sc[("ot", "select")].rest().nats_per_token
            agg, per_tensor[arm] = f.fusion.weight_stats(a, control=ctl, shrink=shrink)
            values.update({f"{prefix}{k}": v for k, v in agg.items()})
        values.update(_more_controls(d, f, a, sc))
        if d.cfg.get("save"):  # the fused target (not the control) under paths.merged/<run id>/
            from mergescope.transport.save import save_transport

            host.set(f.fusion.weights(a, control=False))
            job.log_params({"saved_to": save_transport(d.cfg, host.model, host.tok, job.run_id, d.label, a)})
        host.set(f.fusion.original)
        values.update(alpha_comparisons(sc, f.docs))  # every difference with its paired interval, by article
        for lang in ("target_lang", "donor_lang"):
            docs = f.docs[lang][0]
            values[f"first_token_nll_{lang}"] = float(base[lang].first_nll.mean())
            values[f"eval_groups_{lang}"] = float(len(set(docs)) if docs is not None else len(sc[("base", lang)].nll))
        job.log_text(sentence_csv(sc, {k: v[0] for k, v in f.docs.items()}), "scores/sentences.csv")
        job.log_params({"eval_resampled": f.docs["target_lang"][1]})
        values.update(f.plan_stats)
        values.update({"n_probe": float(f.n_probe), "n_eval_target": float(len(d.eval_t)), "n_eval_donor": float(len(d.eval_d))})
        if d.texts.select_t:
            values.update({"select_base_nll_target_lang": f.base_select, "n_select": float(len(d.texts.select_t))})
        job.log_params({"model_target.true": host.true, "model_donor.true": f.donor_true, **d.texts.ranges})
        job.log_text(json.dumps(f.layer_table, indent=1), "transport/layer_alignment.json")
        job.log_text(json.dumps(per_tensor, indent=1), "transport/fused_weights.json")
        return values

    selected = {"test_at": "selected"} if run_cfg is not None else {}
    tags = d.tags("transport", alpha=a, headline_alpha=a if selected else d.s.headline_alpha, **selected)
    r = run_once(run_cfg if run_cfg is not None else _alpha_cfg(d.cfg, a), JobSpec(f"transport a={a:g} {d.label}", tags, keys=TRANSPORT_KEYS, cfg_hash=h), body, d.overrides)
    v = r.metrics
    console.print(f"  {d.label} alpha={a:g}: delta target {v['delta_target_lang']:+.4f} "
                  f"(random plan {v['rand_delta_target_lang']:+.4f}, shrink only {v.get('shrink_delta_target_lang', math.nan):+.4f}), "
                  f"donor lang {v['delta_donor_lang']:+.4f}")
    return r


def _more_controls(d: Direction, f: Fitted, a: float, sc: dict[tuple[str, str], Scores]) -> dict[str, float]:
    """The random-plan control's other seeds (``merge.control_seeds``: arms ``rand1``, ``rand2``, ... in ``sc``), and
    the control's numbers as the mean over every seed (``rand_nll_*``) with the spread between seeds (``_sd``)."""
    host, out = f.host, {}
    for s in range(1, f.fusion.n_controls):
        host.set(f.fusion.weights(a, control=True, seed=s))
        for lang, sents in (("target_lang", d.eval_t), ("donor_lang", d.eval_d)):
            sc[(f"rand{s}", lang)] = host.scores(sents, f"rand_fused seed {s + 1} a={a:g} {lang}")
    for lang in ("target_lang", "donor_lang"):
        seeds = _rand_arms(sc, lang)
        out[f"rand_nll_seed0_{lang}"] = seeds[0].nats_per_token  # the seed the adapted control is made from
        for key, scope in (("rand_nll", "all"), ("rand_nll_rest", "rest")):
            vals = np.array([x.scope(scope).nats_per_token for x in seeds])
            out[f"{key}_{lang}"] = float(vals.mean())
            out[f"{key}_sd_{lang}"] = float(vals.std(ddof=1)) if len(vals) > 1 else 0.0
    out["control_seeds"] = float(f.fusion.n_controls)
    return out


def _rand_arms(sc: dict[tuple[str, str], Scores], lang: str) -> list[Scores]:
    """Every random-plan control seed's scores on ``lang`` (arms ``rand``, ``rand1``, ...), seed 0 first."""
    return seeds_of(sc, "rand", lang)


def _named(scores: Scores, prefix: str, lang: str) -> dict[str, float]:
    """``<prefix>nll_<lang>``, ``<prefix>nll_rest_<lang>`` and their bits per byte (the first token's cost is logged
    once per language, from the unfused target)."""
    return {f"{prefix}{k}_{lang}": v for k, v in scores.summary().items() if k != "first_token_nll"}


def _summary(results: dict[float, JobResult], adapt: JobResult | None, headline: float, skipped: bool) -> JobResult:
    """Per-alpha deltas (every alpha) and the headline alpha's; with a single alpha, that run's every metric
    (what reproduce compares)."""
    values = dict(next(iter(results.values())).metrics) if len(results) == 1 else {"headline_alpha": headline}
    for a, r in sorted(results.items()):
        for k in ("delta_target_lang", "delta_donor_lang", "ot_minus_rand_target_lang", "ot_minus_rand_donor_lang",
                  "ot_minus_shrink_target_lang", "ot_minus_shrink_donor_lang"):
            if k in r.metrics:
                values[f"{k}@{a:g}"] = r.metrics[k]
    if adapt is not None:
        for k in ("fusion_effect_after_adapt", "rand_fusion_effect_after_adapt"):
            if k in adapt.metrics:
                values[k] = adapt.metrics[k]
    first = next(iter(results.values()))
    return JobResult(first.run_id, skipped, values, first.cfg_hash)
