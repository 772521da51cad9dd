"""task=transport: one direction (target <- donor) of transport-based fusion, with its control.

Logged per alpha, one run each (kind=transport, route=transport): NLL of the fused target on its
own language and on the donor's language (with the target's own tokenizer), deltas against the
unfused target, the same through the random-plan control, and plan diagnostics. The plans are
fitted once per direction and reused by every alpha and by the control. Then, when
``merge.adapt.enabled``, the residual-frozen adaptation run (kind=transport_adapt) against its
no-fusion baseline (its own run, one per target, shared by every donor).

Which side is the target: ``merge.target`` = a | b; the other side is the donor. The settings are
validated once (:class:`~mergescope.transport.settings.TransportSettings`) and passed down.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from mergescope import data as data_mod
from mergescope import models
from mergescope.config import hash_parts, job_hash, plain_copy
from mergescope.progress import console
from mergescope.represent import token_nll
from mergescope.runs import JobResult, finished, model_label, pair_label, run_once
from mergescope.tracking import Job, Tracker
from mergescope.transport import adapt as adapt_mod
from mergescope.transport import fusion as fus
from mergescope.transport import interfaces as itf
from mergescope.transport.settings import TransportSettings, merge_node

TRANSPORT_KEYS = ["pair", "merge", "data", "native.nll_sentences", "represent.max_length"]
BASELINE_KEYS = ["merge.adapt", "merge.probe_split", "data", "native.nll_sentences", "represent.max_length"]
"""What the no-fusion baseline's hash reads besides the target's model entry (hashed as ``target``)."""
PROBE_CACHE_VERSION = 1


def check(cfg: DictConfig) -> tuple[DictConfig, TransportSettings]:
    """Every setting and the pair validated before any run exists. Returns the job config (``merge``
    set to the transport settings node, resolved: what the hashes read) and the settings."""
    settings = TransportSettings.from_cfg(cfg)
    job = plain_copy(cfg)
    with open_dict(job):
        job.merge = plain_copy(merge_node(cfg))
    return job, settings


def sides(cfg: DictConfig) -> tuple[Any, Any]:
    """(target entry, donor entry)."""
    return (cfg.pair.a, cfg.pair.b) if str(cfg.merge.target) == "a" else (cfg.pair.b, cfg.pair.a)


def _alpha_cfg(cfg: DictConfig, alpha: float) -> DictConfig:
    """One alpha's run config (logged, and hashed with TRANSPORT_KEYS): that alpha alone, no adaptation."""
    c = plain_copy(cfg)
    with open_dict(c):
        c.merge.alphas = [float(alpha)]
        c.merge.adapt = {"enabled": False}
    return c


def baseline_hash(cfg: DictConfig) -> str:
    """cfg_hash of the no-fusion baseline: the target's model entry and the adaptation's inputs, not the
    donor (one baseline per target, shared by every donor)."""
    target, _ = sides(cfg)
    return hash_parts("transport_adapt_baseline", {"target": target, **{k: OmegaConf.select(cfg, k) for k in BASELINE_KEYS}})


def _probe_cached(cfg: DictConfig, lm: models.LoadedModel, sentences: tuple[str, ...], lang: str, qkv: bool,
                  adapter: itf.Adapter) -> fus.Probe:
    key = json.dumps({"model": models.fingerprint(lm.ref), "sents": hashlib.sha256("\n".join(sentences).encode()).hexdigest(),
                      "lang": lang, "qkv": bool(qkv), "max_length": int(cfg.represent.max_length), "v": PROBE_CACHE_VERSION},
                     sort_keys=True)
    path = Path(cfg.paths.cache) / "probes" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"
    if path.is_file():
        # onto the model's device: on a GPU every cost matrix and Sinkhorn solve then runs there
        d = torch.load(path, map_location=next(lm.model.parameters()).device, weights_only=True)
        return fus.Probe(d["pooled"], d["magnitude"], int(d["n_layers"]), int(d["n_tokens"]))
    p = fus.probe(lm.model, lm.tokenizer, sentences, adapter, qkv=qkv, batch_tokens=cfg.represent.batch_tokens,
                  max_length=int(cfg.represent.max_length), progress=bool(cfg.progress), label=f"probe {lm.ref.label}")
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


def _probe_data(cfg: DictConfig, s: TransportSettings) -> DictConfig:
    """The data config of the probe split (also the adaptation text): every sentence of merge.probe_split."""
    pdata = plain_copy(cfg.data)
    with open_dict(pdata):
        pdata.split = s.probe_split
        pdata.max_sentences = None
    return pdata


def _probe_sides(cfg: DictConfig, s: TransportSettings, lang_t: str, lang_d: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    pdata = _probe_data(cfg, s)
    st, sd = data_mod.load_parallel(pdata, lang_t, lang_d)
    k = s.probe_sentences
    if len(st.sentences) < k:
        console.print(f"[yellow]probe split {pdata.split} has {len(st.sentences)} sentences; using all of them (merge.probe_sentences={k})[/]")
    return st.sentences[:k], sd.sentences[:k]


@dataclass
class _Direction:
    """One direction's job: the job config, its settings and overrides, the two sides, the evaluation sentences."""

    cfg: DictConfig
    s: TransportSettings
    overrides: list[str] | None
    target: Any
    donor: Any
    eval_t: tuple[str, ...]
    eval_d: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{model_label(self.target)} <- {model_label(self.donor)}"

    def tags(self, kind: str, **extra) -> dict[str, Any]:
        t, d = model_label(self.target), model_label(self.donor)
        a, b = self.cfg.pair.a, self.cfg.pair.b
        return {"kind": kind, "route": "transport", "merge": "transport", "target": t, "donor": d, "direction": f"{t} <- {d}",
                "pair": pair_label(self.cfg), "model_a": model_label(a), "model_b": model_label(b),
                "lang_target": self.target.lang, "lang_donor": self.donor.lang, "seed": self.cfg.merge.control_seed, **extra}

    def adapt_sentences(self) -> tuple[str, ...]:
        return data_mod.load_side(_probe_data(self.cfg, self.s), str(self.target.lang)).sentences


class _Host:
    """The target model in memory, with NLL on a language and in-place weight setting."""

    def __init__(self, cfg: DictConfig, entry):
        self.cfg = cfg
        self.lm = models.load(entry, cfg.device)
        self.model, self.tok, self.true = self.lm.model, self.lm.tokenizer, self.lm.true_config
        self.snapshot: dict[str, torch.Tensor] = {}

    def set(self, weights: dict[str, torch.Tensor]) -> None:
        sd = self.model.state_dict()
        for k, v in weights.items():
            sd[k].copy_(v.to(sd[k].device, sd[k].dtype))

    def nll(self, sentences, label: str) -> float:
        return token_nll(self.model, self.tok, sentences, batch_tokens=self.cfg.represent.batch_tokens,
                         max_length=int(self.cfg.represent.max_length), progress=bool(self.cfg.progress), label=label)["nll"]


@dataclass
class _Fitted:
    """What every alpha, the control and the adaptation reuse: the target in memory, the plans, the unfused NLLs."""

    host: _Host
    donor_true: dict[str, Any]
    fusion: fus.Fusion
    plan_stats: dict[str, float]
    layer_table: dict[str, list]
    base_t: float
    base_d: float
    n_probe: int


def run_transport(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    cfg, s = check(cfg)
    target, donor = sides(cfg)
    d = _Direction(cfg, s, overrides, target, donor, _eval_sentences(cfg, str(target.lang)), _eval_sentences(cfg, str(donor.lang)))
    probe_t, probe_d = _probe_sides(cfg, s, str(target.lang), str(donor.lang))
    tracker = Tracker(cfg)
    hashes = {a: job_hash("transport", _alpha_cfg(cfg, a), TRANSPORT_KEYS) for a in s.alphas}
    done = {a: finished(cfg, tracker, h) for a, h in hashes.items()}
    adapt_hash = job_hash("transport_adapt", cfg, TRANSPORT_KEYS) if s.adapt else None
    adapt_done = finished(cfg, tracker, adapt_hash) if adapt_hash else None
    if all(r is not None for r in done.values()) and (s.adapt is None or adapt_done is not None):
        return _summary(done, adapt_done, skipped=True)

    f = _fit(d, probe_t, probe_d)
    results = {a: r if r is not None else _alpha_run(d, f, a, hashes[a]) for a, r in done.items()}
    if s.adapt and adapt_done is None:
        known = results.get(s.adapt.alpha)  # the fused model's NLL, when adapt.alpha is on the grid
        adapt_done = _adapt(d, f, adapt_hash, known.metrics.get("nll_target_lang") if known is not None else None)
    return _summary(results, adapt_done, skipped=False)


def _fit(d: _Direction, probe_t: tuple[str, ...], probe_d: tuple[str, ...]) -> _Fitted:
    """Load both models, probe them (cached), fit every plan once, and measure the unfused target."""
    cfg, s, progress = d.cfg, d.s, bool(d.cfg.progress)
    host = _Host(cfg, d.target)
    donor = models.load(d.donor, cfg.device)
    t_ad, d_ad = itf.adapter_for(host.true["model_type"]), itf.adapter_for(donor.true_config["model_type"])
    tp = _probe_cached(cfg, host.lm, probe_t, str(d.target.lang), s.qkv, t_ad)
    dp = _probe_cached(cfg, donor, probe_d, str(d.donor.lang), s.qkv, d_ad)
    console.print(f"[bold]transport[/] {d.label}: fitting plans on {len(probe_t)} probe sentences")
    align = fus.align_layers(tp, dp, s, progress=progress)
    donor_sd = {k: v.detach() for k, v in donor.model.state_dict().items()}
    fusion = fus.fuse(host.model, donor_sd, tp, dp, t_ad, d_ad, align, s, progress=progress)
    donor_true = donor.true_config
    del donor, donor_sd
    layer_table = {"kept": align.kept.round(6).tolist(), "plan": align.plan.round(6).tolist(),
                   "cost_pre": align.cost_pre.round(6).tolist(), "cost_post": align.cost_post.round(6).tolist()}
    stats = _plan_stats(align, fusion)
    base_t, base_d = host.nll(d.eval_t, "nll target"), host.nll(d.eval_d, "nll donor lang")
    return _Fitted(host, donor_true, fusion, stats, layer_table, base_t, base_d, len(probe_t))


def _plan_stats(align: fus.LayerAlignment, fusion: fus.Fusion) -> dict[str, float]:
    """Plan diagnostics (the same in every alpha's run); says so when plans needed the log-domain solver."""
    infos = [*align.infos, *fusion.infos]
    fallbacks = sum(1 for i in infos if i.solver != "sinkhorn")
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
        "n_plans": float(len(infos)),
        "n_fused_tensors": float(len(fusion.original)),
        "fused_params": float(sum(w.numel() for w in fusion.original.values())),
        "masked_params": float(sum(int(fusion.masks[n].sum()) * (w.numel() // w.shape[0]) for n, w in fusion.original.items())),
        **{f"plan_{k}": v for k, v in diag.items() if k.split("_")[0] in ("row", "cost")},
    }


def _alpha_run(d: _Direction, f: _Fitted, a: float, h: str) -> JobResult:
    """One alpha's run: the fused target and the random-plan control, each on both languages."""
    host = f.host

    def body(job: Job) -> dict[str, float]:
        values = {"alpha": a, "base_nll_target_lang": f.base_t, "base_nll_donor_lang": f.base_d}
        for ctl, prefix in ((False, ""), (True, "rand_")):
            host.set(f.fusion.weights(a, control=ctl))
            values[f"{prefix}nll_target_lang"] = host.nll(d.eval_t, f"{prefix}fused a={a:g} target")
            values[f"{prefix}nll_donor_lang"] = host.nll(d.eval_d, f"{prefix}fused a={a:g} donor lang")
        host.set(f.fusion.original)
        for lang in ("target_lang", "donor_lang"):
            values[f"delta_{lang}"] = values[f"nll_{lang}"] - values[f"base_nll_{lang}"]
            values[f"rand_delta_{lang}"] = values[f"rand_nll_{lang}"] - values[f"base_nll_{lang}"]
            values[f"ot_minus_rand_{lang}"] = values[f"nll_{lang}"] - values[f"rand_nll_{lang}"]
        values.update(f.plan_stats)
        values.update({"n_probe": float(f.n_probe), "n_eval_target": float(len(d.eval_t)), "n_eval_donor": float(len(d.eval_d))})
        job.log_params({"model_target.true": host.true, "model_donor.true": f.donor_true})
        job.log_text(json.dumps(f.layer_table, indent=1), "transport/layer_alignment.json")
        return values

    r = run_once(_alpha_cfg(d.cfg, a), f"transport:{d.label}:alpha={a:g}", d.tags("transport", alpha=a), d.overrides, body,
                 cfg_hash=h)
    v = r.metrics
    console.print(f"  {d.label} alpha={a:g}: delta target {v['delta_target_lang']:+.4f} "
                  f"(control {v['rand_delta_target_lang']:+.4f}), donor lang {v['delta_donor_lang']:+.4f}")
    return r


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


def _finetune(d: _Direction, host: _Host, job: Job, residual, sentences, label: str) -> list[float]:
    """merge.adapt's fine-tuning of the host in place; the training-loss curve is logged as ``train_loss``."""
    losses = adapt_mod.finetune(host.model, host.tok, sentences, residual, d.s.adapt, int(d.cfg.represent.max_length),
                                progress=bool(d.cfg.progress), label=label)
    for i, loss in enumerate(losses):
        job.log_metrics({"train_loss": loss}, step=i)
    return losses


def _baseline(d: _Direction, host: _Host, base_t: float) -> JobResult:
    """The no-fusion baseline: the same fine-tuning of the unfused target (one run per target)."""
    name = model_label(d.target)
    tags = {"kind": "transport_adapt", "route": "transport", "stage": "baseline", "target": name, "donor": "none",
            "direction": f"{name} (no fusion)", "lang_target": d.target.lang, "seed": d.cfg.merge.adapt.seed}

    def body(job: Job) -> dict[str, float]:
        sents = d.adapt_sentences()
        host.set(host.snapshot)
        losses = _finetune(d, host, job, None, sents, f"adapt baseline {name}")
        after = host.nll(d.eval_t, "nll baseline adapted")
        return {"nll_base_before": base_t, "nll_baseline_after": after, "delta_adapt": after - base_t,
                "train_loss_first": losses[0], "train_loss_last": losses[-1], "n_adapt_sentences": float(len(sents))}

    return run_once(d.cfg, f"adapt-baseline:{name}", tags, d.overrides, body, cfg_hash=baseline_hash(d.cfg))


def _adapt(d: _Direction, f: _Fitted, h: str, fused_nll: float | None = None) -> JobResult:
    """The fused model (at adapt.alpha) fine-tuned with its transported residual frozen, against the baseline."""
    host, fusion, a = f.host, f.fusion, d.s.adapt.alpha
    host.snapshot = {k: v.detach().clone() for k, v in host.model.state_dict().items()}
    baseline = _baseline(d, host, f.base_t)
    host.set(host.snapshot)
    base_after = baseline.metrics["nll_baseline_after"]

    def body(job: Job) -> dict[str, float]:
        fused = fusion.weights(a)
        residual = {n: (fused[n] - fusion.original[n]) for n in fused}
        host.set(fused)
        before = fused_nll if fused_nll is not None else host.nll(d.eval_t, "nll fused")
        losses = _finetune(d, host, job, residual, d.adapt_sentences(), f"adapt fused {d.label}")
        after = host.nll(d.eval_t, "nll fused adapted")
        job.log_params({"baseline_run": baseline.run_id})
        return {"alpha": a, "nll_base_before": f.base_t, "nll_fused_before": before, "nll_fused_after": after,
                "nll_baseline_after": base_after, "fusion_effect_after_adapt": after - base_after,
                "fusion_effect_before_adapt": before - f.base_t,
                "train_loss_first": losses[0], "train_loss_last": losses[-1]}

    r = run_once(d.cfg, f"adapt:{d.label}:alpha={a:g}", d.tags("transport_adapt", stage="fused", alpha=a), d.overrides, body,
                 cfg_hash=h)
    host.set(host.snapshot)
    console.print(f"  {d.label} adapted (alpha={a:g}): {r.metrics['nll_fused_after']:.4f} vs no-fusion baseline "
                  f"{base_after:.4f} (fusion effect {r.metrics['fusion_effect_after_adapt']:+.4f})")
    return r
