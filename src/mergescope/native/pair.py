"""A pair with a shared parameter space, loaded once: the host (model a, with its tokenizer) in
memory for NLLs, the state dicts of a, b and the task-vector base, the coverage, and the
linear-mode-connectivity curve.

For a cross-model pair the host keeps its embeddings and LM head, and only the shared tensors are
interpolated or merged (t=0 the host alone, t=1 every shared tensor from b).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from mergescope import data as data_mod
from mergescope import models
from mergescope.scoring.bpb import Scores, score_sentences
from mergescope.config import plain_copy
from mergescope.documents import documents
from mergescope.errors import MergescopeError
from mergescope.native.settings import NativeSettings
from mergescope.stream import streamed_state
from mergescope.native.weights import coverage, routes
from mergescope.runs import model_label, pair_label

_STEP = re.compile(r"^step(\d+)$")


def step_of(revision: str | None) -> int | None:
    m = _STEP.match(str(revision or ""))
    return int(m.group(1)) if m else None


def same_run(cfg: DictConfig) -> bool:
    """Two checkpoints of one training run: the same model location, different revisions."""
    return str(cfg.pair.a.name_or_path) == str(cfg.pair.b.name_or_path)


def base_entry(cfg: DictConfig) -> Any | None:
    """The task-vector base: ``native.base`` given as a model entry (``defaults: [/model@native.base: <name>]``: the
    pretrained model both sides were fine-tuned from, for any pair); else, for checkpoints of one run, that run at the
    revision ``native.base``; else none."""
    base = NativeSettings.from_cfg(cfg).base
    if isinstance(base, dict):
        base = OmegaConf.create(base)
        return None if base_is_a_side(cfg, base) else plain_copy(base)
    if not same_run(cfg) or not base:
        return None
    e = plain_copy(cfg.pair.a)
    e.revision = str(base)
    return e


def base_is_a_side(cfg: DictConfig, base: DictConfig) -> bool:
    """The base entry is one of the pair's own models (base x its fine-tune): no task vector of that side, so none."""
    try:
        where = models.resolve(base)
        return any((where.location, where.revision) == (r.location, r.revision)
                   for r in (models.resolve(cfg.pair.a), models.resolve(cfg.pair.b)))
    except MergescopeError:
        return False  # a missing base is reported where it is read


def base_blockers(shared: list[str], sd_a, sd_base) -> list[str]:
    """Why a base cannot serve the pair's task vectors: a shared tensor it lacks, or holds in another shape."""
    out = []
    for n in shared:
        if n not in sd_base:
            out.append(f"{n} is not in the base")
        elif tuple(sd_base[n].shape) != tuple(sd_a[n].shape):
            out.append(f"{n} has shape {tuple(sd_base[n].shape)} in the base, {tuple(sd_a[n].shape)} in model a")
    return out


def no_base_reason(cfg: DictConfig) -> str:
    base = NativeSettings.from_cfg(cfg).base
    if isinstance(base, dict):
        return (f"native.base ({model_label(OmegaConf.create(base))}) is one of the pair's own models: its task vector is zero, so "
                "task-vector diagnostics and base-requiring merges are left out")
    if same_run(cfg):
        return "native.base is null"
    return (f"{model_label(cfg.pair.a)} and {model_label(cfg.pair.b)} were trained separately, with no shared "
            "pre-trained ancestor, so theta - theta_base is meaningless across them")


def check_pair(cfg: DictConfig) -> tuple[models.ModelRef, ...]:
    """Before any run exists: two different models, a shared parameter space, the host's language.
    Returns the refs of every model the pair's jobs read (a, b, and the task-vector base when there is one)."""
    ra, rb = models.resolve_pair(cfg.pair)
    native = routes(models.load_config(ra), models.load_config(rb))["native"]
    if not native["defined"]:
        raise MergescopeError(
            f"the native route is undefined for {pair_label(cfg)}: {native['blocked_by']}; "
            "weight-space operators need a shared parameter space (use the transport or adapt route)"
        )
    for lang in [*outcome_langs(cfg), *nll_langs(cfg)]:  # every language it scores on is in the data
        data_mod.load_side(cfg.data, lang)
    if (ts := NativeSettings.from_cfg(cfg).transplant_settings()) is not None:  # the target vocabulary can be built
        from mergescope.native.transplant import pair_targets

        pair_targets(cfg, ts)
    be = base_entry(cfg)
    refs = (ra, rb) if be is None else (ra, rb, models.resolve(be))
    for ref in refs:  # NaN or infinite weights fail here, before the run (read once per checkpoint, then remembered)
        models.check_weights(ref, cfg.paths.cache)
    return refs


def _state(model) -> dict[str, Any]:
    return {k: v.detach() for k, v in model.state_dict().items()}


class Loaded:
    """The pair's models loaded once: host (a) with its tokenizer, state dicts of a, b and the base."""

    def __init__(self, cfg: DictConfig, need_base: bool):
        a, b = cfg.pair.a, cfg.pair.b
        host = models.load(a, cfg.device, quiet=True, dtype=models.merge_dtype(a.get("dtype")))  # merged in >= float32
        self.ref_a, self.host, self.tok, self.true_a = host.ref, host.model, host.tokenizer, host.true_config
        # a, b and the base are read tensor by tensor from their safetensors files (streamed_state) when they can
        # be: the host alone is held in memory; otherwise they are loaded whole, as before
        cache = cfg.paths.get("cache")
        sa = streamed_state(host.ref, models.merge_dtype(a.get("dtype")), model=self.host, cache_root=cache)
        self.sd_a = sa[0] if sa else {k: v.cpu().clone() for k, v in _state(self.host).items()}
        self.ref_b = models.resolve(b)
        sb = streamed_state(self.ref_b, models.merge_dtype(b.get("dtype")), cache_root=cache)
        if sb is None:
            donor = models.load(b, "cpu", ref=self.ref_b, quiet=True, dtype=models.merge_dtype(b.get("dtype")))
            sb = (_state(donor.model), donor.true_config)
        self.sd_b, self.true_b = sb
        self.sd_base = None
        be = base_entry(cfg)
        if need_base and be is not None:
            base_ref = models.resolve(be)
            sbase = streamed_state(base_ref, models.merge_dtype(be.dtype), cache_root=cache)
            self.sd_base = sbase[0] if sbase else _state(models.load_model(base_ref, models.merge_dtype(be.dtype), "cpu"))
        self.merge_stats: dict[str, tuple] = {}  # a data-aware merge's statistics per kind (native.merges.pair_stats)
        # native.transplant: both sides given one vocabulary first (the host scored with the target tokenizer), so that
        # the embeddings and head are shared tensors like every other
        ts = NativeSettings.from_cfg(cfg).transplant_settings()
        self.transplant: dict[str, Any] | None = None
        if ts is not None:
            from mergescope.device import resolve_device
            from mergescope.native.transplant import transplant_pair

            self.transplant = transplant_pair(self, ts, resolve_device(cfg.device))
        self.coverage = coverage(self.sd_a, self.sd_b)
        if not self.coverage.shared:
            raise MergescopeError(f"{pair_label(cfg)} shares no tensor of the same name and shape; the native route is undefined")
        if self.sd_base is not None and (bad := base_blockers(self.coverage.shared, self.sd_a, self.sd_base)):
            raise MergescopeError(f"native.base {model_label(be)} is not a base of {pair_label(cfg)}: {'; '.join(bad[:3])}"
                                  f"{f' (and {len(bad) - 3} more)' if len(bad) > 3 else ''}")

    def set_shared(self, values: dict[str, Any]) -> None:
        """Write the given shared tensors into the host, in place, tensor by tensor."""
        sd = self.host.state_dict()
        for name, v in values.items():
            sd[name].copy_(v.to(sd[name].device, sd[name].dtype))

    def restore(self) -> None:
        for n in self.coverage.shared:  # one tensor at a time (sd_a may be streamed from its file)
            self.set_shared({n: self.sd_a[n]})

    def interpolate(self, t: float) -> None:
        sd = self.host.state_dict()
        for n in self.coverage.shared:
            a, b = self.sd_a[n], self.sd_b[n]
            sd[n].copy_(((1 - t) * a + t * b).to(sd[n].device, sd[n].dtype))


def outcome_langs(cfg: DictConfig) -> list[str]:
    """The languages a merge is scored on, in order: the host's, and model b's too under ``native.outcome=both`` when it
    differs (each contributes its first ``native.nll_sentences`` sentences)."""
    a, b = str(cfg.pair.a.lang), str(cfg.pair.b.lang)
    return [a, b] if NativeSettings.from_cfg(cfg).outcome == "both" and b != a else [a]


def _outcome_sentences(data_cfg, cfg: DictConfig) -> tuple[str, ...]:
    ns = NativeSettings.from_cfg(cfg)
    return tuple(s for lang in outcome_langs(cfg) for s in ns.sentences(data_mod.load_side(data_cfg, lang).sentences))


def nll_sentences(cfg: DictConfig) -> tuple[str, ...]:
    """What the LMC curve and every merge are scored on: the host's first ``native.nll_sentences`` sentences (and, under
    ``native.outcome=both``, model b's language's after them)."""
    return _outcome_sentences(cfg.data, cfg)


def select_sentences(cfg: DictConfig) -> tuple[str, ...] | None:
    """The host language's first ``native.nll_sentences`` sentences of ``native.select_split`` (and model b's under
    ``native.outcome=both``, as :func:`nll_sentences`): what the native run
    chooses the operator behind its ``merge_gain`` on, never the reported sentences. None when the split is unset or
    shares lines with ``data.split`` (nothing is chosen then; the native job refuses that case before any run)."""
    ns = NativeSettings.from_cfg(cfg)
    if ns.select_split is None or ns.select_overlap(cfg):
        return None
    c = plain_copy(cfg.data)
    c.split = ns.select_split
    return _outcome_sentences(c, cfg)


def nll_langs(cfg: DictConfig) -> list[str]:
    """``native.nll_langs``: languages every merged model (and each expert and the base) is also scored on, beside the
    host's (a multilingual merge: does it keep both languages?). Absent or empty: the host's language only."""
    return list(NativeSettings.from_cfg(cfg).nll_langs)


def lang_sentences(cfg: DictConfig, lang: str) -> tuple[str, ...]:
    """The first ``native.nll_sentences`` sentences of one language's side of the evaluation data."""
    return NativeSettings.from_cfg(cfg).sentences(data_mod.load_side(cfg.data, lang).sentences)


def lang_endpoints(cfg: DictConfig, loaded: Loaded, host: tuple[tuple[str, ...], Scores, Scores] | None = None,
                   kept: dict[tuple[str, str], Scores] | None = None) -> dict[str, float]:
    """Each expert's and the base's NLL on every language of ``native.nll_langs``: ``nll_a_<lang>`` (the host),
    ``nll_b_<lang>`` (every shared tensor from b: model b itself when all its tensors are shared) and
    ``nll_base_<lang>`` (every shared tensor from the task-vector base, when there is one). ``kept``: the two
    experts' per-sentence scores on each language go in it as ``("a" | "b", lang)`` (each merge's gain on the
    language is measured against them, :func:`lang_gains`).

    ``host``: (sentences, the scores at t=0 and at t=1) already measured on the host's sentences (the LMC curve's
    ends); a language whose sentences are exactly those takes them instead of a second forward of the same models."""
    langs = nll_langs(cfg)
    if not langs:
        return {}
    texts = {lang: lang_sentences(cfg, lang) for lang in langs}
    kept = {} if kept is None else kept

    def scores(t, end: int, who: str, lang: str) -> float:
        known = host is not None and tuple(t) == tuple(host[0])
        kept[(who, lang)] = host[1 + end] if known else host_scores(cfg, loaded, t, f"nll {who} {lang}")
        return kept[(who, lang)].nats_per_token

    out = {f"nll_a_{lang}": scores(t, 0, "a", lang) for lang, t in texts.items()}
    loaded.interpolate(1.0)
    out.update({f"nll_b_{lang}": scores(t, 1, "b", lang) for lang, t in texts.items()})
    if loaded.sd_base is not None:
        for n in loaded.coverage.shared:
            loaded.set_shared({n: loaded.sd_base[n]})
        out.update({f"nll_base_{lang}": host_nll(cfg, loaded, t, f"nll base {lang}") for lang, t in texts.items()})
    loaded.restore()
    return out


def lang_gains(cfg: DictConfig, ends: dict[tuple[str, str], Scores], merged: dict[str, list[Scores]]) -> dict[str, float]:
    """A merge's gain over the better expert on each language of ``native.nll_langs`` (``merge_gain_<lang>``, both
    scopes): the better of the two experts' NLL there minus the merge's, with its paired interval over that language's
    documents (FLORES articles); a stochastic merge's seeds enter the interval as a distribution."""
    from mergescope.evidence import gain_over_best

    out: dict[str, float] = {}
    for lang, ms in merged.items():
        if ("a", lang) not in ends or ("b", lang) not in ends or not ms:
            continue
        docs, what = documents(cfg.data, lang, len(ms[0].nll))
        out.update(gain_over_best(f"merge_gain_{lang}", [ends[("a", lang)], ends[("b", lang)]],
                                  ms[0] if len(ms) == 1 else ms, docs, what))
    return out


def host_scores(cfg: DictConfig, loaded: Loaded, sentences, label: str) -> Scores:
    """Per-sentence scores of the host as it now is (:mod:`mergescope.scoring.bpb`)."""
    return score_sentences(loaded.host, loaded.tok, sentences, batch_tokens=cfg.represent.batch_tokens,
                           max_length=int(cfg.represent.max_length), progress=bool(cfg.progress), label=label)


def host_nll(cfg: DictConfig, loaded: Loaded, sentences, label: str) -> float:
    return host_scores(cfg, loaded, sentences, label).nats_per_token


def nll_documents(cfg: DictConfig) -> tuple[list[str] | None, str]:
    """The documents (FLORES articles) of :func:`nll_sentences`, what a merge's paired interval resamples. Under
    ``native.outcome=both`` a parallel article's sentences in the two languages are one document (resampled together:
    they say the same thing)."""
    ns = NativeSettings.from_cfg(cfg)
    out: list[str] = []
    what = "sentence"
    for lang in outcome_langs(cfg):
        n = len(ns.sentences(data_mod.load_side(cfg.data, lang).sentences))
        ids, what = documents(cfg.data, lang, n)
        if ids is None:
            return None, "sentence"
        out += ids
    return out, what


def lmc_grid(n: int) -> np.ndarray:
    """``n`` evenly spaced t in [0, 1], plus t = 0.5 when ``n`` is even: the midpoint is always measured."""
    return np.union1d(np.linspace(0.0, 1.0, n), [0.5])


def lmc_curve(cfg: DictConfig, loaded: Loaded, sentences) -> tuple[np.ndarray, np.ndarray, float, tuple[Scores, Scores]]:
    """(t grid, NLL(t), barrier, the two endpoints' per-sentence scores); barrier = max over interior t of NLL(t) -
    [(1-t) NLL(0) + t NLL(1)].

    Interior points only (0 < t < 1): at the endpoints the difference is 0 by construction, and
    including them would floor the barrier at 0, hiding the negative barriers of near checkpoints
    (the spec's median for pairs within half a decade is -0.033)."""
    ts = lmc_grid(NativeSettings.from_cfg(cfg).lmc_points)
    scores = []
    for t in ts:
        loaded.interpolate(float(t))
        scores.append(host_scores(cfg, loaded, sentences, f"lmc t={t:.2f}"))
    loaded.restore()
    nll = np.array([s.nats_per_token for s in scores])
    chord = (1 - ts) * nll[0] + ts * nll[-1]
    return ts, nll, float(np.max((nll - chord)[1:-1])), (scores[0], scores[-1])
