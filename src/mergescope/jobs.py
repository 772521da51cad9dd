"""The jobs: measure (one metric on one pair), quality (one model's NLL), train (one zoo model).

Each job validates its inputs before an MLflow run exists, skips itself when a FINISHED run
with the same ``cfg_hash`` exists, and otherwise logs exactly one run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from mergescope import data as data_mod
from mergescope import models
from mergescope.config import job_hash
from mergescope.errors import MergescopeError
from mergescope.progress import console
from mergescope.registry import metrics as metric_registry
from mergescope.represent import POOLINGS, ReprCache, ReprKey, embed, token_nll
from mergescope.tracking import Tracker

MEASURE_KEYS = ["pair", "metric", "data", "represent.pooling", "represent.layer", "represent.max_length", "control"]
QUALITY_KEYS = ["model", "data", "represent.max_length"]
TRAIN_KEYS = ["model", "train", "paths.mono"]


@dataclass
class JobResult:
    run_id: str
    skipped: bool
    metrics: dict[str, float]
    cfg_hash: str


def model_label(entry: Any) -> str:
    name = entry.get("name") or Path(str(entry.name_or_path)).name
    return f"{name}@{entry.revision}" if entry.get("revision") else str(name)


def pair_label(cfg: DictConfig) -> str:
    return f"{model_label(cfg.pair.a)}__{model_label(cfg.pair.b)}"


def control_permutation(n: int, seed: int) -> np.ndarray:
    """The shuffled control's reordering of side B: one fixed-seed permutation, shared by every metric."""
    return np.random.default_rng(seed).permutation(n)


def _check_represent(cfg: DictConfig) -> None:
    r = cfg.represent
    if r.pooling not in POOLINGS:
        raise MergescopeError(f"unknown represent.pooling '{r.pooling}': choose one of {', '.join(POOLINGS)}")
    if r.padding_side not in ("left", "right"):
        raise MergescopeError(f"represent.padding_side must be left or right, got '{r.padding_side}'")
    if int(r.max_length) < 512:
        raise MergescopeError(f"represent.max_length={r.max_length} would truncate below 512 tokens; use 512 or more")


def show_true_config(label: str, tc: dict[str, Any]) -> None:
    """One line per loaded model: what its config really says (cards can lie)."""
    console.print(f"[bold]{label}[/] true config: " + ", ".join(f"{k}={v}" for k, v in tc.items()))


def representations(cfg: DictConfig, entry: Any, side: data_mod.Side) -> tuple[np.ndarray, dict[str, Any]]:
    """Pooled representations of one side by one model, from the on-disk cache or a forward pass."""
    ref = models.resolve(entry)
    r = cfg.represent
    key = ReprKey(
        model=models.fingerprint(ref), data=side.digest, lang=side.lang, split=str(cfg.data.split),
        pooling=str(r.pooling), layer=int(r.layer), dtype=str(entry.dtype), max_length=int(r.max_length),
    )
    cache = ReprCache(Path(cfg.paths.cache) / "reprs")
    hit = cache.get(key)
    if hit is not None:
        return hit[0], {**hit[1], "cache": "hit"}
    model = models.load_model(ref, entry.dtype, cfg.device)
    tok = models.load_tokenizer(ref)
    tc = models.true_config(model)
    show_true_config(ref.label, tc)
    X, stats = embed(
        model, tok, side.sentences, pooling=r.pooling, layer=int(r.layer), batch_tokens=r.batch_tokens,
        max_length=int(r.max_length), padding_side=r.padding_side, progress=bool(cfg.progress), label=f"embed {ref.label}",
    )
    meta = {"true_config": tc, **stats}
    cache.put(key, X, meta)
    return X, {**meta, "cache": "miss"}


def _needs_model(cfg: DictConfig, entry: Any, side: data_mod.Side) -> None:
    """Fail before a run starts if a hub model would be needed and cannot be had."""
    ref = models.resolve(entry)
    if not ref.local:
        r = cfg.represent
        key = ReprKey(models.fingerprint(ref), side.digest, side.lang, str(cfg.data.split), str(r.pooling), int(r.layer), str(entry.dtype), int(r.max_length))
        if ReprCache(Path(cfg.paths.cache) / "reprs").get(key) is None:
            models._hub_kwargs(ref)  # raises one line when the hub is unreachable and nothing is cached


def resolve_pair(cfg: DictConfig) -> tuple[models.ModelRef, models.ModelRef]:
    """Both sides' ModelRefs; an error when they are the same model at the same revision."""
    ref_a, ref_b = models.resolve(cfg.pair.a), models.resolve(cfg.pair.b)
    if (ref_a.location, ref_a.revision or "main") == (ref_b.location, ref_b.revision or "main"):
        raise MergescopeError(
            f"pair.a and pair.b are the same model ({ref_a.label}); a pair needs two different models or revisions"
        )
    return ref_a, ref_b


def check_measure(cfg: DictConfig) -> tuple[Any, dict[str, Any], data_mod.Side, data_mod.Side]:
    a, b = cfg.pair.a, cfg.pair.b
    resolve_pair(cfg)
    entry = metric_registry.get(str(cfg.metric.name))
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg.metric, resolve=True).items() if k != "name"}
    kwargs = entry.check_kwargs(kwargs)
    _check_represent(cfg)
    side_a, side_b = data_mod.load_parallel(cfg.data, str(a.lang), str(b.lang))
    _needs_model(cfg, a, side_a)
    _needs_model(cfg, b, side_b)
    return entry, kwargs, side_a, side_b


def _finished(cfg: DictConfig, tracker: Tracker, h: str) -> JobResult | None:
    """The FINISHED run with this cfg_hash, as a skipped result (unless rerun=true)."""
    if cfg.rerun:
        return None
    done = tracker.find_finished(h)
    return None if done is None else JobResult(done.info.run_id, True, dict(done.data.metrics), h)


def _log_true_config(job, prefix: str, meta: dict[str, Any]) -> None:
    if "true_config" in meta:
        job.log_params({f"{prefix}.true": meta["true_config"]})


def run_measure(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    entry, kwargs, side_a, side_b = check_measure(cfg)
    h = job_hash("measure", cfg, MEASURE_KEYS)
    tracker = Tracker(cfg)
    if (done := _finished(cfg, tracker, h)) is not None:
        return done
    a, b = cfg.pair.a, cfg.pair.b
    tags = {
        "kind": "measure", "pair": pair_label(cfg), "model_a": model_label(a), "model_b": model_label(b),
        "lang_a": a.lang, "lang_b": b.lang, "metric": cfg.metric.name, "route": "representation",
        "cfg_hash": h, "seed": cfg.control.seed, "data": cfg.data.name, "split": cfg.data.split,
    }
    with tracker.start(cfg, f"{cfg.metric.name}:{pair_label(cfg)}", tags, overrides) as job:
        Xa, meta_a = representations(cfg, a, side_a)
        Xb, meta_b = representations(cfg, b, side_b)
        _log_true_config(job, "model_a", meta_a)
        _log_true_config(job, "model_b", meta_b)
        perm = control_permutation(Xa.shape[0], int(cfg.control.seed))
        matched = entry.fn(Xa, Xb, device=cfg.device, **kwargs)
        shuffled = entry.fn(Xa, Xb[perm], device=cfg.device, **kwargs)
        values = dict(matched)
        values.update({f"{k}_shuffled": v for k, v in shuffled.items() if not k.endswith("_chance")})
        values.update({"n_sentences": float(Xa.shape[0]), "dim_a": float(Xa.shape[1]), "dim_b": float(Xb.shape[1])})
        job.log_metrics(values)
        job.log_params({"control.permutation_head": perm[:8].tolist(), "cache_a": meta_a["cache"], "cache_b": meta_b["cache"]})
    return JobResult(job.run_id, False, values, h)


def run_quality(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    entry = cfg.get("model")
    if entry is None:
        raise MergescopeError("task=quality needs a model: add model=<name> (see conf/model/) or model=custom model.name_or_path=...")
    ref = models.resolve(entry)
    _check_represent(cfg)
    side = data_mod.load_side(cfg.data, str(entry.lang))
    if not ref.local:
        models._hub_kwargs(ref)
    h = job_hash("quality", cfg, QUALITY_KEYS)
    tracker = Tracker(cfg)
    if (done := _finished(cfg, tracker, h)) is not None:
        return done
    tags = {"kind": "quality", "model": model_label(entry), "lang": entry.lang, "cfg_hash": h,
            "data": cfg.data.name, "split": cfg.data.split, "seed": cfg.seed}
    with tracker.start(cfg, f"quality:{model_label(entry)}", tags, overrides) as job:
        model = models.load_model(ref, entry.dtype, cfg.device)
        tok = models.load_tokenizer(ref)
        tc = models.true_config(model)
        show_true_config(ref.label, tc)
        job.log_params({"model.true": tc})
        res = token_nll(model, tok, side.sentences, batch_tokens=cfg.represent.batch_tokens,
                        max_length=int(cfg.represent.max_length), progress=bool(cfg.progress), label=f"nll {ref.label}")
        values = {"nll": res["nll"], "n_tokens": float(res["n_tokens"]), "n_truncated": float(res["n_truncated"])}
        job.log_metrics(values)
    return JobResult(job.run_id, False, values, h)


def run_train(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    from mergescope import zoo

    entry = cfg.get("model")
    if entry is None or entry.get("zoo") is None:
        raise MergescopeError("task=train needs a zoo model: add model=<zoo-*> (a conf/model/ entry with a zoo: section)")
    out = Path(str(entry.name_or_path)).expanduser().resolve()
    zoo.check_train(OmegaConf.to_container(cfg.train, resolve=True))
    text = Path(str(cfg.paths.mono)) / f"{entry.lang}.txt"
    if not text.is_file():
        raise MergescopeError(f"no training text {text}; run `make data` or set paths.mono=<folder with <lang>.txt>")
    h = job_hash("train", cfg, TRAIN_KEYS)
    tracker = Tracker(cfg)
    if (done := _finished(cfg, tracker, h)) is not None and (out / "main" / "config.json").is_file():
        return done
    tags = {"kind": "train", "model": model_label(entry), "lang": entry.lang, "cfg_hash": h, "seed": cfg.train.seed}
    with tracker.start(cfg, f"train:{model_label(entry)}", tags, overrides) as job:
        summary = zoo.train_model(
            OmegaConf.to_container(entry, resolve=True), OmegaConf.to_container(cfg.train, resolve=True),
            cfg.paths.mono, out, log=job.log_metrics, progress=bool(cfg.progress),
        )
        final = {k: float(summary[k]) for k in ("heldout_nll", "unigram_nll", "unigram_entropy", "n_params", "train_tokens", "seconds", "tokens_per_s") if k in summary}
        job.log_metrics(final)
        job.log_params({"checkpoints": summary.get("checkpoints", [])})
    return JobResult(job.run_id, False, final, h)


JOBS = {"measure": run_measure, "quality": run_quality, "train": run_train}
