"""task=transport: one direction (target <- donor) of transport-based fusion, with its control.

Logged per alpha, one run each (kind=transport, route=transport): NLL of the fused target on its
own language and on the donor's language (with the target's own tokenizer), deltas against the
unfused target, the same through the random-plan control, and plan diagnostics. The plans are
fitted once per direction and reused by every alpha and by the control. Then, when
``merge.adapt.enabled``, the residual-frozen adaptation run (kind=transport_adapt) against its
no-fusion baseline (its own run, one per target, shared by every donor).

Which side is the target: ``merge.target`` = a | b; the other side is the donor.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from mergescope import data as data_mod
from mergescope import models
from mergescope.config import job_hash
from mergescope.errors import MergescopeError
from mergescope.jobs import JobResult, _finished, model_label, resolve_pair, show_true_config
from mergescope.progress import console
from mergescope.represent import token_nll
from mergescope.tracking import Tracker
from mergescope.transport import adapt as adapt_mod
from mergescope.transport import fusion as fus
from mergescope.transport import interfaces as itf

TRANSPORT_KEYS = ["pair", "merge", "data", "native.nll_sentences", "represent.max_length"]
BASELINE_KEYS = ["target", "merge.adapt", "merge.probe_split", "data", "native.nll_sentences", "represent.max_length"]
CONF_DIR = Path(__file__).resolve().parents[3] / "conf"
PROBE_CACHE_VERSION = 1


def transport_cfg(cfg: DictConfig) -> DictConfig:
    """The operator's settings: ``cfg.merge`` when it is the transport operator, else its defaults."""
    m = cfg.get("merge")
    if m is None:
        return OmegaConf.load(CONF_DIR / "merge" / "transport.yaml")
    if str(m.get("name")) != "transport":
        raise MergescopeError(f"task=transport runs the transport operator, but merge={m.get('name')}; "
                              "use merge=transport (or leave merge unset)")
    return m


def check(cfg: DictConfig) -> DictConfig:
    """Every setting validated, and the pair checked, before any run exists. Returns a job config
    with ``merge`` set to the transport settings."""
    m = transport_cfg(cfg)
    eps, leps = m.get("epsilon"), m.get("layer_epsilon")
    for key, v in (("epsilon", eps), ("layer_epsilon", leps)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise MergescopeError(f"merge.{key} must be a positive number (the spec uses 0.01), got {v!r}")
    alphas = list(m.alphas)
    if not alphas or any(not (isinstance(a, (int, float)) and 0 < a <= 1) for a in alphas):
        raise MergescopeError(f"merge.alphas must be a non-empty list of numbers in (0, 1], got {alphas}")
    if str(m.target) not in ("a", "b"):
        raise MergescopeError(f"merge.target must be a or b (the side of the pair that receives the donor's weights), got '{m.target}'")
    for key in ("top_k", "layer_topk", "layer_subsample", "probe_sentences", "max_iter"):
        if int(m[key]) < 1:
            raise MergescopeError(f"merge.{key} must be at least 1, got {m[key]}")
    if int(m.probe_sentences) < 3:
        raise MergescopeError("merge.probe_sentences must be at least 3: correlations need samples")
    if str(m.plan_scale) not in ("row_stochastic", "raw"):
        raise MergescopeError(f"merge.plan_scale must be row_stochastic or raw, got '{m.plan_scale}'")
    if str(m.probe_split) == str(cfg.data.split):
        raise MergescopeError(f"merge.probe_split={m.probe_split} is the evaluation split (data.split); probes must never "
                              "be the sentences the fused model is evaluated on: use merge.probe_split=dev")
    resolve_pair(cfg)
    ca, cb = models.load_config(models.resolve(cfg.pair.a)), models.load_config(models.resolve(cfg.pair.b))
    itf.adapter_for(ca["model_type"]), itf.adapter_for(cb["model_type"])
    if m.qkv:
        why = itf.qkv_blocker(ca["model_type"], cb["model_type"], ca, cb)
        if why:
            raise MergescopeError(f"merge.qkv=true is undefined for this pair: {why}; leave merge.qkv=false")
    job = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(job):
        job.merge = OmegaConf.create(OmegaConf.to_container(m, resolve=True))
    return job


def sides(cfg: DictConfig) -> tuple[Any, Any]:
    """(target entry, donor entry)."""
    return (cfg.pair.a, cfg.pair.b) if str(cfg.merge.target) == "a" else (cfg.pair.b, cfg.pair.a)


def _alpha_cfg(cfg: DictConfig, alpha: float) -> DictConfig:
    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(c):
        c.merge.alphas = [float(alpha)]
        c.merge.adapt = {"enabled": False}
    return c


def _baseline_cfg(cfg: DictConfig) -> DictConfig:
    target, _ = sides(cfg)
    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(c):
        c.target = OmegaConf.create(OmegaConf.to_container(target, resolve=True))
    return c


def _probe_cached(cfg: DictConfig, model, tok, ref, sentences: tuple[str, ...], lang: str, qkv: bool, adapter) -> fus.Probe:
    key = json.dumps({"model": models.fingerprint(ref), "sents": hashlib.sha256("\n".join(sentences).encode()).hexdigest(),
                      "lang": lang, "qkv": bool(qkv), "max_length": int(cfg.represent.max_length), "v": PROBE_CACHE_VERSION},
                     sort_keys=True)
    path = Path(cfg.paths.cache) / "probes" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"
    if path.is_file():
        # onto the model's device: on a GPU every cost matrix and Sinkhorn solve then runs there
        d = torch.load(path, map_location=next(model.parameters()).device, weights_only=True)
        return fus.Probe(d["pooled"], d["magnitude"], int(d["n_layers"]), int(d["n_tokens"]))
    p = fus.probe(model, tok, sentences, adapter, qkv=qkv, batch_tokens=cfg.represent.batch_tokens,
                  max_length=int(cfg.represent.max_length), progress=bool(cfg.progress), label=f"probe {ref.label}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"pooled": {k: [t.cpu() for t in v] for k, v in p.pooled.items()},
                "magnitude": {k: [t.cpu() for t in v] for k, v in p.magnitude.items()},
                "n_layers": p.n_layers, "n_tokens": p.n_tokens}, tmp)
    tmp.replace(path)
    return p


def _eval_sentences(cfg: DictConfig, lang: str) -> tuple[str, ...]:
    side = data_mod.load_side(cfg.data, lang)
    k = cfg.native.get("nll_sentences")
    return side.sentences[: int(k)] if k else side.sentences


def _probe_data(cfg: DictConfig) -> DictConfig:
    """The data config of the probe split (also the adaptation text): every sentence of merge.probe_split."""
    pdata = OmegaConf.create(OmegaConf.to_container(cfg.data, resolve=True))
    with open_dict(pdata):
        pdata.split = str(cfg.merge.probe_split)
        pdata.max_sentences = None
    return pdata


def _probe_sides(cfg: DictConfig, lang_t: str, lang_d: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    pdata = _probe_data(cfg)
    st, sd = data_mod.load_parallel(pdata, lang_t, lang_d)
    k = int(cfg.merge.probe_sentences)
    if len(st.sentences) < k:
        console.print(f"[yellow]probe split {pdata.split} has {len(st.sentences)} sentences; using all of them (merge.probe_sentences={k})[/]")
    return st.sentences[:k], sd.sentences[:k]


class _Host:
    """The target model in memory, with NLL on a language and in-place weight setting."""

    def __init__(self, cfg: DictConfig, entry):
        self.cfg = cfg
        self.ref = models.resolve(entry)
        self.model = models.load_model(self.ref, entry.dtype, cfg.device)
        self.tok = models.load_tokenizer(self.ref)
        self.true = models.true_config(self.model)

    def set(self, weights: dict[str, torch.Tensor]) -> None:
        sd = self.model.state_dict()
        for k, v in weights.items():
            sd[k].copy_(v.to(sd[k].device, sd[k].dtype))

    def nll(self, sentences, label: str) -> float:
        return token_nll(self.model, self.tok, sentences, batch_tokens=self.cfg.represent.batch_tokens,
                         max_length=int(self.cfg.represent.max_length), progress=bool(self.cfg.progress), label=label)["nll"]


def _tags(cfg: DictConfig, h: str, kind: str, **extra) -> dict[str, Any]:
    target, donor = sides(cfg)
    t, d = model_label(target), model_label(donor)
    return {"kind": kind, "route": "transport", "merge": "transport", "target": t, "donor": d, "direction": f"{t} <- {d}",
            "pair": f"{model_label(cfg.pair.a)}__{model_label(cfg.pair.b)}", "model_a": model_label(cfg.pair.a),
            "model_b": model_label(cfg.pair.b), "lang_target": target.lang, "lang_donor": donor.lang, "cfg_hash": h,
            "seed": cfg.merge.control_seed, **extra}


def run_transport(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    cfg = check(cfg)
    target, donor = sides(cfg)
    eval_t, eval_d = _eval_sentences(cfg, str(target.lang)), _eval_sentences(cfg, str(donor.lang))
    probe_t, probe_d = _probe_sides(cfg, str(target.lang), str(donor.lang))
    alphas = [float(a) for a in cfg.merge.alphas]
    tracker = Tracker(cfg)
    hashes = {a: job_hash("transport", _alpha_cfg(cfg, a), TRANSPORT_KEYS) for a in alphas}
    done = {a: _finished(cfg, tracker, h) for a, h in hashes.items()}
    ad = cfg.merge.adapt
    adapt_hash = job_hash("transport_adapt", cfg, TRANSPORT_KEYS) if ad.enabled else None
    adapt_done = _finished(cfg, tracker, adapt_hash) if ad.enabled else None
    label = f"{model_label(target)} <- {model_label(donor)}"
    if all(r is not None for r in done.values()) and (not ad.enabled or adapt_done is not None):
        return _summary(done, adapt_done, skipped=True)

    host = _Host(cfg, target)
    show_true_config(host.ref.label, host.true)
    dref = models.resolve(donor)
    dmodel = models.load_model(dref, donor.dtype, cfg.device)
    dtok = models.load_tokenizer(dref)
    d_true = models.true_config(dmodel)
    show_true_config(dref.label, d_true)
    t_ad, d_ad = itf.adapter_for(host.true["model_type"]), itf.adapter_for(d_true["model_type"])
    m = cfg.merge
    tp = _probe_cached(cfg, host.model, host.tok, host.ref, probe_t, str(target.lang), bool(m.qkv), t_ad)
    dp = _probe_cached(cfg, dmodel, dtok, dref, probe_d, str(donor.lang), bool(m.qkv), d_ad)
    console.print(f"[bold]transport[/] {label}: fitting plans on {len(probe_t)} probe sentences")
    align = fus.align_layers(tp, dp, float(m.epsilon), float(m.layer_epsilon), int(m.layer_topk), int(m.layer_subsample),
                             int(m.max_iter), float(m.marginal_tol), int(m.control_seed), progress=bool(cfg.progress))
    donor_sd = {k: v.detach() for k, v in dmodel.state_dict().items()}
    fusion = fus.fuse(host.model, donor_sd, tp, dp, t_ad, d_ad, align, float(m.epsilon), int(m.top_k), str(m.plan_scale),
                      bool(m.qkv), int(m.max_iter), float(m.marginal_tol), int(m.control_seed), progress=bool(cfg.progress))
    del dmodel, donor_sd
    fallbacks = sum(1 for i in [*align.infos, *fusion.infos] if i.solver != "sinkhorn")
    if fallbacks:
        console.print(f"[yellow]{fallbacks} of {len(align.infos) + len(fusion.infos)} plans needed the log-domain Sinkhorn "
                      "(plain Sinkhorn did not meet the marginals); those plans are the log-domain solver's[/]")
    plan_stats = {
        "plan_row_max": fusion.diagnostics.get("row_max", math.nan),
        "plan_uniform_row_max": fusion.diagnostics.get("uniform_row_max", math.nan),
        "plan_entropy": fusion.diagnostics.get("row_entropy", math.nan),
        "plan_cost_ratio": fusion.diagnostics.get("cost_ratio", math.nan),
        "plan_max_marginal_error": max(i.marginal_error for i in [*align.infos, *fusion.infos]),
        "plan_log_domain_fallbacks": float(fallbacks),
        "n_plans": float(len(align.infos) + len(fusion.infos)),
        "n_fused_tensors": float(len(fusion.original)),
        "fused_params": float(sum(w.numel() for w in fusion.original.values())),
        "masked_params": float(sum(int(fusion.masks[n].sum()) * (w.numel() // w.shape[0]) for n, w in fusion.original.items())),
        **{f"plan_{k}": v for k, v in fusion.diagnostics.items() if k.split("_")[0] in ("row", "cost")},
    }
    base_t, base_d = host.nll(eval_t, "nll target"), host.nll(eval_d, "nll donor lang")
    layer_table = {"kept": align.kept.round(6).tolist(), "plan": align.plan.round(6).tolist(),
                   "cost_pre": align.cost_pre.round(6).tolist(), "cost_post": align.cost_post.round(6).tolist()}
    results = dict(done)
    for a in alphas:
        if done[a] is not None:
            continue
        ac = _alpha_cfg(cfg, a)
        with tracker.start(ac, f"transport:{label}:alpha={a:g}", _tags(cfg, hashes[a], "transport", alpha=a), overrides) as job:
            values = {"alpha": a, "base_nll_target_lang": base_t, "base_nll_donor_lang": base_d}
            for ctl, prefix in ((False, ""), (True, "rand_")):
                host.set(fusion.weights(a, control=ctl))
                values[f"{prefix}nll_target_lang"] = host.nll(eval_t, f"{prefix}fused a={a:g} target")
                values[f"{prefix}nll_donor_lang"] = host.nll(eval_d, f"{prefix}fused a={a:g} donor lang")
            host.set(fusion.original)
            for lang in ("target_lang", "donor_lang"):
                values[f"delta_{lang}"] = values[f"nll_{lang}"] - values[f"base_nll_{lang}"]
                values[f"rand_delta_{lang}"] = values[f"rand_nll_{lang}"] - values[f"base_nll_{lang}"]
                values[f"ot_minus_rand_{lang}"] = values[f"nll_{lang}"] - values[f"rand_nll_{lang}"]
            values.update(plan_stats)
            values.update({"n_probe": float(len(probe_t)), "n_eval_target": float(len(eval_t)), "n_eval_donor": float(len(eval_d))})
            job.log_metrics(values)
            job.log_params({"model_target.true": host.true, "model_donor.true": d_true})
            job.log_text(json.dumps(layer_table, indent=1), "transport/layer_alignment.json")
        console.print(f"  {label} alpha={a:g}: delta target {values['delta_target_lang']:+.4f} "
                      f"(control {values['rand_delta_target_lang']:+.4f}), donor lang {values['delta_donor_lang']:+.4f}")
        results[a] = JobResult(job.run_id, False, values, hashes[a])
    if ad.enabled and adapt_done is None:
        known = results.get(float(ad.alpha))  # the fused model's NLL, when adapt.alpha is on the grid
        adapt_done = _adapt(cfg, overrides, host, fusion, eval_t, adapt_hash, label, base_t,
                            known.metrics.get("nll_target_lang") if known is not None else None)
    return _summary(results, adapt_done, skipped=False)


def _summary(results: dict[float, JobResult], adapt: JobResult | None, skipped: bool) -> JobResult:
    """Per-alpha headline deltas; with a single alpha, that run's every metric (what reproduce compares)."""
    values = dict(next(iter(results.values())).metrics) if len(results) == 1 else {}
    for a, r in sorted(results.items()):
        for k in ("delta_target_lang", "delta_donor_lang", "ot_minus_rand_target_lang", "ot_minus_rand_donor_lang"):
            if k in r.metrics:
                values[f"{k}@{a:g}"] = r.metrics[k]
    if adapt is not None and "fusion_effect_after_adapt" in adapt.metrics:
        values["fusion_effect_after_adapt"] = adapt.metrics["fusion_effect_after_adapt"]
    first = next(iter(results.values()))
    return JobResult(first.run_id, skipped, values, first.cfg_hash)


def _adapt_sentences(cfg: DictConfig, lang: str) -> tuple[str, ...]:
    return data_mod.load_side(_probe_data(cfg), lang).sentences


def _finetune(cfg: DictConfig, host: _Host, residual, sentences, label: str) -> list[float]:
    ad = cfg.merge.adapt
    return adapt_mod.finetune(host.model, host.tok, sentences, residual, int(ad.steps), int(ad.batch_size), float(ad.lr),
                              float(ad.weight_decay), int(ad.seed), int(cfg.represent.max_length), float(ad.grad_clip),
                              progress=bool(cfg.progress), label=label)


def _baseline(cfg: DictConfig, overrides, host: _Host, eval_t, base_t: float) -> JobResult:
    """The no-fusion baseline: the same fine-tuning of the unfused target (one run per target)."""
    bc = _baseline_cfg(cfg)
    h = job_hash("transport_adapt_baseline", bc, BASELINE_KEYS)
    tracker = Tracker(cfg)
    if (done := _finished(cfg, tracker, h)) is not None:
        return done
    target, _ = sides(cfg)
    tags = {"kind": "transport_adapt", "route": "transport", "stage": "baseline", "target": model_label(target),
            "donor": "none", "direction": f"{model_label(target)} (no fusion)", "lang_target": target.lang, "cfg_hash": h,
            "seed": cfg.merge.adapt.seed}
    sents = _adapt_sentences(cfg, str(target.lang))
    with tracker.start(bc, f"adapt-baseline:{model_label(target)}", tags, overrides) as job:
        host.set(host.snapshot)
        losses = _finetune(cfg, host, None, sents, f"adapt baseline {model_label(target)}")
        after = host.nll(eval_t, "nll baseline adapted")
        values = {"nll_base_before": base_t, "nll_baseline_after": after, "delta_adapt": after - base_t,
                  "train_loss_first": losses[0], "train_loss_last": losses[-1], "n_adapt_sentences": float(len(sents))}
        for i, l in enumerate(losses):
            job.log_metrics({"train_loss": l}, step=i)
        job.log_metrics(values)
    return JobResult(job.run_id, False, values, h)


def _adapt(cfg: DictConfig, overrides, host: _Host, fusion: fus.Fusion, eval_t, h: str, label: str, base_t: float,
           fused_nll: float | None = None) -> JobResult:
    ad = cfg.merge.adapt
    a = float(ad.alpha)
    host.snapshot = {k: v.detach().clone() for k, v in host.model.state_dict().items()}
    baseline = _baseline(cfg, overrides, host, eval_t, base_t)
    host.set(host.snapshot)
    tracker = Tracker(cfg)
    with tracker.start(cfg, f"adapt:{label}:alpha={a:g}", _tags(cfg, h, "transport_adapt", stage="fused", alpha=a), overrides) as job:
        fused = fusion.weights(a)
        residual = {n: (fused[n] - fusion.original[n]) for n in fused}
        host.set(fused)
        before = fused_nll if fused_nll is not None else host.nll(eval_t, "nll fused")
        target, _ = sides(cfg)
        losses = _finetune(cfg, host, residual, _adapt_sentences(cfg, str(target.lang)), f"adapt fused {label}")
        after = host.nll(eval_t, "nll fused adapted")
        values = {"alpha": a, "nll_base_before": base_t, "nll_fused_before": before, "nll_fused_after": after,
                  "nll_baseline_after": baseline.metrics["nll_baseline_after"],
                  "fusion_effect_after_adapt": after - baseline.metrics["nll_baseline_after"],
                  "fusion_effect_before_adapt": before - base_t,
                  "train_loss_first": losses[0], "train_loss_last": losses[-1]}
        for i, l in enumerate(losses):
            job.log_metrics({"train_loss": l}, step=i)
        job.log_metrics(values)
        job.log_params({"baseline_run": baseline.run_id})
    host.set(host.snapshot)
    console.print(f"  {label} adapted (alpha={a:g}): {after:.4f} vs no-fusion baseline {values['nll_baseline_after']:.4f} "
                  f"(fusion effect {values['fusion_effect_after_adapt']:+.4f})")
    return JobResult(job.run_id, False, values, h)
