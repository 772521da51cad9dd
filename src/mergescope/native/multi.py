"""``task=merge`` on a base and any number of models (``+merge.models=[...]``, per-model ``merge.weights``), or on a
mergekit YAML (``merge=mergekit merge.config=path.yaml``, :mod:`mergescope.native.mergekit_in`): one run
(kind=merge, route=native).

The host is the first model, loaded once with its tokenizer; every model and the base are read tensor by tensor
from their safetensors files (:func:`mergescope.stream.streamed_state`), so the merge needs the host plus
one tensor position of each model in memory. The merged tensors are those every model (and the base) holds with
one name and shape; the host keeps its others. Scored on every model's language (and ``native.nll_langs``):
``nll_<lang>`` for the merged model, ``nll_m<i>_<lang>`` for model i, ``nll_base_<lang>``; ``nll`` and
``merge_gain`` (best single model's NLL - merged NLL) on the host's language, ``merge_gain_<lang>`` on each.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from omegaconf import DictConfig

from mergescope import models
from mergescope.config import to_plain
from mergescope.errors import MergescopeError
from mergescope.merge import check_base, merge_state_dicts, mergekit_yaml, resolve_preset, stochastic
from mergescope.native.mergekit_in import read_mergekit
from mergescope.native.pair import host_nll, lang_sentences, nll_langs
from mergescope.native.spec import Spec, model_entry
from mergescope.native.settings import NativeSettings
from mergescope.native.stats import GRAM_RULE, STATS_KEYS, check_stats, each_model
from mergescope.stream import StreamedState, load_streamed, streamed_state
from mergescope.progress import console
from mergescope.runs import JobResult, JobSpec, model_label, run_once

MULTI_ONLY = ("models", "base", "config", "lang", "slices", "tokenizer_source")  # merge.* keys that are no operator keyword
MULTI_KEYS = ["merge", "data", "native.nll_sentences", "native.nll_langs", "native.merge_seeds", "represent.max_length"]


def is_multi(cfg: DictConfig) -> bool:
    m = cfg.get("merge")
    return m is not None and (m.get("models") is not None or m.get("slices") is not None or m.get("name") == "mergekit")


def spec_of(cfg: DictConfig) -> Spec:
    if cfg.merge.get("name") == "mergekit":
        return read_mergekit(cfg)
    if cfg.merge.get("slices") is not None:
        if cfg.merge.get("models") is not None:
            raise MergescopeError("merge.models and merge.slices together: give one of them (slices name their models)")
        from mergescope.native.sliced import preset_slices

        return preset_slices(cfg, {k: v for k, v in to_plain(cfg.merge).items() if k not in MULTI_ONLY})
    ms = cfg.merge.models
    if isinstance(ms, str) or len(ms) < 1:
        raise MergescopeError("merge.models must be a list of models: +merge.models=[<conf/model name or path>, ...]")
    entries = [model_entry(cfg, m, f"merge.models[{i}]") for i, m in enumerate(ms)]
    base = cfg.merge.get("base")
    base_e = model_entry(cfg, base, "merge.base") if base is not None else None
    preset = {k: v for k, v in to_plain(cfg.merge).items() if k not in MULTI_ONLY}
    return Spec(preset, entries, base_e, tokenizer=_tokenizer_of(cfg, entries, base_e))


def _tokenizer_of(cfg: DictConfig, entries: list[DictConfig], base: DictConfig | None) -> dict[str, Any] | None:
    """``merge.tokenizer_source`` (mergekit's): union | base | one of the models (a conf/model name, folder or hub id)
    -> the Spec's ``tokenizer``; absent -> None."""
    v = cfg.merge.get("tokenizer_source")
    if v is None:
        return None
    if v in ("union", "base"):
        return {"kind": "union" if v == "union" else "model", "source": "base" if base is not None else 0}
    want = models.resolve(model_entry(cfg, v, "merge.tokenizer_source"))
    for i, e in enumerate([*entries, *([base] if base is not None else [])]):
        r = models.resolve(e)
        if (r.location, r.revision) == (want.location, want.revision):
            return {"kind": "model", "source": i if i < len(entries) else "base"}
    raise MergescopeError(f"merge.tokenizer_source={v}: not one of the merged models or the base; name one of them, "
                          "or union, or base")


def check_spec(cfg: DictConfig, spec: Spec):
    entry, kwargs = resolve_preset(spec.preset, n_models=len(spec.entries))
    check_base(entry, spec.base is not None, "no merge.base given (+merge.base=<the models' common base>)")
    if entry.meta.get("needs_stats"):
        check_stats(cfg)
    refs = [models.resolve(e) for e in spec.entries]
    seen = {}
    for r in refs:
        if (r.location, r.revision) in seen:
            raise MergescopeError(f"merge.models lists {r.label} twice")
        seen[(r.location, r.revision)] = r
    uses_base = bool(entry.meta.get("needs_base") or kwargs.get("task_vectors"))
    base_ref = models.resolve(spec.base) if spec.base is not None and uses_base else None
    for lang in langs_of(cfg, spec):
        from mergescope import data as data_mod

        data_mod.load_side(cfg.data, lang)
    for r in [*refs, *([base_ref] if base_ref else [])]:
        models.check_weights(r, cfg.paths.cache)
    return entry, kwargs, refs, base_ref


def langs_of(cfg: DictConfig, spec: Spec) -> list[str]:
    out: list[str] = []
    for lang in [*(str(e.lang) for e in spec.entries), *nll_langs(cfg)]:
        if lang not in out:
            out.append(lang)
    return out


def _state(model) -> dict[str, Any]:
    return {k: v.detach() for k, v in model.state_dict().items()}


class Stack:
    """The host (models[0]) loaded with its tokenizer; every model's and the base's state dict streamed."""

    def __init__(self, cfg: DictConfig, spec: Spec, refs, base_ref):
        e0 = spec.entries[0]
        cache = cfg.paths.get("cache")
        streamed = load_streamed(refs[0], models.merge_dtype(e0.dtype), cache_root=cache) if not refs[0].gguf_file else None
        host = models.load(e0, cfg.device, ref=refs[0], quiet=True, dtype=models.merge_dtype(e0.dtype), model=streamed)
        self.host, self.tok, self.true_config = host.model, host.tokenizer, host.true_config
        self.sds = []
        for i, (e, r) in enumerate(zip(spec.entries, refs)):
            s = streamed_state(r, models.merge_dtype(e.dtype), model=self.host if i == 0 else None, cache_root=cache)
            if s is None:
                s = (_state(models.load_model(r, models.merge_dtype(e.dtype), "cpu")), None)
            self.sds.append(s[0])
        self.sd_base = None
        if base_ref is not None:
            s = streamed_state(base_ref, models.merge_dtype(spec.base.dtype), cache_root=cache)
            self.sd_base = s[0] if s else _state(models.load_model(base_ref, models.merge_dtype(spec.base.dtype), "cpu"))
        self.transplant: dict[str, Any] | None = None
        if spec.tokenizer is not None:  # mergekit's tokenizer_source: every model given one vocabulary first
            self.tokenizers = [host.tokenizer, *(models.load_tokenizer(r) for r in refs[1:]),
                               *([models.load_tokenizer(base_ref)] if base_ref is not None else [])]
            self.labels = [*(model_label(e) for e in spec.entries), *([model_label(spec.base)] if base_ref is not None else [])]
            from mergescope.device import resolve_device
            from mergescope.native.transplant import transplant_group

            kind, order = tokenizer_order(spec, base_ref is not None)
            self.transplant = transplant_group(self, kind, order, transplant_settings(cfg), resolve_device(cfg.device))
        self.shared, self.excluded = shared_names(self.sds, self.sd_base)
        self.merge_stats: list | None = None  # a data-aware merge's statistics, one dict per model (ensure_stats)
        if not self.shared:
            raise MergescopeError("the models share no tensor of one name and shape: the native route is undefined for them")

    def all_states(self) -> list:
        """Every model's state dict, then the base's (when it is read)."""
        return [*self.sds, *([self.sd_base] if self.sd_base is not None else [])]

    def set_state(self, i: int, sd) -> None:
        """Replace state i of :meth:`all_states` (a transplant's overlay)."""
        if i < len(self.sds):
            self.sds[i] = sd
        else:
            self.sd_base = sd

    def set(self, values) -> None:
        sd = self.host.state_dict()
        for name, v in values.items():
            sd[name].copy_(v.to(sd[name].device, sd[name].dtype))

    def load_from(self, sd) -> None:
        for n in self.shared:
            self.set({n: sd[n]})

    def restore(self) -> None:
        self.load_from(self.sds[0])

    def ensure_stats(self, cfg: DictConfig, entry, langs: list[str]) -> dict[str, float]:
        """A data-aware operator's statistics of every model, each on its own language (model i written into the
        host in turn); what was read, as metrics. Nothing for the other operators."""
        kind = entry.meta.get("needs_stats")
        if not kind or self.merge_stats is not None:
            return {}
        self.merge_stats, read = each_model(kind, cfg, self.host, self.tok, langs, lambda i: self.load_from(self.sds[i]),
                                            self.restore, self.shared)
        return read

    def merge_into_host(self, entry, kwargs: dict, device) -> None:
        """The merge written into the host tensor by tensor (one position of each model in memory at a time). An
        operator that upcasts block by block (``streams_stored``: task arithmetic, TIES) reads the streamed models in
        their stored dtype and returns float32: the same numbers, without full-size float32 copies of a bfloat16
        checkpoint's embedding and head (the peak of a 1B merge)."""
        stored = bool(entry.meta.get("streams_stored"))
        sds = [s.stored() if stored and isinstance(s, StreamedState) else s for s in self.sds]
        base = self.sd_base.stored() if stored and isinstance(self.sd_base, StreamedState) else self.sd_base
        host = self.host.state_dict()
        for name in self.shared:
            self.set(merge_state_dicts(entry, kwargs, sds, base, [name], device, self.merge_stats, out_dtype=host[name].dtype))


def tokenizer_order(spec: Spec, has_base: bool) -> tuple[str, list[int]]:
    """(union | model, the indices into :meth:`Stack.all_states` with the tokenizer source first): a union of every
    model's (and the base's) tokenizer in that order, or the source's tokenizer."""
    n = len(spec.entries)
    src = spec.tokenizer["source"]
    if src == "base" and not has_base:
        raise MergescopeError("tokenizer_source names the base, which this merge does not read: name one of the models")
    first = n if src == "base" else int(src)
    return spec.tokenizer["kind"], [first, *(i for i in range(n + int(has_base)) if i != first)]


def transplant_settings(cfg: DictConfig):
    """The transplant's method, control and k: ``native.transplant`` when set (its tokenizer is the merge's
    ``tokenizer_source``, not read here), else the defaults (OMP, k 64, control subword)."""
    from mergescope.native.settings import TransplantSettings

    return NativeSettings.from_cfg(cfg).transplant_settings() or TransplantSettings()


def shared_names(sds, base) -> tuple[list[str], list[tuple[str, str]]]:
    """Names every model (and the base) holds as a floating-point tensor of one shape, in model 0's order (a tensor
    tied to an earlier one in model 0 is merged once, through its partner); the others with the reason."""
    first = sds[0]
    ties = getattr(first, "ties", {}) or {}
    shared, excluded = [], []
    for name in first:
        if name in ties:
            excluded.append((name, f"tied to {ties[name]} (merged once)"))
            continue
        shape, floating = _header(first, name)
        bad = next((f"not in model {i}" for i, sd in enumerate(sds) if name not in sd), None)
        if bad is None and base is not None and name not in base:
            bad = "not in the base"
        if bad is None and not floating:
            bad = f"not a floating-point tensor ({str(first[name].dtype).replace('torch.', '')})"
        if bad is None:
            other = [(f"model {i}", sd) for i, sd in enumerate(sds[1:], 1)] + ([("the base", base)] if base is not None else [])
            bad = next((f"shape {s} in {w}, {shape} in model 0" for w, sd in other if (s := _header(sd, name)[0]) != shape), None)
        (excluded.append((name, bad)) if bad else shared.append(name))
    return shared, excluded


def _header(sd, name: str) -> tuple[tuple[int, ...], bool]:
    """(shape, floating point) of a tensor: from the file's header for a streamed state (nothing read), else the tensor."""
    if isinstance(sd, StreamedState):
        return sd.header(name)
    t = sd[name]
    return tuple(t.shape), t.is_floating_point()


def labels(spec: Spec) -> list[str]:
    return [model_label(e) for e in spec.entries]


def mergekit_text(spec: Spec, refs, base_ref, entry, kwargs: dict, stack: Stack) -> str:
    def ref(r) -> str:
        return r.location if r.local or not r.revision else f"{r.location}@{r.revision}"

    notes = list(spec.notes)
    if stack.transplant is not None:
        notes.append(f"mergescope first gave every model one vocabulary ({stack.transplant['target']}, a new token's rows by "
                     f"{stack.transplant['method']}); mergekit's tokenizer_source copies a missing token's row from a model "
                     "that holds it")
    if stack.excluded:
        notes.append(f"mergescope merges the {len(stack.shared)} tensors every model holds into model 0 and keeps its other "
                     f"{len(stack.excluded)}; mergekit needs every tensor in every model")
    return mergekit_yaml(entry, kwargs, [ref(r) for r in refs], ref(base_ref) if base_ref is not None else None,
                         extra_notes=notes)


def run_merge_n(cfg: DictConfig, overrides: list[str] | None = None) -> JobResult:
    """One merged model of N models (``+merge.models``) or of a mergekit YAML (``merge=mergekit``): its own run.
    ``save=true`` writes the merged model under ``paths.merged/<run id>/``; ``eval=lm_eval`` scores it with
    lm-evaluation-harness afterwards, one kind=eval run tagged ``merge_run``."""
    spec = spec_of(cfg)
    if spec.slices is not None:  # a merge by layer slices: its own depth, its own route
        from mergescope.native.sliced import run_sliced

        return run_sliced(cfg, spec, overrides)
    entry, kwargs, refs, base_ref = check_spec(cfg, spec)
    if spec.tokenizer is not None:  # the target vocabulary built once before any run (a union of unlike tokenizers fails here)
        _check_target_tokenizer(spec, refs, base_ref)
    langs = langs_of(cfg, spec)
    names = labels(spec)
    host_lang = str(spec.entries[0].lang)
    held: dict[str, Stack] = {}

    def body(job) -> dict[str, float]:
        stack = held["stack"] = Stack(cfg, spec, refs, base_ref)
        texts = {lang: lang_sentences(cfg, lang) for lang in langs}
        job.log_params({"models": names, "weights": kwargs.get("weights"), "merge_base": model_label(spec.base) if base_ref else None,
                        "source": spec.source, "excluded_reasons": dict(stack.excluded[:50]), "model_0.true": stack.true_config})
        values: dict[str, float] = {}
        if stack.transplant is not None:  # tokenizer_source: what was done, and each transplanted model's cost run
            values.update(_transplant_costs(cfg, spec, stack, base_ref is not None, job, overrides))
        for i, sd in enumerate(stack.sds):  # each model alone on every language (the host = model 0)
            stack.load_from(sd)
            values.update({f"nll_m{i}_{lang}": host_nll(cfg, stack, t, f"nll m{i} {lang}") for lang, t in texts.items()})
        values.update(stack.ensure_stats(cfg, entry, [str(e.lang) for e in spec.entries]))
        if stack.sd_base is not None:
            stack.load_from(stack.sd_base)
            values.update({f"nll_base_{lang}": host_nll(cfg, stack, t, f"nll base {lang}") for lang, t in texts.items()})
        n = NativeSettings.from_cfg(cfg).merge_seeds if stochastic(kwargs) else 1
        by_lang: dict[str, list[float]] = {lang: [] for lang in langs}
        for s in range(n):
            kw = {**kwargs, "seed": int(kwargs["seed"]) + s} if stochastic(kwargs) else kwargs
            stack.merge_into_host(entry, kw, cfg.device)
            for lang, t in texts.items():
                by_lang[lang].append(host_nll(cfg, stack, t, f"nll {cfg.merge.name} {lang}" + (f" seed {kw['seed']}" if n > 1 else "")))
            if n > 1:
                job.log_metrics({"nll_by_seed": by_lang[host_lang][-1]}, step=s)
            if s == 0 and cfg.get("save"):
                from mergescope.native.save import save_merged

                job.log_params({"saved_to": save_merged(cfg, stack.host, stack.tok, job.run_id, entry, kwargs, names,
                                                        model_label(spec.base) if base_ref is not None else None, spec.source)})
        stack.restore()
        for lang in langs:
            values[f"nll_{lang}"] = float(np.mean(by_lang[lang]))
            values[f"merge_gain_{lang}"] = min(values[f"nll_m{i}_{lang}"] for i in range(len(stack.sds))) - values[f"nll_{lang}"]
        a = np.asarray(by_lang[host_lang])
        values.update({"nll": float(a.mean()), "nll_sd": float(a.std(ddof=1)) if n > 1 else 0.0, "n_seeds": float(n),
                       "merge_gain": values[f"merge_gain_{host_lang}"], "n_models": float(len(refs)),
                       "n_shared_tensors": float(len(stack.shared)), "n_sentences": float(len(texts[host_lang]))})
        job.log_text(mergekit_text(spec, refs, base_ref, entry, kwargs, stack), "merge/mergekit.yaml")
        console.print(f"  merge {cfg.merge.name} of {len(refs)} models: nll={values['nll']:.4f} ({host_lang})")
        return values

    tags, extra = _merge_identity(cfg, spec, entry, kwargs, base_ref, names, langs, host_lang)
    reads = [*refs, *([base_ref] if base_ref is not None else [])]
    res = run_once(cfg, JobSpec(f"merge {cfg.merge.name} {' + '.join(names)}", tags, task="merge_n",
                                keys=[k for k in MULTI_KEYS if k != "merge"] + (STATS_KEYS if entry.meta.get("needs_stats") else []),
                                reads=reads, extra=extra), body, overrides)
    if _lm_eval(cfg):
        from mergescope.scoring.eval_run import run_lm_eval

        def merged():  # the merged model in the host: from the run just done, else merged again
            stack = held.get("stack") or Stack(cfg, spec, refs, base_ref)
            stack.ensure_stats(cfg, entry, [str(e.lang) for e in spec.entries])
            stack.merge_into_host(entry, kwargs, cfg.device)
            return stack.host, stack.tok

        run_lm_eval(cfg, merged, langs, res, overrides, reads,
                           {"merge": str(cfg.merge.name), "operator": entry.name, "models": ",".join(names), "pair": "+".join(names)})
    return res


def _check_target_tokenizer(spec: Spec, refs, base_ref) -> None:
    """``tokenizer_source``: the target vocabulary built once before any run (a union of unlike tokenizers fails here)."""
    from mergescope.native.transplant import target_tokenizer

    kind, order = tokenizer_order(spec, base_ref is not None)
    every = [*refs, *([base_ref] if base_ref is not None else [])]
    target_tokenizer(kind, [models.load_tokenizer(every[i]) for i in order], [every[i].label for i in order])


def _merge_identity(cfg: DictConfig, spec: Spec, entry, kwargs, base_ref, names, langs, host_lang) -> tuple[dict, dict]:
    """An N-model merge run's tags and the extra parts of its identity (what changes its numbers beyond the keys)."""
    tags = {"kind": "merge", "route": "native", "merge": cfg.merge.name, "operator": entry.name, "pair": "+".join(names),
            "models": ",".join(names), "n_models": len(names), "model_a": names[0], "lang_a": host_lang,
            "langs": ",".join(langs), "base": model_label(spec.base) if base_ref is not None else None,
            "seed": kwargs.get("seed", cfg.seed), "source": spec.source}
    extra = {"spec": {"operator": entry.name, "kwargs": kwargs, "models": [to_plain(e) for e in spec.entries],
                      "base": to_plain(spec.base) if base_ref is not None else None}}
    if spec.tokenizer is not None:  # unset: every earlier hash unchanged
        from dataclasses import asdict

        extra["tokenizer"] = {**spec.tokenizer, "transplant": asdict(transplant_settings(cfg))}
        tags["tokenizer_source"] = spec.tokenizer["kind"] if spec.tokenizer["kind"] == "union" else f"model {spec.tokenizer['source']}"
    if cfg.get("save"):
        extra["save"] = True
    from mergescope import data as data_mod

    extra["merge_data"] = data_mod.content_digest(cfg.data, langs, [str(cfg.data.get("split"))])
    if entry.meta.get("needs_stats") == "gram":
        extra["gram"] = GRAM_RULE
    if entry.meta.get("needs_stats"):  # the statistics' split of every model's language
        extra["stats_data"] = data_mod.content_digest(cfg.data, [str(e.lang) for e in spec.entries],
                                                      [str(cfg.merge_stats.split)])
    return tags, extra


def _transplant_costs(cfg: DictConfig, spec: Spec, stack: Stack, has_base: bool, job, overrides) -> dict[str, float]:
    """The transplant of each model whose vocabulary differs from the target: its own cost run
    (:func:`mergescope.native.transplant.run_transplant`), its cost and its control's as
    ``transplant_<metric>_m<i>`` (``_base``)."""
    from mergescope.native.transplant import run_transplant

    job.log_params({"transplant": stack.transplant})
    kind, order = tokenizer_order(spec, has_base)
    entries = [*spec.entries, *([spec.base] if has_base else [])]
    ts = transplant_settings(cfg)
    out, runs = {}, {}
    for i in stack.transplanted:
        r = run_transplant(cfg, entries[i], kind, [entries[j] for j in order], ts, overrides)
        who = f"m{i}" if i < len(spec.entries) else "base"
        runs[who] = r.run_id
        out.update({f"transplant_{k}_{who}": r.metrics[k] for k in ("cost_bpb", "control_cost_bpb", "cost_nll",
                                                                    "control_cost_nll", "n_new") if k in r.metrics})
    job.log_params({"transplant_runs": runs})
    return out


def _lm_eval(cfg: DictConfig) -> bool:
    return cfg.get("eval") is not None and str(cfg.eval.get("name")) == "lm_eval"
