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
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from mergescope import data as data_mod
from mergescope import models
from mergescope.config import cache_enabled
from mergescope.scoring.bpb import Scores, score_sentences
from mergescope.config import hash_parts, plain_copy, to_plain
from mergescope.errors import MergescopeError
from mergescope.documents import documents
from mergescope.evidence import compare, read_scores, sentence_csv
from mergescope import precision
from mergescope.integrity import load_torch, save_torch
from mergescope.progress import console
from mergescope.runs import JobResult, JobSpec, finished, model_label, model_parts, pair_label, run_once, would_run
from mergescope.tracking import Job, Tracker
from mergescope.transport import finetune as finetune_mod
from mergescope.transport import fusion as fus
from mergescope.transport import interfaces as itf
from mergescope.transport import released as rel
from mergescope.transport.settings import TransportSettings, merge_node, probe_data

TRANSPORT_KEYS = ["pair", "merge", "data", "native.nll_sentences", "represent.max_length"]
BASELINE_KEYS = ["merge.adapt", "merge.probe_split", "data", "native.nll_sentences", "represent.max_length"]
"""What the no-fusion baseline's hash reads besides the target's model entry (hashed as ``target``), its weights and
the adaptation text."""
EVIDENCE = 1
"""In every transport job's identity: 1 = per-sentence scores kept, every difference with its paired interval and the
first token apart (runs from before it have none, so they run again)."""
PROBE_CACHE_VERSION = 3  # 3: checksummed entries (mergescope.integrity); 2: a leading special token (BOS) is left out of the pooling; the key has the dtype


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
        ad = job.merge.get("adapt") or {}
        if ad.get("mode", "residual_frozen") == "residual_frozen":  # mergescope's adaptation: the released SFT's keys left out
            for k in ("mode", "freeze", "train_alpha", "warmup_ratio"):
                ad.pop(k, None)
    return job, settings


def sides(cfg: DictConfig) -> tuple[Any, Any]:
    """(target entry, donor entry)."""
    return (cfg.pair.a, cfg.pair.b) if str(cfg.merge.target) == "a" else (cfg.pair.b, cfg.pair.a)


def _alpha_cfg(cfg: DictConfig, alpha: float) -> DictConfig:
    """One alpha's run config (logged, and hashed with TRANSPORT_KEYS): that alpha alone, no adaptation.
    The study's headline alpha is not part of it (it is hashed and tagged apart, see :func:`_hash`)."""
    c = plain_copy(cfg)
    with open_dict(c):
        c.merge.alphas = [float(alpha)]
        c.merge.headline_alpha = None
        c.merge.adapt = {"enabled": False}
    return c


def probe_compute(cfg: DictConfig) -> dict[str, str]:
    """What a job's hash adds for HOW its bfloat16 probes are computed: nothing where they run natively (or are not
    bfloat16), ``{"probe_compute": "bfloat16-emulated"}`` on hardware without bfloat16 units (the emulation's
    numbers differ from a native bfloat16 model's in the accumulation order: :func:`mergescope.precision.bfloat16_copy`)."""
    from mergescope.transport.settings import ReleasedSettings

    m = cfg.get("merge")
    if m is None or str(m.get("name")) != "transport_released":
        return {}
    if ReleasedSettings.from_node(m).probe_dtype != "bfloat16" or precision.bf16_native(str(cfg.get("device") or "cpu")):
        return {}
    return {"probe_compute": "bfloat16-emulated"}


def _alpha_hashes(cfg: DictConfig, alphas, reads: list[Any], **extra: Any) -> dict[float, str]:
    """Each alpha's ``_hash("transport", _alpha_cfg(cfg, alpha), TRANSPORT_KEYS, reads, **extra)``, from one plain
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


def _digest(sentences: tuple[str, ...]) -> str:
    return hashlib.sha256("\n".join(sentences).encode()).hexdigest()


def _hash(task: str, cfg: DictConfig, keys: list[str], reads: list[Any], **extra: Any) -> str:
    """A job's cfg_hash: the config sections in ``keys``, the fingerprint of every model it reads, and ``extra``."""
    refs = [models.resolve(e) for e in reads]
    return hash_parts(task, {**{k: OmegaConf.select(cfg, k) for k in keys}, **model_parts(refs), "evidence": EVIDENCE, **extra,
                             **precision.identity(cfg), **probe_compute(cfg)})


@dataclass(frozen=True)
class Texts:
    """The direction's sentences: evaluation (both languages), probes (both), adaptation text (the target's),
    and which lines of which file each set is (logged as params ``text.*``)."""

    eval_t: tuple[str, ...]
    eval_d: tuple[str, ...]
    probe_t: tuple[str, ...]
    probe_d: tuple[str, ...]
    adapt_t: tuple[str, ...]
    ranges: dict[str, str]
    select_t: tuple[str, ...] = ()   # the alpha-selection split (the target's language), after the probes
    select_start: int = 0            # its first line in the probe split's file (0-based)


def texts(cfg: DictConfig, s: TransportSettings, lang_t: str, lang_d: str) -> Texts:
    """Evaluation, probe and adaptation sentences, disjoint from the evaluation. With a separate probe split
    (FLORES dev; in a one-file-per-language folder evaluated on devtest, dev: the partition's other lines,
    ``data.FOLDER_RULE``) the probes are its first ``probe_sentences`` lines and the adaptation text all of it. When
    the probe split is the evaluation file itself (``data=folder`` evaluated on every line), the file is cut into
    disjoint ranges: evaluation first, then the probes, then the adaptation text. With ``merge.select_sentences`` the
    alpha-selection split (the target's language) is that many lines after the probes, disjoint from the evaluation and
    the probes (in a shared file the adaptation text starts after it; on a separate probe split it is all of it, as
    before: nothing is chosen for the adaptation)."""
    et, ed = data_mod.load_parallel(cfg.data, lang_t, lang_d)
    k = cfg.native.get("nll_sentences")
    n_eval = min(len(et.sentences), int(k)) if k else len(et.sentences)
    pt, pd = data_mod.load_parallel(probe_data(cfg, s), lang_t, lang_d)
    start = n_eval if ((pt.source, pt.part) == (et.source, et.part) or (pd.source, pd.part) == (ed.source, ed.part)) else 0
    if start and start + 3 > len(pt.sentences):
        raise MergescopeError(f"{pt.source} is both the evaluation set and the probe split (data={cfg.data.name}); its first "
                              f"{n_eval} lines are evaluated and fewer than 3 are left for probes: set native.nll_sentences "
                              "(or data.max_sentences) below its length")
    n_probe = min(s.probe_sentences, len(pt.sentences) - start)
    if n_probe < s.probe_sentences:
        console.print(f"[yellow]probe split {pt.source} has {n_probe} probe sentences; using all of them (merge.probe_sentences={s.probe_sentences})[/]")
    s0 = start + n_probe
    reserve = s.adapt.batch_size if (start and s.adapt is not None) else 0  # a shared file: the adaptation text comes after
    n_sel = min(s.select_sentences, max(0, len(pt.sentences) - s0 - reserve))
    if n_sel < s.select_sentences:
        raise MergescopeError(f"merge.select_sentences={s.select_sentences}: {pt.source} has {len(pt.sentences) - s0} lines after the "
                              f"probes{' (and the adaptation batch after them)' if reserve else ''}; lower merge.select_sentences or "
                              "merge.probe_sentences")
    a0 = s0 + n_sel if start else 0
    adapt = pt.sentences[a0:]
    if s.adapt is not None and len(adapt) < s.adapt.batch_size:
        raise MergescopeError(f"the adaptation text ({pt.source}, lines {a0 + 1}-{len(pt.sentences)}) has {len(adapt)} sentences, "
                              f"fewer than merge.adapt.batch_size={s.adapt.batch_size}" + ("; lower native.nll_sentences or "
                              "merge.probe_sentences, or give a longer file" if start else ""))
    ranges = {"text.eval": f"{et.source} lines 1-{n_eval}", "text.probes": f"{pt.source} lines {start + 1}-{start + n_probe}",
              "text.adapt": f"{pt.source} lines {a0 + 1}-{len(pt.sentences)}"}
    if n_sel:
        ranges["text.select"] = f"{pt.source} lines {s0 + 1}-{s0 + n_sel}"
    if start:
        console.print(f"[yellow]{pt.source} is both the evaluation and the probe split, cut into disjoint ranges: "
                      f"evaluation lines 1-{n_eval}, probes {start + 1}-{start + n_probe}, adaptation {a0 + 1}-{len(pt.sentences)}[/]")
    return Texts(et.sentences[:n_eval], ed.sentences[:n_eval], pt.sentences[start:start + n_probe],
                 pd.sentences[start:start + n_probe], adapt, ranges, pt.sentences[s0:s0 + n_sel], s0)


def baseline_hash(cfg: DictConfig, adapt_text: tuple[str, ...]) -> str:
    """cfg_hash of the no-fusion baseline: the target's model entry and weights and the adaptation's inputs, not
    the donor (one baseline per target, shared by every donor)."""
    target, _ = sides(cfg)
    ad = cfg.merge.get("adapt") or {}
    if ad.get("mode") == "released":  # the released no-fusion training does not read its freeze strategy or training alpha
        cfg = plain_copy(cfg)
        with open_dict(cfg):
            for k in ("freeze", "train_alpha"):
                cfg.merge.adapt.pop(k, None)
    return _hash("transport_adapt_baseline", cfg, BASELINE_KEYS, [target], target=target, adapt_text=_digest(adapt_text))


def probe_path(cfg: DictConfig, lm: models.LoadedModel, sentences: tuple[str, ...], lang: str,
               extra: dict[str, Any] | None = None) -> Path:
    """Where a model's probe activations are cached: keyed by its weights, dtype, the sentences, language and max_length
    (and ``extra``, when given: the released method's sites and pooling)."""
    key = json.dumps({"model": models.fingerprint(lm.ref), "sents": _digest(sentences), "lang": lang,
                      "dtype": str(next(lm.model.parameters()).dtype), "max_length": int(cfg.represent.max_length),
                      "v": PROBE_CACHE_VERSION, **({"extra": extra} if extra else {})}, sort_keys=True)
    return Path(cfg.paths.cache) / "probes" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"


def _probe_cached(cfg: DictConfig, lm: models.LoadedModel, sentences: tuple[str, ...], lang: str,
                  adapter: itf.Adapter, skip_leading_special: bool = True, extra: dict[str, Any] | None = None,
                  pool_dtype: torch.dtype | None = None) -> fus.Probe:
    path = probe_path(cfg, lm, sentences, lang, extra)
    use_cache = cache_enabled(cfg)  # reproduce --no-cache redoes the probes' forward passes
    # onto the model's device: on a GPU every cost matrix and Sinkhorn solve then runs there; checksummed, so a bad
    # entry is reported, deleted and recomputed
    d = load_torch(path, map_location=next(lm.model.parameters()).device) if use_cache else None
    if d is not None:
        return fus.Probe(d["pooled"], d["magnitude"], int(d["n_layers"]), int(d["n_tokens"]))
    p = fus.probe(lm.model, lm.tokenizer, sentences, adapter, batch_tokens=cfg.represent.batch_tokens,
                  max_length=int(cfg.represent.max_length), progress=bool(cfg.progress), label=f"probe {lm.ref.label}",
                  skip_leading_special=skip_leading_special, pool_dtype=pool_dtype)
    if not use_cache:
        return p
    save_torch(path, {"pooled": {k: [t.cpu() for t in v] for k, v in p.pooled.items()},  # temp file + rename
                      "magnitude": {k: [t.cpu() for t in v] for k, v in p.magnitude.items()},
                      "n_layers": p.n_layers, "n_tokens": p.n_tokens})
    return p


@dataclass
class _Direction:
    """One direction's job: the job config, its settings and overrides, the two sides, its sentences."""

    cfg: DictConfig
    s: TransportSettings
    overrides: list[str] | None
    target: Any
    donor: Any
    texts: Texts

    @property
    def label(self) -> str:
        return f"{model_label(self.target)} <- {model_label(self.donor)}"

    @property
    def eval_t(self) -> tuple[str, ...]:
        return self.texts.eval_t

    @property
    def eval_d(self) -> tuple[str, ...]:
        return self.texts.eval_d

    def tags(self, kind: str, **extra) -> dict[str, Any]:
        t, d = model_label(self.target), model_label(self.donor)
        a, b = self.cfg.pair.a, self.cfg.pair.b
        return {"kind": kind, "route": "transport", "merge": self.s.name, "transport_variant": self.s.variant(),
                "target": t, "donor": d, "direction": f"{t} <- {d}",
                "pair": pair_label(self.cfg), "model_a": model_label(a), "model_b": model_label(b),
                "lang_target": self.target.lang, "lang_donor": self.donor.lang, "seed": self.cfg.merge.control_seed, **extra}


class _Host:
    """The target model in memory, with NLL on a language and in-place weight setting."""

    def __init__(self, cfg: DictConfig, entry):
        self.cfg = cfg
        self.lm = models.load(entry, cfg.device, dtype=models.merge_dtype(entry.get("dtype")))  # fused in >= float32
        self.model, self.tok, self.true = self.lm.model, self.lm.tokenizer, self.lm.true_config
        self.snapshot: dict[str, torch.Tensor] = {}

    def set(self, weights: dict[str, torch.Tensor]) -> None:
        sd = self.model.state_dict()
        for k, v in weights.items():
            sd[k].copy_(v.to(sd[k].device, sd[k].dtype))

    def scores(self, sentences, label: str) -> Scores:
        """Per-sentence scores of the model as it now is (:mod:`mergescope.scoring.bpb`)."""
        return score_sentences(self.model, self.tok, sentences, batch_tokens=self.cfg.represent.batch_tokens,
                               max_length=int(self.cfg.represent.max_length), progress=bool(self.cfg.progress), label=label)

    def nll(self, sentences, label: str) -> float:
        return self.scores(sentences, label).nats_per_token


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
    base_select: float | None = None   # the unfused target on the alpha-selection split (None: no split)
    base_scores: dict[str, Scores] | None = None   # the unfused target per sentence: "target_lang", "donor_lang", "select"
    docs: dict[str, tuple[list[str] | None, str]] | None = None  # the documents of each evaluation set, and what one is


def run_transport(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    cfg, s = check(cfg)
    target, donor = sides(cfg)
    d = _Direction(cfg, s, overrides, target, donor, texts(cfg, s, str(target.lang), str(donor.lang)))
    tracker = Tracker(cfg)
    reads = [target, donor]
    saving = {"save": True} if cfg.get("save") else {}  # save=true: each alpha's fused model written (its own runs)
    hashes = _alpha_hashes(cfg, s.alphas, reads, headline_alpha=s.headline_alpha, **saving)
    done = {a: finished(cfg, tracker, h) for a, h in hashes.items()}
    adapt_hash = _hash("transport_adapt", cfg, TRANSPORT_KEYS, reads) if s.adapt else None
    adapt_done = finished(cfg, tracker, adapt_hash) if adapt_hash else None
    lm_eval = cfg.get("eval") is not None and str(cfg.eval.get("name")) == "lm_eval"
    if lm_eval:
        from mergescope.scoring.lmeval import check_lm_eval

        check_lm_eval()  # before any plan is fitted
    fitted: list[_Fitted] = []

    def fit() -> _Fitted:  # once per direction, only when something runs
        if not fitted:
            fitted.append(_fit(d))
        return fitted[0]

    if all(r is not None for r in done.values()) and (s.adapt is None or adapt_done is not None):
        if s.adapt is not None:  # the reused adaptation's no-fusion baseline is one of the study's runs too
            finished(cfg, tracker, baseline_hash(cfg, d.texts.adapt_t))
        if lm_eval:
            _lm_evals(d, done, fit)
        return _summary(done, adapt_done, s.headline_alpha, skipped=True)
    would_run()  # a study's done-check pass (runs.only_if_done) stops here: this direction has work to do
    f = fit()
    results = {a: r if r is not None else _alpha_run(d, f, a, hashes[a]) for a, r in done.items()}
    if s.adapt and adapt_done is None:
        known = results.get(s.adapt.alpha)  # the fused model's NLL, when adapt.alpha is on the grid
        adapt_done = _adapt(d, f, adapt_hash, known.metrics.get("nll_target_lang") if known is not None else None)
    if lm_eval:
        _lm_evals(d, results, fit)
    return _summary(results, adapt_done, s.headline_alpha, skipped=False)


def _lm_evals(d: _Direction, results: dict[float, JobResult], fit) -> None:
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


def _fit(d: _Direction) -> _Fitted:
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
        dp = _probe_cached(cfg, donor, d.texts.probe_d, str(d.donor.lang), d_ad)
    donor_true = donor.true_config
    streamed = None if donor.ref.gguf_file else streamed_state(donor.ref, dtype_d, model=donor.model,
                                                               cache_root=cfg.paths.get("cache"))
    donor_sd = streamed[0] if streamed is not None else {k: v.detach() for k, v in donor.model.state_dict().items()}
    del donor, streamed
    host = _Host(cfg, d.target)
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
        tp = _probe_cached(cfg, host.lm, d.texts.probe_t, str(d.target.lang), t_ad)
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
    return _Fitted(host, donor_true, fusion, stats, layer_table, base["target_lang"].nats_per_token,
                   base["donor_lang"].nats_per_token, len(d.texts.probe_t),
                   base["select"].nats_per_token if "select" in base else None, base, eval_documents(d))


def eval_documents(d: _Direction) -> dict[str, tuple[list[str] | None, str]]:
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
    apart from the seed's probes: the sites and the pooling are in the key)."""
    ad = lay.adapter(rel.SUBLAYER_ROLES[s.released.sublayers])
    skip = s.released.pooling == "skip_leading_special"
    extra = {"sites": sorted(f"{k}={p}:{side}" for k, (p, side) in ad.sites.items()), "skip_special": skip}
    if s.released.probe_dtype == "bfloat16":  # the released probes: a bfloat16 copy run and pooled in bfloat16
        native = precision.bf16_native(str(cfg.get("device") or "cpu"))
        lm16 = dataclasses.replace(lm, model=precision.bfloat16_copy(lm.model, native))
        try:
            return _probe_cached(cfg, lm16, sentences, lang, ad, skip_leading_special=skip,
                                 extra={**extra, "pool": "bfloat16" if native else "bfloat16-emulated"},
                                 pool_dtype=torch.bfloat16)
        finally:
            del lm16
    return _probe_cached(cfg, lm, sentences, lang, ad, skip_leading_special=skip, extra=extra)


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


def _alpha_run(d: _Direction, f: _Fitted, a: float, h: str) -> JobResult:
    """One alpha's run: the fused target and the random-plan control, each on both languages, with the fused
    tensors' weight-space distance to the target's originals (aggregate metrics, per tensor as an artifact)."""
    host = f.host

    def body(job: Job) -> dict[str, float]:
        base = f.base_scores
        values = {"alpha": a, **_named(base["target_lang"], "base_", "target_lang"), **_named(base["donor_lang"], "base_", "donor_lang")}
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
                sc[("ot", "select")] = host.scores(d.texts.select_t, f"fused a={a:g} selection split")
                values["select_nll_target_lang"] = sc[("ot", "select")].nats_per_token
                values["select_nll_rest_target_lang"] = sc[("ot", "select")].rest().nats_per_token
                docs, what = f.docs["select"]
                values.update(compare("select_delta_target_lang", sc[("ot", "select")], base["select"], docs, what))
            agg, per_tensor[arm] = f.fusion.weight_stats(a, control=ctl, shrink=shrink)
            values.update({f"{prefix}{k}": v for k, v in agg.items()})
        values.update(_more_controls(d, f, a, sc))
        if d.cfg.get("save"):  # the fused target (not the control) under paths.merged/<run id>/
            from mergescope.transport.save import save_transport

            host.set(f.fusion.weights(a, control=False))
            job.log_params({"saved_to": save_transport(d.cfg, host.model, host.tok, job.run_id, d.label, a)})
        host.set(f.fusion.original)
        for lang in ("target_lang", "donor_lang"):  # every difference with its paired interval, by article
            docs, what = f.docs[lang]
            arms = {"ot": sc[("ot", lang)], "base": sc[("base", lang)], "shrink": sc[("shrink", lang)], "rand": _rand_arms(sc, lang)}
            for name, x, y in (("delta", "ot", "base"), ("rand_delta", "rand", "base"), ("ot_minus_rand", "ot", "rand"),
                               ("shrink_delta", "shrink", "base"), ("ot_minus_shrink", "ot", "shrink")):
                values.update(compare(f"{name}_{lang}", arms[x], arms[y], docs, what))
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

    tags = d.tags("transport", alpha=a, headline_alpha=d.s.headline_alpha)
    r = run_once(_alpha_cfg(d.cfg, a), JobSpec(f"transport a={a:g} {d.label}", tags, keys=TRANSPORT_KEYS, cfg_hash=h), body, d.overrides)
    v = r.metrics
    console.print(f"  {d.label} alpha={a:g}: delta target {v['delta_target_lang']:+.4f} "
                  f"(random plan {v['rand_delta_target_lang']:+.4f}, shrink only {v.get('shrink_delta_target_lang', math.nan):+.4f}), "
                  f"donor lang {v['delta_donor_lang']:+.4f}")
    return r


def _more_controls(d: _Direction, f: _Fitted, a: float, sc: dict[tuple[str, str], Scores]) -> dict[str, float]:
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
    return [v for (arm, l_), v in sc.items() if l_ == lang and arm.startswith("rand")]


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


def _finetune(d: _Direction, host: _Host, job: Job, residual, label: str, metric: str = "train_loss",
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


def _baseline(d: _Direction, host: _Host, f: _Fitted) -> tuple[JobResult, Scores | None]:
    """The no-fusion baseline: the same fine-tuning of the unfused target (one run per target)."""
    name = model_label(d.target)
    tags = {"kind": "transport_adapt", "route": "transport", "stage": "baseline", "target": name, "donor": "none",
            "direction": f"{name} (no fusion)", "lang_target": d.target.lang, "seed": d.cfg.merge.adapt.seed,
            "adapt_mode": d.s.adapt.mode}

    def body(job: Job) -> dict[str, float]:
        host.set(host.snapshot)
        losses = _finetune(d, host, job, None, f"adapt baseline {name}")
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


def _adapt_one(d: _Direction, f: _Fitted, job: Job, control: bool, before: float | None,
               out: dict[tuple[str, str], Scores]) -> dict[str, float]:
    """One fused model (OT, or the random-plan control) fine-tuned as ``merge.adapt.mode`` says (mergescope's: at
    adapt.alpha, its residual frozen; released: at the training alpha, what ``adapt.freeze`` says trains), measured
    on both languages; the host is restored afterwards."""
    host, fusion, a, p = f.host, f.fusion, d.s.adapt.alpha, "rand_" if control else ""
    if d.s.adapt.mode == "released":  # (1 - a_t) W + a_t R, R = the transported weight (fusion at alpha 1), W in the host
        at = d.s.adapt.trained_alpha
        host.set(fusion.weights(at, control=control))
        before = before if before is not None and at == a else host.nll(d.eval_t, f"nll {p}fused")
        residual = fusion.weights(1.0, control=control)
        host.set(host.snapshot)
        mask = {n: (fusion.masks[n], n in fusion.by_column) for n in residual}
    else:
        fused = fusion.weights(a, control=control)
        residual = {n: (fused[n] - fusion.original[n]) for n in fused}
        host.set(fused)
        del fused
        before = before if before is not None else host.nll(d.eval_t, f"nll {p}fused")
    losses = _finetune(d, host, job, residual, f"adapt {p}fused {d.label}", f"{p}train_loss",
                       mask if d.s.adapt.mode == "released" else None)
    after = host.scores(d.eval_t, f"nll {p}fused adapted")
    after_d = host.scores(d.eval_d, f"nll {p}fused adapted, donor lang")
    host.set(host.snapshot)
    out[(p, "target_lang")], out[(p, "donor_lang")] = after, after_d
    return {f"{p}nll_fused_before": before, f"{p}nll_fused_after": after.nats_per_token,
            f"{p}nll_rest_fused_after": after.rest().nats_per_token, f"{p}nll_donor_lang_fused_after": after_d.nats_per_token,
            f"{p}train_loss_first": losses[0], f"{p}train_loss_last": losses[-1]}


def _damped_baseline(d: _Direction, f: _Fitted, job: Job, sc: dict[tuple[str, str], Scores]) -> dict[str, float]:
    """The released SFT trains each fused tensor through ``(1 - a) W + a R``: its updates reach the model damped by
    (1 - a), where the plain no-fusion baseline's are not, so "fusion after SFT" against that baseline mixes the
    transported term with the damping. This baseline is trained the same way with R = W0, the target's own weights
    (no fusion, the same damping, the same fold: with ``fold=select`` no row is fused, so the trained weight is kept
    everywhere): ``fusion_effect_vs_damped_after_adapt`` = the fused model minus it, paired."""
    host = f.host
    host.set(host.snapshot)
    own = {n: host.snapshot[n].detach().clone() for n in f.fusion.original}
    none = {n: (torch.zeros_like(f.fusion.masks[n]), n in f.fusion.by_column) for n in own}
    losses = _finetune(d, host, job, own, f"adapt damped baseline {d.label}", "damped_train_loss", none)
    after = host.scores(d.eval_t, "nll damped baseline adapted")
    host.set(host.snapshot)
    sc[("damped_baseline", "target_lang")] = after
    return {"nll_damped_baseline_after": after.nats_per_token, "nll_rest_damped_baseline_after": after.rest().nats_per_token,
            "damped_train_loss_last": losses[-1],
            **compare("fusion_effect_vs_damped_after_adapt", sc[("", "target_lang")], after, *f.docs["target_lang"]),
            **compare("rand_fusion_effect_vs_damped_after_adapt", sc[("rand_", "target_lang")], after, *f.docs["target_lang"])}


def _adapt(d: _Direction, f: _Fitted, h: str, fused_nll: float | None = None) -> JobResult:
    """The fused model (at adapt.alpha) and its random-plan control, each fine-tuned with its transported residual
    frozen, against the no-fusion baseline (the same fine-tuning of the unfused target)."""
    host, a = f.host, d.s.adapt.alpha
    host.snapshot = {k: v.detach().clone() for k, v in host.model.state_dict().items()}
    baseline, base_scores = _baseline(d, host, f)
    host.set(host.snapshot)
    base_after = baseline.metrics["nll_baseline_after"]

    def body(job: Job) -> dict[str, float]:
        sc: dict[tuple[str, str], Scores] = {}
        v = {"alpha": a, "nll_base_before": f.base_t, "base_nll_donor_lang": f.base_d, "nll_baseline_after": base_after,
             **_adapt_one(d, f, job, False, fused_nll, sc), **_adapt_one(d, f, job, True, None, sc)}
        v["fusion_effect_before_adapt"] = v["nll_fused_before"] - f.base_t
        docs_t, docs_d = f.docs["target_lang"], f.docs["donor_lang"]
        for p in ("", "rand_"):
            if base_scores is not None:  # against the adapted no-fusion baseline, sentence by sentence
                v.update(compare(f"{p}fusion_effect_after_adapt", sc[(p, "target_lang")], base_scores, *docs_t))
            else:  # a baseline run recorded before per-sentence scores: the difference without an interval
                v[f"{p}fusion_effect_after_adapt"] = v[f"{p}nll_fused_after"] - base_after
            v.update(compare(f"{p}delta_donor_lang_after_adapt", sc[(p, "donor_lang")], f.base_scores["donor_lang"], *docs_d))
        v.update(compare("ot_minus_rand_after_adapt", sc[("", "target_lang")], sc[("rand_", "target_lang")], *docs_t))
        if d.s.adapt.mode == "released":  # the no-fusion baseline under the fused arm's damping (module doc)
            v.update(_damped_baseline(d, f, job, sc))
        v.update(compare("ot_minus_rand_donor_lang_after_adapt", sc[("", "donor_lang")], sc[("rand_", "donor_lang")], *docs_d))
        job.log_params({"baseline_run": baseline.run_id, **d.texts.ranges})
        job.log_text(sentence_csv({((p.rstrip("_") or "ot") + "_after", lang): x for (p, lang), x in sc.items()},
                                  {k: val[0] for k, val in f.docs.items()}), "scores/sentences.csv")
        return v

    r = run_once(d.cfg, JobSpec(f"transport-adapt a={a:g} {d.label}", {**d.tags("transport_adapt", stage="fused", alpha=a),
                                                                        "adapt_mode": d.s.adapt.label},
                                keys=TRANSPORT_KEYS, cfg_hash=h), body, d.overrides)
    host.set(host.snapshot)
    m = r.metrics
    console.print(f"  {d.label} adapted (alpha={a:g}): {m['nll_fused_after']:.4f} vs no-fusion baseline {base_after:.4f} "
                  f"(fusion effect {m['fusion_effect_after_adapt']:+.4f}, control {m.get('rand_fusion_effect_after_adapt', math.nan):+.4f})")
    return r
