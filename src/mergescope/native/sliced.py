"""``task=merge`` by layer slices: layer stacking (``passthrough``) and per-slice merges, one run (kind=merge,
route=native), the merged model's depth the sum of its slices'.

Two ways in: a mergekit YAML with ``slices:`` (``merge=mergekit merge.config=path.yaml``, :mod:`mergescope.native.mergekit_in`:
per-slice and per-source settings as mergekit resolves them), or a preset with ``+merge.slices`` in mergekit's syntax
(``[{sources: [{model: <name, folder or hub id>, layer_range: [0, 4]}, ...]}, ...]``, a one-source slice also as
``{model: ..., layer_range: ...}``; the preset's settings apply to every slice; an operator that uses a base takes
``+merge.base``, which every slice must list among its sources with its layer range, as in mergekit).

The merge itself is :func:`mergescope.merge.passthrough.stacked` (which tensor is what by rule, not by file order);
every model is streamed tensor by tensor from its safetensors files. The merged model is built from its true config
(:func:`mergescope.merge.passthrough.stacked_config`: ``num_hidden_layers`` the new depth, ``layer_types`` picked
layer by layer) with the first slice's first model's tokenizer, scored on every model's language as an N-model merge
is (``nll_<lang>``, ``nll_m<i>_<lang>`` of each model alone, ``merge_gain_<lang>``; ``nll``, ``merge_gain`` on the
first model's language; ``n_layers`` the merged depth), logged as a mergekit ``slices:`` YAML, and with ``save=true``
written like every merge (its config.json states the new depth).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
from omegaconf import DictConfig

from mergescope import models
from mergescope.config import to_plain
from mergescope.device import resolve_device
from mergescope.errors import MergescopeError
from mergescope.merge import check_base, resolve_preset, stochastic
from mergescope.merge._mergekit import put_varying
from mergescope.merge.passthrough import Slice, Source, check_slices, depth, embedding_names, stacked, stacked_config
from mergescope.native.pair import host_nll, lang_sentences, nll_langs
from mergescope.native.settings import NativeSettings
from mergescope.native.spec import SliceSpec, Spec, model_entry
from mergescope.progress import console
from mergescope.runs import JobResult, JobSpec, model_label, run_once
from mergescope.tensor_settings import any_varies, variants

KEYS = ["data", "native.nll_sentences", "native.nll_langs", "native.merge_seeds", "represent.max_length"]


def preset_slices(cfg: DictConfig, preset: dict[str, Any]) -> Spec:
    """``+merge.slices`` (module doc) with the preset's settings -> the sliced :class:`Spec`."""
    raw = to_plain(cfg.merge.slices)
    if not isinstance(raw, list) or not raw:
        raise MergescopeError("merge.slices must be a non-empty list: '+merge.slices=[{sources:[{model:<m>,layer_range:[0,4]}]}, ...]'")
    entry, kw = resolve_preset(preset)
    base = cfg.merge.get("base")
    base_key = json.dumps(to_plain(base), sort_keys=True) if base is not None else None
    uses_base = bool(entry.meta.get("needs_base") or kw.get("task_vectors"))
    keys: list[str] = []
    entries = []
    slices = []
    for s, sl in enumerate(raw):
        if isinstance(sl, dict) and "model" in sl and "sources" not in sl:
            sl = {"sources": [sl]}
        if not isinstance(sl, dict) or set(sl) != {"sources"} or not isinstance(sl["sources"], list) or not sl["sources"]:
            raise MergescopeError(f"merge.slices[{s}] must be {{sources: [{{model: ..., layer_range: [start, end]}}, ...]}} "
                                  "(settings come from the preset; per-slice settings: a mergekit YAML, merge=mergekit)")
        srcs, base_src = [], None
        for i, src in enumerate(sl["sources"]):
            at = f"merge.slices[{s}].sources[{i}]"
            if not isinstance(src, dict) or set(src) != {"model", "layer_range"}:
                raise MergescopeError(f"{at} must be {{model: <name, folder or hub id>, layer_range: [start, end]}}")
            r = src["layer_range"]
            if (not isinstance(r, list) or len(r) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in r)
                    or not 0 <= r[0] < r[1]):
                raise MergescopeError(f"{at}.layer_range={r!r} must be [start, end] with 0 <= start < end (layers start..end-1)")
            key = json.dumps(src["model"], sort_keys=True)
            if key not in keys:
                keys.append(key)
                entries.append(model_entry(cfg, src["model"], f"{at}.model"))
            source = Source(keys.index(key), int(r[0]), int(r[1]))
            if uses_base and key == base_key:
                base_src = source
            else:
                srcs.append(source)
        if uses_base and base_src is None:
            raise MergescopeError(f"merge.slices[{s}] does not list the base ({base}) among its sources: merge "
                                  f"'{entry.name}' uses it; add {{model: {base}, layer_range: [...]}} to the slice")
        slices.append(SliceSpec(srcs, base_src, dict(preset)))
    return Spec(dict(preset), entries, None, source="merge.slices", slices=slices)


def _config(ref: models.ModelRef):
    from transformers import AutoConfig

    models.quiet_transformers()
    return AutoConfig.from_pretrained(ref.location, trust_remote_code=False, **models.gguf_kwargs(ref), **models.hub_kwargs(ref))


def check_sliced(cfg: DictConfig, spec: Spec):
    """Everything checked before any weight is read: each slice's preset, its base, every model, the layer ranges
    against each model's depth (its config), the data. -> (entry, the plan as Slices with checked kwargs, refs)."""
    plan, entry = [], None
    for k, sl in enumerate(spec.slices or []):
        e, kw = resolve_preset(sl.preset, n_models=len(sl.inputs))
        check_base(e, sl.base is not None, f"slice {k} has no base among its sources")
        entry = entry or e
        plan.append(Slice(list(sl.inputs), sl.base, kw))
    refs = [models.resolve(e) for e in spec.entries]
    configs = [_config(r) for r in refs]
    check_slices(plan, [int(c.num_hidden_layers) for c in configs])
    from mergescope import data as data_mod

    for lang in langs_of(cfg, spec):
        data_mod.load_side(cfg.data, lang)
    for r in refs:
        models.check_weights(r, cfg.paths.cache)
    return entry, plan, refs, configs


def langs_of(cfg: DictConfig, spec: Spec) -> list[str]:
    return list(dict.fromkeys([*(str(e.lang) for e in spec.entries), *nll_langs(cfg)]))


def _states(cfg: DictConfig, spec: Spec, refs) -> list:
    from mergescope.stream import streamed_state

    out = []
    for e, r in zip(spec.entries, refs):
        s = streamed_state(r, models.merge_dtype(e.dtype), cache_root=cfg.paths.get("cache"))
        if s is None:
            s = ({k: v.detach() for k, v in models.load_model(r, models.merge_dtype(e.dtype), "cpu").state_dict().items()}, None)
        out.append(s[0])
    return out


def build(entry, plan: list[Slice], sds, config, dtype: str, device) -> Any:
    """The merged model (on CPU) of the plan: built from ``config`` with no weight initialisation, every state-dict
    tensor written from :func:`stacked` (any left unwritten is an error), ties re-tied."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():
        net = AutoModelForCausalLM.from_config(config, dtype=models.resolve_dtype(dtype), trust_remote_code=False)
    target = net.state_dict()
    written = set()
    with torch.no_grad():
        for name, t in stacked(entry, plan, sds, embedding_names(config), device=device):
            if name not in target or tuple(target[name].shape) != tuple(t.shape):
                raise MergescopeError(f"the sliced merge made tensor '{name}' {tuple(t.shape)}, which the {config.model_type} "
                                      f"config of {config.num_hidden_layers} layers does not hold so: slice models of one architecture")
            target[name].copy_(t)
            written.add(name)
    if missing := [n for n in target if n not in written]:
        raise MergescopeError(f"the sliced merge gave no value for '{missing[0]}': slice models of one architecture")
    net.tie_weights()
    return net.eval()


def mergekit_slices_config(entry, plan: list[Slice], refs: list[str], dtype: str = "float32") -> tuple[dict | None, list[str]]:
    """(the mergekit ``slices:`` YAML of the plan, departures), from each operator's mergekit translation; None when
    mergekit has no method for it."""
    fn = entry.meta.get("mergekit")
    if fn is None:
        return None, [f"mergekit has no equivalent of merge '{entry.name}'"]
    notes: list[str] = []
    out = []
    method = None
    for sl in plan:
        per_tensor = any_varies(sl.kwargs)
        uses_base = sl.base is not None and bool(entry.meta.get("needs_base") or sl.kwargs.get("task_vectors"))
        mk = fn(next(variants(sl.kwargs)) if per_tensor else dict(sl.kwargs), len(sl.inputs), uses_base)
        if mk.method is None:
            return None, mk.notes
        if per_tensor:
            put_varying(mk, sl.kwargs)
        method = mk.method
        notes += [n for n in mk.notes if n not in notes]
        params = mk.model_parameters or [{}] * len(sl.inputs)

        def src(s: Source, p: dict | None = None) -> dict:
            p = {k: v for k, v in (p or {}).items() if v is not None}
            return {"model": refs[s.model], "layer_range": [s.start, s.end], **({"parameters": p} if p else {})}

        if mk.base == "first":
            item = {"sources": [src(sl.inputs[0]), *(src(s, p) for s, p in zip(sl.inputs[1:], params[1:]))],
                    "base_model": refs[sl.inputs[0].model]}
        else:
            item = {"sources": [src(s, p) for s, p in zip(sl.inputs, params)]}
            if mk.base == "base" and uses_base:
                item["sources"].append(src(sl.base))
                item["base_model"] = refs[sl.base.model]
        if mk.parameters:
            item["parameters"] = dict(mk.parameters)
        out.append(item)
    return {"slices": out, "merge_method": method, "dtype": dtype}, notes


def mergekit_slices_yaml(entry, plan: list[Slice], refs: list[str], dtype: str = "float32") -> str:
    import yaml

    cfg, notes = mergekit_slices_config(entry, plan, refs, dtype)
    head = "# mergekit 0.1.5 equivalent of this mergescope merge (mergekit-yaml this.yaml OUT_DIR)\n"
    head += "".join(f"# NOT identical: {n}\n" for n in notes)
    return head + (yaml.safe_dump(cfg, sort_keys=False) if cfg is not None else "# no mergekit config\n")


def _layout(plan: list[Slice], names: list[str]) -> str:
    parts = []
    for k, sl in enumerate(plan):
        w = sl.kwargs.get("weights")
        srcs = ", ".join(f"{names[s.model]} layers {s.start}-{s.end - 1}" + (f" (weight {w[i]})" if w is not None else "")
                         for i, s in enumerate(sl.inputs))
        parts.append(f"  - slice {k}: {srcs}" + (f" (base {names[sl.base.model]} layers {sl.base.start}-{sl.base.end - 1})"
                                                   if sl.base is not None else ""))
    return "\n".join([f"Merged by layer slices into {depth(plan)} layers (embeddings from slice 0, final norm and head "
                      "from the last slice):", *parts])


def run_sliced(cfg: DictConfig, spec: Spec, overrides: list[str] | None = None) -> JobResult:
    """One merged model by layer slices (module doc): its own run."""
    entry, plan, refs, configs = check_sliced(cfg, spec)
    langs = langs_of(cfg, spec)
    names = [model_label(e) for e in spec.entries]
    host_lang = str(spec.entries[0].lang)
    dtype = models.merge_dtype(spec.entries[plan[0].inputs[0].model].dtype)
    out_config = stacked_config(plan, configs)
    seeded = stochastic(plan[0].kwargs)

    def body(job) -> dict[str, float]:
        sds = _states(cfg, spec, refs)
        texts = {lang: lang_sentences(cfg, lang) for lang in langs}
        job.log_params({"models": names, "source": spec.source, "n_layers": depth(plan), "layout": _layout(plan, names),
                        "slices": [{"inputs": [[s.model, s.start, s.end] for s in sl.inputs],
                                    "base": [sl.base.model, sl.base.start, sl.base.end] if sl.base else None} for sl in plan]})
        values: dict[str, float] = {}
        for i, (e, r) in enumerate(zip(spec.entries, refs)):  # each model alone, loaded and dropped in turn
            one = models.load(e, cfg.device, ref=r, quiet=True, dtype=models.merge_dtype(e.dtype))
            held = SimpleNamespace(host=one.model, tok=one.tokenizer)
            values.update({f"nll_m{i}_{lang}": host_nll(cfg, held, t, f"nll m{i} {lang}") for lang, t in texts.items()})
            del one, held
        tok = models.load_tokenizer(refs[plan[0].inputs[0].model])
        n = NativeSettings.from_cfg(cfg).merge_seeds if seeded else 1
        by_lang: dict[str, list[float]] = {lang: [] for lang in langs}
        for s in range(n):
            run_plan = [Slice(sl.inputs, sl.base, {**sl.kwargs, "seed": int(sl.kwargs["seed"]) + s} if seeded else sl.kwargs)
                        for sl in plan]
            net = build(entry, run_plan, sds, out_config, dtype, cfg.device)
            held = SimpleNamespace(host=net.to(resolve_device(cfg.device)), tok=tok)
            for lang, t in texts.items():
                by_lang[lang].append(host_nll(cfg, held, t, f"nll {cfg.merge.name} {lang}" + (f" seed {s}" if n > 1 else "")))
            if n > 1:
                job.log_metrics({"nll_by_seed": by_lang[host_lang][-1]}, step=s)
            if s == 0:
                job.log_params({"merged.true": models.true_config(net)})
                if cfg.get("save"):
                    from mergescope.native.save import save_merged

                    job.log_params({"saved_to": save_merged(cfg, net, tok, job.run_id, entry, plan[0].kwargs, names, None,
                                                            spec.source, layout=_layout(plan, names))})
            del net, held
        for lang in langs:
            values[f"nll_{lang}"] = float(np.mean(by_lang[lang]))
            values[f"merge_gain_{lang}"] = min(values[f"nll_m{i}_{lang}"] for i in range(len(refs))) - values[f"nll_{lang}"]
        a = np.asarray(by_lang[host_lang])
        values.update({"nll": float(a.mean()), "nll_sd": float(a.std(ddof=1)) if n > 1 else 0.0, "n_seeds": float(n),
                       "merge_gain": values[f"merge_gain_{host_lang}"], "n_models": float(len(refs)),
                       "n_layers": float(depth(plan)), "n_slices": float(len(plan)), "n_sentences": float(len(texts[host_lang]))})
        job.log_text(mergekit_slices_yaml(entry, plan, [_ref_text(r) for r in refs]), "merge/mergekit.yaml")
        console.print(f"  merge {cfg.merge.name} by {len(plan)} slices ({depth(plan)} layers): nll={values['nll']:.4f} ({host_lang})")
        return values

    tags = {"kind": "merge", "route": "native", "merge": cfg.merge.name, "operator": entry.name, "pair": "+".join(names),
            "models": ",".join(names), "n_models": len(names), "model_a": names[0], "lang_a": host_lang,
            "langs": ",".join(langs), "base": None, "seed": plan[0].kwargs.get("seed", cfg.seed), "source": spec.source,
            "n_layers": depth(plan), "sliced": True}
    extra = {"spec": {"operator": entry.name, "models": [to_plain(e) for e in spec.entries],
                      "slices": [{"inputs": [[s.model, s.start, s.end] for s in sl.inputs],
                                  "base": [sl.base.model, sl.base.start, sl.base.end] if sl.base else None,
                                  "kwargs": sl.kwargs} for sl in plan]}}
    if cfg.get("save"):
        extra["save"] = True
    from mergescope import data as data_mod

    extra["merge_data"] = data_mod.content_digest(cfg.data, langs, [str(cfg.data.get("split"))])
    res = run_once(cfg, JobSpec(f"merge {cfg.merge.name} slices {' + '.join(names)}", tags, task="merge_sliced", keys=KEYS,
                                reads=refs, extra=extra), body, overrides)
    if cfg.get("eval") is not None and str(cfg.eval.get("name")) == "lm_eval":
        from mergescope.scoring.eval_run import run_lm_eval

        def merged():  # built again (the run's model was dropped after scoring)
            net = build(entry, plan, _states(cfg, spec, refs), out_config, dtype, cfg.device)
            return net.to(resolve_device(cfg.device)), models.load_tokenizer(refs[plan[0].inputs[0].model])

        run_lm_eval(cfg, merged, langs, res, overrides, refs,
                           {"merge": str(cfg.merge.name), "operator": entry.name, "models": ",".join(names), "pair": "+".join(names)})
    return res


def _ref_text(r) -> str:
    return r.location if r.local or not r.revision else f"{r.location}@{r.revision}"
