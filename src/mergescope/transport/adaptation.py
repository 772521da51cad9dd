"""Post-fusion adaptation of a transport direction (``merge.adapt``): the fused model and its random-plan control
fine-tuned (mergescope's residual-frozen adaptation, or the released SFT), against the no-fusion baseline (one run
per target) and, for the released SFT, the baseline under the same damping; one kind=transport_adapt run."""

from __future__ import annotations

import math

import torch

from mergescope.evidence import compare, read_scores, sentence_csv
from mergescope.progress import console
from mergescope.runs import JobResult, JobSpec, model_label, run_once
from mergescope.scoring.bpb import Scores
from mergescope.tracking import Job
from mergescope.transport import finetune as finetune_mod
from mergescope.transport.comparisons import adapt_comparisons
from mergescope.transport.direction import Direction, Fitted, Host
from mergescope.transport.identity import BASELINE_KEYS, TRANSPORT_KEYS, baseline_hash

__all__ = ["adapt_direction", "finetune_host", "adapt_baseline", "adapted_controls"]


def finetune_host(d: Direction, host: Host, job: Job, residual, label: str, metric: str = "train_loss",
              fused: dict[str, tuple[torch.Tensor, bool]] | None = None) -> list[float]:
    """merge.adapt's fine-tuning of the host in place on the adaptation text; the loss curve is logged as ``metric``.
    ``mode=released``: ``residual`` is the transported weight R (the host holds W), trained as the released SFT;
    ``fused``: each fused tensor's mask (what ``merge.adapt.fold=select`` folds)."""
    ad, n = d.s.adapt, int(d.cfg.represent.max_length)
    if ad.mode == "released":
        losses = finetune_mod.finetune_released(host.model, host.tok, d.texts.adapt_t, residual or {}, ad, n,
                                                progress=bool(d.cfg.progress), label=label, fused=fused)
    else:
        losses = finetune_mod.finetune(host.model, host.tok, d.texts.adapt_t, residual, ad, n, progress=bool(d.cfg.progress),
                                       label=label)
    for i, loss in enumerate(losses):
        job.log_metrics({metric: loss}, step=i)
    return losses


def adapt_baseline(d: Direction, host: Host, f: Fitted) -> tuple[JobResult, Scores | None]:
    """The no-fusion baseline: the same fine-tuning of the unfused target (one run per target)."""
    name = model_label(d.target)
    tags = {"kind": "transport_adapt", "route": "transport", "stage": "baseline", "target": name, "donor": "none",
            "direction": f"{name} (no fusion)", "lang_target": d.target.lang, "seed": d.cfg.merge.adapt.seed,
            "adapt_mode": d.s.adapt.mode}

    def body(job: Job) -> dict[str, float]:
        host.set(host.snapshot)
        losses = finetune_host(d, host, job, None, f"adapt baseline {name}")
        kept["after"] = after = host.scores(d.eval_t, "nll baseline adapted")
        job.log_params({"text.adapt": d.texts.ranges["text.adapt"], "text.eval": d.texts.ranges["text.eval"]})
        job.log_text(sentence_csv({("baseline_after", "target_lang"): after}, {"target_lang": f.docs["target_lang"][0]}),
                     "scores/sentences.csv")
        return {"nll_base_before": f.base_t, "nll_baseline_after": after.nats_per_token,
                "nll_rest_baseline_after": after.rest().nats_per_token,
                **compare("delta_adapt", after, f.base_scores["target_lang"], *f.docs["target_lang"]),
                "train_loss_first": losses[0], "train_loss_last": losses[-1], "n_adapt_sentences": float(len(d.texts.adapt_t))}

    kept: dict[str, Scores] = {}
    spec = JobSpec(f"transport-adapt baseline {name}", tags, keys=BASELINE_KEYS, cfg_hash=baseline_hash(d.cfg, d.texts.adapt_t))
    r = run_once(d.cfg, spec, body, d.overrides)
    if "after" not in kept:  # reused: its per-sentence scores from its artifact (none in a run recorded before them)
        kept_after = read_scores(d.cfg, r.run_id, "baseline_after", "target_lang")
        if kept_after is not None:
            kept["after"] = kept_after
    return r, kept.get("after")


def adapt_one(d: Direction, f: Fitted, job: Job, control: bool, before: float | None,
               out: dict[tuple[str, str], Scores], seed: int = 0) -> dict[str, float]:
    """One fused model (OT, or the random-plan control of seed ``seed``) fine-tuned as ``merge.adapt.mode`` says
    (mergescope's: at adapt.alpha, its residual frozen; released: at the training alpha, what ``adapt.freeze`` says
    trains), measured on both languages; the host is restored afterwards. The control's seed 0 logs ``rand_*``
    metrics, seed s > 0 ``rand<s>_*``."""
    host, fusion, a = f.host, f.fusion, d.s.adapt.alpha
    p = "" if not control else "rand_" if seed == 0 else f"rand{seed}_"
    if d.s.adapt.mode == "released":  # (1 - a_t) W + a_t R, R = the transported weight (fusion at alpha 1), W in the host
        at = d.s.adapt.trained_alpha
        host.set(fusion.weights(at, control=control, seed=seed))
        before = before if before is not None and at == a else host.nll(d.eval_t, f"nll {p}fused")
        residual = fusion.weights(1.0, control=control, seed=seed)
        host.set(host.snapshot)
        mask = {n: (fusion.masks[n], n in fusion.by_column) for n in residual}
    else:
        fused = fusion.weights(a, control=control, seed=seed)
        residual = {n: (fused[n] - fusion.original[n]) for n in fused}
        host.set(fused)
        del fused
        before = before if before is not None else host.nll(d.eval_t, f"nll {p}fused")
    losses = finetune_host(d, host, job, residual, f"adapt {p}fused {d.label}", f"{p}train_loss",
                       mask if d.s.adapt.mode == "released" else None)
    after = host.scores(d.eval_t, f"nll {p}fused adapted")
    after_d = host.scores(d.eval_d, f"nll {p}fused adapted, donor lang")
    host.set(host.snapshot)
    out[(p, "target_lang")], out[(p, "donor_lang")] = after, after_d
    return {f"{p}nll_fused_before": before, f"{p}nll_fused_after": after.nats_per_token,
            f"{p}nll_rest_fused_after": after.rest().nats_per_token, f"{p}nll_donor_lang_fused_after": after_d.nats_per_token,
            f"{p}train_loss_first": losses[0], f"{p}train_loss_last": losses[-1]}


def _dampedadapt_baseline(d: Direction, f: Fitted, job: Job, sc: dict[tuple[str, str], Scores]) -> dict[str, float]:
    """The released SFT trains each fused tensor through ``(1 - a) W + a R``: its updates reach the model damped by
    (1 - a), where the plain no-fusion baseline's are not, so "fusion after SFT" against that baseline mixes the
    transported term with the damping. This baseline is trained the same way with R = W0, the target's own weights
    (no fusion, the same damping, the same fold: with ``fold=select`` no row is fused, so the trained weight is kept
    everywhere): ``fusion_effect_vs_damped_after_adapt`` = the fused model minus it, paired
    (:func:`mergescope.transport.comparisons.adapt_comparisons`)."""
    host = f.host
    host.set(host.snapshot)
    own = {n: host.snapshot[n].detach().clone() for n in f.fusion.original}
    none = {n: (torch.zeros_like(f.fusion.masks[n]), n in f.fusion.by_column) for n in own}
    losses = finetune_host(d, host, job, own, f"adapt damped baseline {d.label}", "damped_train_loss", none)
    after = host.scores(d.eval_t, "nll damped baseline adapted")
    host.set(host.snapshot)
    sc[("damped_baseline", "target_lang")] = after
    return {"nll_damped_baseline_after": after.nats_per_token, "nll_rest_damped_baseline_after": after.rest().nats_per_token,
            "damped_train_loss_last": losses[-1]}


ADAPT_CONTROLS = 2
"""In the adaptation run's identity: 2 = the random-plan control adapted over every seed of ``merge.control_seeds``
(a distribution, like the control before adaptation), not its seed 0 alone."""


def adapted_controls(d: Direction, f: Fitted) -> int:
    """How many of the random-plan control's seeds are adapted: every one built (``merge.control_seeds``), or fewer
    where ``merge.adapt.control_seeds`` says (0: the fused model against its no-fusion baseline alone, as a benchmark
    that reads only that gain needs)."""
    cs = d.s.adapt.control_seeds
    return f.fusion.n_controls if cs is None else min(int(cs), f.fusion.n_controls)


def _arm_name(prefix: str) -> str:
    """A fused-then-adapted arm's name in the run's table: ``ot_after``, ``rand_after`` (the control's seed 0),
    ``rand_after1``, ... (its seeds 1, ...), ``damped_baseline_after``."""
    if prefix == "":
        return "ot_after"
    if prefix.startswith("rand") and prefix[4:-1].isdigit():
        return f"rand_after{prefix[4:-1]}"
    return prefix.rstrip("_") + "_after"


def adapt_direction(d: Direction, f: Fitted, h: str, fused_nll: float | None = None) -> JobResult:
    """The fused model (at adapt.alpha) and its random-plan control, each fine-tuned with its transported residual
    frozen, against the no-fusion baseline (the same fine-tuning of the unfused target)."""
    host, a = f.host, d.s.adapt.alpha
    host.snapshot = {k: v.detach().clone() for k, v in host.model.state_dict().items()}
    baseline, base_scores = adapt_baseline(d, host, f)
    host.set(host.snapshot)
    base_after = baseline.metrics["nll_baseline_after"]

    def body(job: Job) -> dict[str, float]:
        sc: dict[tuple[str, str], Scores] = {}
        v = {"alpha": a, "nll_base_before": f.base_t, "base_nll_donor_lang": f.base_d, "nll_baseline_after": base_after,
             **adapt_one(d, f, job, False, fused_nll, sc)}
        n = adapted_controls(d, f)
        for seed in range(n):  # the random-plan control over its seeds, each adapted the same way
            v.update(adapt_one(d, f, job, True, None, sc, seed))
        v["adapt_control_seeds"] = float(n)
        v["fusion_effect_before_adapt"] = v["nll_fused_before"] - f.base_t
        if base_scores is None:  # a baseline run recorded before per-sentence scores: the difference without an interval
            for p in ("", "rand_"):
                v[f"{p}fusion_effect_after_adapt"] = v[f"{p}nll_fused_after"] - base_after
        if d.s.adapt.mode == "released":  # the no-fusion baseline under the fused arm's damping (module doc)
            v.update(_dampedadapt_baseline(d, f, job, sc))
        named = {(_arm_name(p), lang): x for (p, lang), x in sc.items()}
        # every difference with its paired interval (what the report recomputes from the table)
        v.update(adapt_comparisons(named, base_scores, f.base_scores, f.docs))
        job.log_params({"baseline_run": baseline.run_id, **d.texts.ranges})
        job.log_text(sentence_csv(named, {k: val[0] for k, val in f.docs.items()}), "scores/sentences.csv")
        return v

    r = run_once(d.cfg, JobSpec(f"transport-adapt a={a:g} {d.label}", {**d.tags("transport_adapt", stage="fused", alpha=a),
                                                                        "adapt_mode": d.s.adapt.label},
                                keys=TRANSPORT_KEYS, cfg_hash=h), body, d.overrides)
    host.set(host.snapshot)
    m = r.metrics
    console.print(f"  {d.label} adapted (alpha={a:g}): {m['nll_fused_after']:.4f} vs no-fusion baseline {base_after:.4f} "
                  f"(fusion effect {m['fusion_effect_after_adapt']:+.4f}, control {m.get('rand_fusion_effect_after_adapt', math.nan):+.4f})")
    return r
