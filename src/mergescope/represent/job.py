"""The representation arm's jobs: measure (one metric on one pair, with its shuffled control) and
quality (one model's mean per-token NLL on its own side of the data).

Each validates its inputs before an MLflow run exists, then runs through :func:`runs.run_once`.
"""

from __future__ import annotations

import dataclasses

import zlib
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from mergescope import precision
from mergescope import data as data_mod
from mergescope import models
from mergescope.scoring.bpb import token_nll
from mergescope.errors import MergescopeError
from mergescope.registry import metrics as metric_registry
from mergescope.represent.cache import ReprCache, ReprKey, cache_enabled, representation_problem
from mergescope.represent import one_forward
from mergescope.represent.forward import POOLINGS, embed
from mergescope.represent.layers import LayersKey, embed_layers
from mergescope.runs import JobResult, JobSpec, finite_or_fail, model_label, pair_label, pair_tags, pair_text, run_once

MEASURE_KEYS = ["pair", "metric", "data", "represent.pooling", "represent.layer", "represent.max_length",
                "represent.padding_side", "control"]
QUALITY_KEYS = ["model", "data", "represent.max_length"]


def control_permutations(n: int, seed: int, pair: str, seeds: int = 1) -> list[np.ndarray]:
    """The shuffled control's reorderings of side B: one per replication seed ``seed + i``, drawn from that
    seed and the pair (a stable CRC of its label), so every metric of a pair sees the same permutations
    and different pairs see different ones."""
    key = zlib.crc32(pair.encode("utf-8"))
    return [np.random.default_rng([seed + i, key]).permutation(n) for i in range(seeds)]


def shuffled_values(fn, Xa: np.ndarray, Xb: np.ndarray, perms: list[np.ndarray], job, **kwargs) -> dict[str, float]:
    """The metric on side B reordered by each permutation: ``<key>_shuffled`` is the mean over the seeds,
    ``<key>_shuffled_sd`` their standard deviation (ddof=1; 0 with one seed); each seed's value is a metric step."""
    per_seed: dict[str, list[float]] = {}
    for i, perm in enumerate(perms):
        vals = {f"{k}_shuffled": float(v) for k, v in fn(Xa, Xb[perm], **kwargs).items() if not k.endswith("_chance")}
        job.log_metrics({f"{k}_by_seed": v for k, v in vals.items()}, step=i)
        for k, v in vals.items():
            per_seed.setdefault(k, []).append(v)
    out = {}
    for k, vs in per_seed.items():
        a = np.asarray(vs, dtype=np.float64)
        out[k] = float(a.mean())
        out[f"{k}_sd"] = float(a.std(ddof=1)) if a.size > 1 else 0.0
    return out


def calibrated_values(entry, Xa: np.ndarray, Xb: np.ndarray, cfg: DictConfig, kwargs: dict[str, Any]) -> dict[str, float]:
    """The metric's headline calibrated against its permutation null (:mod:`mergescope.metrics.calibrate`):
    ``control.calibration_permutations`` draws (0: not calibrated) seeded by the control seed and the pair, so every
    metric of a pair sees the same permutations; ``<headline>_calibrated``, ``_cal_p``, ``_cal_tau``."""
    from mergescope.metrics.calibrate import calibrate, permutation_seed

    k = int(cfg.control.get("calibration_permutations", 0) or 0)
    if k <= 0:
        return {}
    key = entry.headline
    sim = lambda x, y: entry.fn(x, y, device=cfg.device, **kwargs)[key]  # noqa: E731
    fast = entry.meta.get("null")
    null = (lambda x, y, perms: fast(x, y, perms, device=cfg.device, **kwargs)) if fast is not None else None  # noqa: E731
    cal = calibrate(Xa, Xb, sim, K=k, alpha=float(cfg.control.get("calibration_alpha", 0.05)), smax=1.0,
                    seed=permutation_seed(int(cfg.control.seed), pair_label(cfg)), null=null)
    return {**cal.metrics(key), "calibration_permutations": float(k)}


def check_represent(cfg: DictConfig) -> None:
    if int(cfg.control.get("seeds", 1)) < 1:
        raise MergescopeError(f"control.seeds must be at least 1 (replications of the shuffled control), got {cfg.control.seeds}")
    k, a = cfg.control.get("calibration_permutations", 0), cfg.control.get("calibration_alpha", 0.05)
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise MergescopeError(f"control.calibration_permutations={k}: give a whole number >= 0 (0 = no calibration; 200 is the "
                              "method's default)")
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < float(a) < 1:
        raise MergescopeError(f"control.calibration_alpha={a}: give a level in (0, 1) such as 0.05")
    r = cfg.represent
    if r.pooling not in POOLINGS:
        raise MergescopeError(f"unknown represent.pooling '{r.pooling}': choose one of {', '.join(POOLINGS)}")
    if r.padding_side not in ("left", "right"):
        raise MergescopeError(f"represent.padding_side must be left or right, got '{r.padding_side}'")
    if int(r.max_length) < 512:
        raise MergescopeError(f"represent.max_length={r.max_length} would truncate below 512 tokens; use 512 or more")


def repr_key(cfg: DictConfig, entry: Any, ref: models.ModelRef, side: data_mod.Side) -> ReprKey:
    r = cfg.represent
    return ReprKey(model=models.fingerprint(ref), data=side.digest, lang=side.lang, split=str(cfg.data.split),
                   pooling=str(r.pooling), layer=int(r.layer), dtype=precision.dtype_tag(cfg, entry), max_length=int(r.max_length))


def repr_cache(cfg: DictConfig) -> ReprCache:
    return ReprCache(Path(cfg.paths.cache) / "reprs")


def representations(cfg: DictConfig, entry: Any, ref: models.ModelRef, side: data_mod.Side,
                    pending: list | None = None) -> tuple[np.ndarray, dict[str, Any]]:
    """Pooled representations of one side by one model, from the on-disk cache or a forward pass (``no_cache``:
    always a forward pass, nothing written). Representations that are not finite, or the same for every
    sentence, are an error and are never cached. With ``pending`` (a list) a fresh entry is not written but
    appended as a callable, so a job writes its entries only once every side has succeeded."""
    if one_forward.enabled(cfg):  # the study's one forward per model and side (represent.one_forward)
        r = cfg.represent
        _, layers, meta = one_forward.one_forward(cfg, entry, ref, side, pending=pending)
        every = layers[str(r.pooling)]
        if not -every.shape[0] <= int(r.layer) < every.shape[0]:
            raise MergescopeError(f"layer={r.layer} is out of range for a model with {every.shape[0]} hidden states "
                                  f"(0..{every.shape[0] - 1}, or -1)")
        return every[int(r.layer)], meta
    key, cache, use = repr_key(cfg, entry, ref, side), repr_cache(cfg), cache_enabled(cfg)
    hit = cache.get(key) if use else None
    if hit is not None:
        return hit[0], {**hit[1], "cache": "hit"}
    r = cfg.represent
    # represent.share_layers (a study with a shared-space arm sets it): the final layer is read from, or computed
    # with, the all-layer entry the shared space reads, so each model runs once per language for both arms
    # (the same path with the cache off, so a reproduction recomputes the same numbers, not the single-layer path's)
    lkey = layers_key(cfg, entry, ref, side) if r.get("share_layers") and int(r.layer) == -1 else None
    lhit = cache.get(lkey) if lkey is not None and use else None
    writes = []
    if lhit is not None:
        X, meta, how = lhit[0][-1], {k: v for k, v in lhit[1].items()}, "layers"
    else:
        lm = models.load(precision.forward_entry(cfg, entry), cfg.device, ref=ref)
        with precision.active(cfg):
            if lkey is not None:  # every pooling the shared space reads, from the same forward
                sh = cfg.get("shared") or {}
                pools = list(dict.fromkeys([str(r.pooling), str(sh.get("pooling") or r.pooling), *map(str, sh.get("poolings") or [])]))
                every, stats = embed_layers(lm.model, lm.tokenizer, side.sentences, poolings=pools,
                                            batch_tokens=r.batch_tokens, max_length=int(r.max_length),
                                            padding_side=r.padding_side, progress=bool(cfg.progress),
                                            label=f"embed layers {ref.label}")
                X = every[str(r.pooling)][-1]
            else:
                X, stats = embed(lm.model, lm.tokenizer, side.sentences, pooling=r.pooling, layer=int(r.layer),
                                 batch_tokens=r.batch_tokens, max_length=int(r.max_length), padding_side=r.padding_side,
                                 progress=bool(cfg.progress), label=f"embed {ref.label}")
        meta, how = {"true_config": lm.true_config, **stats}, "miss"
        if lkey is not None:
            for name, arr in every.items():
                k = dataclasses.replace(lkey, pooling=name)
                writes.append(lambda k=k, arr=arr: cache.put(k, arr, meta))
    problem = representation_problem(X)
    if problem:
        raise MergescopeError(f"{ref.label} on {side.source}: {problem} (layer {r.layer}, pooling {r.pooling}); nothing "
                              "was measured or cached: check the model's weights and dtype (float32 avoids overflow)")
    if use:
        writes.append(lambda: cache.put(key, X, meta))
        for write in writes:
            write() if pending is None else pending.append(write)
    return X, {**meta, "cache": how if use else "off"}


def layers_key(cfg: DictConfig, entry: Any, ref: models.ModelRef, side: data_mod.Side) -> LayersKey:
    """The all-layer cache key of one side's representations in the measure arm's pooling (the shared space's key)."""
    r = cfg.represent
    return LayersKey(model=models.fingerprint(ref), data=side.digest, lang=side.lang, split=str(cfg.data.split),
                     pooling=str(r.pooling), dtype=precision.dtype_tag(cfg, entry), max_length=int(r.max_length))


def needs_model(cfg: DictConfig, entry: Any, ref: models.ModelRef, side: data_mod.Side) -> None:
    """Fail before a run starts if a hub model would be needed and cannot be had."""
    if ref.local:
        return
    if one_forward.enabled(cfg):  # every part of the one forward's entry cached: the hub is not needed
        cache = repr_cache(cfg)
        ks = one_forward.keys(cfg, entry, ref, side, one_forward.poolings_of(cfg))
        cached = cache_enabled(cfg) and all(cache.get(k) is not None for k in ks.values())
    else:
        cached = cache_enabled(cfg) and repr_cache(cfg).get(repr_key(cfg, entry, ref, side)) is not None
    if not cached:
        models.hub_kwargs(ref)  # raises one line when the hub is unreachable and nothing is cached


def check_measure(cfg: DictConfig):
    """Everything a measure job needs, validated before any run: (metric entry, kwargs, refs, sides)."""
    a, b = cfg.pair.a, cfg.pair.b
    refs = models.resolve_pair(cfg.pair)
    entry, kwargs = metric_registry.resolve(cfg.metric, "no metric given: set metric=<name> (conf/metric/)")
    check_represent(cfg)
    sides = data_mod.load_parallel(cfg.data, str(a.lang), str(b.lang))
    n = len(sides[0].sentences)
    if n < 3:
        raise MergescopeError(f"{sides[0].source} gives {n} sentences (data.max_sentences={cfg.data.get('max_sentences')}); "
                              "a measure needs at least 3")
    entry.check(kwargs, n=n)
    needs_model(cfg, a, refs[0], sides[0])
    needs_model(cfg, b, refs[1], sides[1])
    return entry, kwargs, refs, sides


def _log_true_config(job, prefix: str, meta: dict[str, Any]) -> None:
    if "true_config" in meta:
        job.log_params({f"{prefix}.true": meta["true_config"]})


def run_measure(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    entry, kwargs, (ref_a, ref_b), (side_a, side_b) = check_measure(cfg)
    reps: dict[str, Any] = {}

    def prepare() -> None:  # the forward passes, before the run exists: bad weights or representations fail here
        pending: list = []  # side a is cached only once side b has succeeded too ("nothing was cached" holds)
        reps["a"] = representations(cfg, cfg.pair.a, ref_a, side_a, pending)
        reps["b"] = representations(cfg, cfg.pair.b, ref_b, side_b, pending)
        for write in pending:
            write()

    def body(job) -> dict[str, float]:
        (Xa, meta_a), (Xb, meta_b) = reps["a"], reps["b"]
        _log_true_config(job, "model_a", meta_a)
        _log_true_config(job, "model_b", meta_b)
        perms = control_permutations(Xa.shape[0], int(cfg.control.seed), pair_label(cfg), int(cfg.control.seeds))
        values = dict(entry.fn(Xa, Xb, device=cfg.device, **kwargs))
        values.update(shuffled_values(entry.fn, Xa, Xb, perms, job, device=cfg.device, **kwargs))
        values.update(calibrated_values(entry, Xa, Xb, cfg, kwargs))
        values.update({"n_sentences": float(Xa.shape[0]), "dim_a": float(Xa.shape[1]), "dim_b": float(Xb.shape[1]),
                       "control_seeds": float(len(perms))})
        job.log_params({"control.permutation_head": perms[0][:8].tolist(), "cache_a": meta_a["cache"], "cache_b": meta_b["cache"]})
        return finite_or_fail(values, f"{cfg.metric.name} on {pair_label(cfg)}")

    tags = {"kind": "measure", **pair_tags(cfg), "metric": cfg.metric.name, "route": "representation",
            "seed": cfg.control.seed, "data": cfg.data.name, "split": cfg.data.split}
    return run_once(cfg, JobSpec(f"measure {cfg.metric.name} {pair_text(cfg)}", tags, task="measure", keys=MEASURE_KEYS,
                                 reads=(ref_a, ref_b), prepare=prepare, extra=one_forward.identity(cfg) or None), body, overrides)


def run_quality(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    entry = cfg.get("model")
    if entry is None:
        raise MergescopeError("task=quality needs a model: add model=<name> (see conf/model/) or model=custom model.name_or_path=...")
    ref = models.resolve(entry)
    check_represent(cfg)
    side = data_mod.load_side(cfg.data, str(entry.lang))
    models.hub_kwargs(ref)
    loaded: list[models.LoadedModel] = []  # loaded before the run exists: bad weights fail there
    shared: dict[str, Any] = {}

    def load() -> None:
        if one_forward.enabled(cfg):  # the scores of the study's one forward (its states serve the measure arm)
            scores, _, meta = one_forward.one_forward(cfg, entry, ref, side)
            shared["res"] = {**scores.summary(), "n_tokens": int(scores.tokens.sum()), "n_truncated": scores.n_truncated}
            shared["true"] = meta.get("true_config")
        else:
            loaded.append(models.load(precision.forward_entry(cfg, entry), cfg.device, ref=ref))

    def body(job) -> dict[str, float]:
        if shared:
            job.log_params({"model.true": shared["true"]})
            res = shared["res"]
        else:
            lm = loaded[0]
            job.log_params({"model.true": lm.true_config})
            with precision.active(cfg):
                res = token_nll(lm.model, lm.tokenizer, side.sentences, batch_tokens=cfg.represent.batch_tokens,
                                max_length=int(cfg.represent.max_length), progress=bool(cfg.progress), label=f"nll {ref.label}")
        keys = ("nll", "bits_per_byte", "nll_rest", "bits_per_byte_rest", "first_token_nll")
        return finite_or_fail({**{k: res[k] for k in keys}, "n_tokens": float(res["n_tokens"]),
                               "n_truncated": float(res["n_truncated"])},
                              f"quality of {ref.label}")

    tags = {"kind": "quality", "model": model_label(entry), "lang": entry.lang, "data": cfg.data.name,
            "split": cfg.data.split, "seed": cfg.seed}
    return run_once(cfg, JobSpec(f"quality {model_label(entry)}", tags, task="quality", keys=QUALITY_KEYS, reads=(ref,),
                                 extra={"evidence": 1, **one_forward.identity(cfg)},  # 1: the first token apart
                                 prepare=load), body, overrides)
